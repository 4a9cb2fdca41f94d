"""The three benchmark scenarios: the real training/sampling step, cut down to one timed call.

Each builder returns a zero-argument ``step()`` that does exactly what ``med_ddpm.train`` or
``med_ddpm.sample`` does per iteration, with every recipe hook in the same place:

* ``train_step``   forward + L1 ε-loss (under ``forward_context``) + backward + Adam step;
* ``denoise_step`` one network forward under ``no_grad`` (the unit of sampling cost);
* ``full_sample``  the whole reverse chain through :func:`med_ddpm.samplers.sample`.

:func:`run_scenario` wraps a builder in the recipe stack's session, times it
(:mod:`bench.timing`), and returns the measurement fields of a results row. It raises
:class:`UnsupportedStack` / :class:`NonFiniteOutput` so the worker can turn them into rows.

Example:
    >>> fields = run_scenario(cfg, torch.device("cuda"))   # cfg: a resolved bench config
    >>> fields["ms_median"], fields["peak_mem_gib"]
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from bench.timing import (
    achieved_tflops,
    active_precision,
    count_flops,
    flush,
    peak_fraction,
    peak_memory_gib,
    time_fn,
    time_once,
)
from med_ddpm.diffusion import NoiseSchedule, diffusion_loss
from med_ddpm.model import build_model
from med_ddpm.quality import randomize_zero_init
from med_ddpm.samplers import sample, sampler_from_config
from med_ddpm.utils import seed_everything
from optim import RecipeStack

Step = Callable[[], torch.Tensor]
Parts = tuple[nn.Module, NoiseSchedule, RecipeStack, torch.Tensor, torch.Tensor]  # model, schedule, stack, x0, cond
ADAM_LR = 1e-5  # Med-DDPM's training learning rate
READ_LOSS = ("before_backward", "after_backward")  # where the train step's guard waits for the loss
COMPILING_RECIPES = ("compile", "cuda_graphs")  # first call captures/compiles: reported as compile_s


class UnsupportedStack(RuntimeError):
    """The recipe stack refuses this device (``RecipeStack.supported`` said no)."""


class NonFiniteOutput(RuntimeError):
    """The step produced NaN/Inf (loss or sample): a ``nan`` row, not a timing."""


def make_inputs(model_cfg: Mapping, batch_size: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random x₀ in [-1, 1] and a {-1, 1} mask: the shapes, dtypes and range of real batches."""
    d, h, w = model_cfg["image_size"]
    c_img = model_cfg["out_channels"]
    c_cond = model_cfg["in_channels"] - c_img
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x0 = torch.rand((batch_size, c_img, d, h, w), generator=gen) * 2 - 1
    cond = (torch.rand((batch_size, c_cond, d, h, w), generator=gen) > 0.5).float() * 2 - 1
    return x0.to(device), cond.to(device)


def _train_step(model: nn.Module, schedule: NoiseSchedule, stack: RecipeStack, x0: torch.Tensor,
                cond: torch.Tensor, cfg: Mapping, read_loss: str = "before_backward",
                guard: Callable[..., bool] | None = None) -> Step:
    """Forward + loss under forward_context, then guard, backward and Adam (as ``med_ddpm.train``).

    The scaler is a disabled pass-through unless the stack has fp16 autocast (one code path).
    ``read_loss`` is where the guard is asked: ``before_backward`` as the loop does, or
    ``after_backward`` (the loop until round 12). ``guard`` replaces the stack's guard
    (:mod:`bench.guard_order` times these variants on one model).
    """
    if read_loss not in READ_LOSS:
        raise ValueError(f"read_loss must be one of {READ_LOSS}, got {read_loss!r}")
    late = read_loss == "after_backward"
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=ADAM_LR, **stack.optimizer_options())
    scaler = stack.grad_scaler(x0.device.type)
    gen = torch.Generator(device=x0.device).manual_seed(int(cfg["seed"]))
    loss_type = cfg["diffusion"].get("loss_type", "l1")
    check = guard or stack.finite_or_skip

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with stack.forward_context():
            loss = diffusion_loss(model, schedule, x0, cond, loss_type=loss_type, generator=gen)
        if late:
            scaler.scale(loss).backward()
        if check(loss, optimizer):  # the loop's guard: a NaN step must not touch the weights
            if not late:
                scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        return loss.detach()

    return step


def _denoise_step(model: nn.Module, schedule: NoiseSchedule, stack: RecipeStack, x0: torch.Tensor,
                  cond: torch.Tensor, cfg: Mapping) -> Step:
    """One ε-network forward on cat[x_t, cond] at a mid-chain timestep, under no_grad."""
    model.eval()
    t = torch.full((x0.shape[0],), schedule.num_train_timesteps // 2, device=x0.device, dtype=torch.long)
    x_in = stack.prepare_input(torch.cat([x0, cond], dim=1))

    def step() -> torch.Tensor:
        with torch.no_grad(), stack.forward_context():
            return model(x_in, t)

    return step


def _full_sample(model: nn.Module, schedule: NoiseSchedule, stack: RecipeStack, x0: torch.Tensor,
                 cond: torch.Tensor, cfg: Mapping) -> Step:
    """The full reverse chain with the configured sampler and steps (``med_ddpm.sample``'s loop)."""
    model.eval()
    sampler = sampler_from_config(cfg["sampler"], schedule)
    gen = torch.Generator(device=x0.device).manual_seed(int(cfg["seed"]))

    def step() -> torch.Tensor:
        return sample(model, sampler, cond, generator=gen, progress=False,
                      forward_context=stack.forward_context, out_channels=x0.shape[1])

    return step


SCENARIOS: dict[str, Callable[..., Step]] = {
    "train_step": _train_step,
    "denoise_step": _denoise_step,
    "full_sample": _full_sample,
}


def model_calls(cfg: Mapping) -> int:
    """Network evaluations per scenario call (the sampler's steps for a full sample)."""
    if cfg["bench"]["scenario"] != "full_sample":
        return 1
    return int(cfg["sampler"].get("steps") or cfg["diffusion"]["timesteps"])


def model_flops(cfg: Mapping) -> int:
    """Model FLOPs of one scenario call, counted on the meta device (no memory, no compute).

    These are the reference network's FLOPs (MFU-style): recomputation by activation
    checkpointing or a kernel's own choice of algorithm does not change them, so achieved
    TFLOP/s compare across recipes. Training counts forward + backward; Adam is not counted.
    """
    scenario, batch = cfg["bench"]["scenario"], int(cfg["bench"]["batch_size"])
    with torch.device("meta"):
        model = build_model(cfg["model"])
        x = torch.empty(batch, model.in_channels, *cfg["model"]["image_size"])
        t = torch.zeros(batch, dtype=torch.long)

    def call() -> None:
        if scenario == "train_step":
            model(x, t).sum().backward()
        else:
            with torch.no_grad():
                model(x, t)

    return count_flops(call) * model_calls(cfg)


def _check_finite(out: torch.Tensor, when: str) -> None:
    if not bool(torch.isfinite(out).all()):
        raise NonFiniteOutput(f"non-finite {'loss' if out.dim() == 0 else 'output'} {when}")


@contextlib.contextmanager
def prepared_parts(cfg: Mapping, device: torch.device) -> Iterator[Parts]:
    """Inside the stack's session: the prepared model, schedule, stack and inputs of ``cfg``.

    Raises:
        UnsupportedStack: a recipe cannot run on ``device``.
    """
    bench = cfg["bench"]
    stack = RecipeStack.from_config(cfg.get("recipe") or {})
    ok, reason = stack.supported(device)
    if not ok:
        raise UnsupportedStack(reason)
    seed_everything(int(cfg["seed"]))
    flush(device)
    with stack.session():
        # random (not zero-initialised) residual branches: real data through every kernel, real NaN checks
        net = randomize_zero_init(build_model(cfg["model"]), int(cfg["seed"]))
        model = stack.prepare_model(net.to(device))
        schedule = NoiseSchedule.from_config(cfg["diffusion"]).to(device)
        x0, cond = make_inputs(cfg["model"], int(bench["batch_size"]), device, int(cfg["seed"]))
        yield model, schedule, stack, stack.prepare_input(x0), stack.prepare_input(cond)


@contextlib.contextmanager
def prepared_step(cfg: Mapping, device: torch.device) -> Iterator[tuple[Step, RecipeStack]]:
    """Inside the stack's session: the step of ``cfg``'s scenario, ready to call, and its stack."""
    with prepared_parts(cfg, device) as (model, schedule, stack, x0, cond):
        yield SCENARIOS[cfg["bench"]["scenario"]](model, schedule, stack, x0, cond, cfg), stack


def run_scenario(cfg: Mapping, device: torch.device, wrap_step: Callable[[Step], Step] | None = None) -> dict[str, Any]:
    """Warm up and time one scenario under its recipe stack; return the row's measurements.

    The first call is timed on its own (``first_call_s``; when the stack compiles or captures
    graphs, ``compile_s`` = that less the median call), then ``bench.warmup`` untimed and
    ``bench.iters`` timed calls.

    Args:
        cfg: resolved bench config (``model``, ``diffusion``, ``sampler``, ``recipe``, ``bench``, ``seed``).
        device: where to run.
        wrap_step: test hook wrapped around the step (fault injection).

    Raises:
        UnsupportedStack: a recipe cannot run on ``device``.
        NonFiniteOutput: the first or last timed call produced NaN/Inf, or the guard skipped a step.
    """
    bench = cfg["bench"]
    with prepared_step(cfg, device) as (step, stack):
        if wrap_step is not None:
            step = wrap_step(step)
        last: dict[str, torch.Tensor] = {}
        first_call_s = time_once(lambda: last.update(out=step()), device)
        _check_finite(last["out"], "on the first call")
        timings = time_fn(lambda: last.update(out=step()), warmup=int(bench["warmup"]),
                          iters=int(bench["iters"]), device=device)
        _check_finite(last["out"], "after the timed calls")
        if stack.guard.skipped:  # a skipped step is not the step being timed
            raise NonFiniteOutput(f"{stack.guard.skipped} step(s) skipped by the non-finite-loss guard while timing")
        with stack.forward_context():
            precision = active_precision(device.type)
        describe = stack.describe()
    return _measurements(cfg, device, timings, first_call_s, precision, describe)


def _measurements(cfg: Mapping, device: torch.device, timings, first_call_s: float, precision: str,
                  describe: Any) -> dict[str, Any]:
    batch = int(cfg["bench"]["batch_size"])
    seconds = timings.median / 1e3
    flops = model_flops(cfg)
    tflops = achieved_tflops(flops, timings.median)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    compiles = bool(set(describe.get("order", [])) & set(COMPILING_RECIPES))
    return {
        "ms_median": timings.median, "ms_p10": timings.p10, "ms_p90": timings.p90,
        "iqr_pct": timings.iqr_pct, "ms_mean": timings.mean, "ms_std": timings.std,
        "iters": len(timings.samples), "warmup": int(cfg["bench"]["warmup"]),
        # compile time = the first call's wall time less one ordinary call
        "first_call_s": first_call_s, "compile_s": first_call_s - seconds if compiles else None,
        "peak_mem_gib": peak_memory_gib(device),
        "volumes_per_s": batch / seconds,
        "voxels_per_s": batch * math.prod(cfg["model"]["image_size"]) / seconds,
        "flops": flops, "tflops": tflops, "precision": precision,
        "peak_fraction": peak_fraction(tflops, gpu, precision),
        "describe": describe,
    }
