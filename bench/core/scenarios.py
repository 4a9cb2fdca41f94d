"""The three benchmark scenarios: the real training/sampling step, cut down to one timed call.

Each builder returns a zero-argument ``step()`` that runs what ``med_ddpm.train`` or
``med_ddpm.sample`` runs per iteration, with every recipe hook in the same place:

* ``train_step``   :func:`med_ddpm.train.train_step` itself, the loop's one optimizer step, with the
  config's ``train`` keys. One timed call = ``train.grad_accum`` micro-batches of (input layout,
  t/ε draws, forward + L1 ε-loss under ``forward_context``, the non-finite guard, backward), then
  Adam, then the EMA update on the steps its cadence (``train.ema_every``) picks (``bench.ema=false``:
  none). Not timed: data loading and the host-to-device copy (the batch is already on the device),
  logging, checkpoints.
* ``denoise_step`` one network forward under ``no_grad`` (the unit of sampling cost);
* ``full_sample``  the whole reverse chain through :func:`med_ddpm.samplers.sample`.

:func:`run_scenario` wraps a builder in the recipe stack's session, times it
(:mod:`bench.core.timing`), and returns the measurement fields of a results row. It raises
:class:`UnsupportedStack` / :class:`NonFiniteOutput` so the worker can turn them into rows.

Example:
    >>> fields = run_scenario(cfg, torch.device("cuda"))   # cfg: a resolved bench config
    >>> fields["ms_median"], fields["peak_mem_gib"]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.optim.swa_utils import AveragedModel

from bench.core.timing import (
    achieved_tflops,
    active_precision,
    count_flops,
    flush,
    peak_fraction,
    peak_memory_gib,
    time_fn,
    time_once,
)
from med_ddpm.compile_cache import CompileCache, sample_workload, train_workload
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.model import UNet3D, build_model
from med_ddpm.quality.probe import randomize_zero_init
from med_ddpm.samplers import model_input, sample, sampler_from_config
from med_ddpm.train import new_ema, train_step
from med_ddpm.train_state import TrainState
from med_ddpm.utils import seed_everything
from optim import RecipeConflictError, RecipeStack

Step = Callable[[], torch.Tensor]


class UnsupportedStack(RuntimeError):
    """The recipe stack refuses this device or this step (``RecipeStack.supported``/``require_training``)."""


class NonFiniteOutput(RuntimeError):
    """The step produced NaN/Inf (loss or sample): a ``nan`` row, not a timing."""


@dataclass
class Parts:
    """A scenario's prepared pieces: ``x0`` and ``cond`` on the device, in the data's NCDHW layout."""

    net: UNet3D
    model: nn.Module  # net after the stack's prepare_model
    ema: AveragedModel | None
    schedule: NoiseSchedule
    stack: RecipeStack
    x0: torch.Tensor
    cond: torch.Tensor
    cache: CompileCache | None = None  # the commands' compile cache this job shares (bench.compile_cache)

    def for_workload(self, cfg: Mapping, device: torch.device) -> Parts:
        """These parts with ``cfg``'s inputs (its batch), for another workload of one model and stack."""
        x0, cond = make_inputs(cfg["model"], batch_size(cfg), device, int(cfg["seed"]))
        return dataclasses.replace(self, x0=x0, cond=cond)


def make_inputs(model_cfg: Mapping, batch_size: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random x₀ in [-1, 1] and a {-1, 1} mask: the shapes, dtypes and range of real batches."""
    d, h, w = model_cfg["image_size"]
    c_img = model_cfg["out_channels"]
    c_cond = model_cfg["in_channels"] - c_img
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x0 = torch.rand((batch_size, c_img, d, h, w), generator=gen) * 2 - 1
    cond = (torch.rand((batch_size, c_cond, d, h, w), generator=gen) > 0.5).float() * 2 - 1
    return x0.to(device), cond.to(device)


def train_config(cfg: Mapping) -> Any:
    """The slice of a bench config that :func:`med_ddpm.train.train_step` reads (a training config's keys)."""
    return OmegaConf.create({key: cfg[key] for key in ("seed", "diffusion", "train")})


def _train_step(parts: Parts, cfg: Mapping) -> Step:
    """The training loop's step (:func:`med_ddpm.train.train_step`) on one batch held on the device."""
    train = train_config(cfg)
    try:
        parts.stack.require_training(int(train.train.grad_accum))
    except RecipeConflictError as err:
        raise UnsupportedStack(str(err)) from err
    parts.model.train()
    device = parts.x0.device
    state = TrainState(
        cfg=train, device=device, net=parts.net, model=parts.model, ema=parts.ema, schedule=parts.schedule,
        stack=parts.stack, scaler=parts.stack.grad_scaler(device.type),
        optimizer=torch.optim.Adam(parts.net.parameters(), lr=train.train.lr, **parts.stack.optimizer_options()),
    )
    return functools.partial(train_step, state, itertools.repeat({"image": parts.x0, "cond": parts.cond}))


def _denoise_step(parts: Parts, cfg: Mapping) -> Step:
    """One ε-network forward on cat[x_t, cond] at a mid-chain timestep, under no_grad: the input built as
    :func:`~med_ddpm.samplers.sample` builds it, so a compiled stack runs (and loads) the sampler's graph."""
    parts.model.eval()
    t = torch.full((parts.x0.shape[0],), parts.schedule.num_train_timesteps // 2, device=parts.x0.device,
                   dtype=torch.long)
    x_in = model_input(parts.x0, parts.stack.prepare_input(parts.cond))

    def step() -> torch.Tensor:
        with torch.no_grad(), parts.stack.forward_context():
            return parts.model(x_in, t)

    return step


def _full_sample(parts: Parts, cfg: Mapping) -> Step:
    """The full reverse chain with the configured sampler and steps (``med_ddpm.sample``'s loop)."""
    parts.model.eval()
    sampler = sampler_from_config(cfg["sampler"], parts.schedule)
    gen = torch.Generator(device=parts.x0.device).manual_seed(int(cfg["seed"]))
    cond = parts.stack.prepare_input(parts.cond)

    def step() -> torch.Tensor:
        return sample(parts.model, sampler, cond, generator=gen, progress=False,
                      forward_context=parts.stack.forward_context, out_channels=parts.x0.shape[1])

    return step


SCENARIOS: dict[str, Callable[[Parts, Mapping], Step]] = {
    "train_step": _train_step,
    "denoise_step": _denoise_step,
    "full_sample": _full_sample,
}


def model_calls(cfg: Mapping) -> int:
    """Network evaluations per scenario call: one per micro-batch of a train step, the sampler's model calls
    for a full sample."""
    scenario = cfg["bench"]["scenario"]
    if scenario == "train_step":
        return int(cfg["train"]["grad_accum"])
    if scenario == "full_sample":
        return sampler_calls(cfg)
    return 1


def sampler_calls(cfg: Mapping[str, Any]) -> int:
    """Model calls of one sample under ``cfg``'s sampler: one per timestep of the sampler it builds."""
    return len(sampler_from_config(cfg["sampler"], NoiseSchedule.from_config(cfg["diffusion"])).timesteps)


def batch_size(cfg: Mapping) -> int:
    """Volumes per forward. A train step's micro-batch is the loop's ``train.batch_size``, which follows
    ``bench.batch_size`` unless an experiment sets it (``experiment=fast_train`` trains at 2): the step timed is
    the step the experiment trains with."""
    return int(cfg["train"]["batch_size"] if cfg["bench"]["scenario"] == "train_step" else cfg["bench"]["batch_size"])


def volumes_per_call(cfg: Mapping) -> int:
    """Volumes one scenario call processes: a train step's micro-batches together, else one batch."""
    batch = batch_size(cfg)
    return batch * model_calls(cfg) if cfg["bench"]["scenario"] == "train_step" else batch


def model_flops(cfg: Mapping) -> int:
    """Model FLOPs of one scenario call, counted on the meta device (no memory, no compute).

    These are the reference network's FLOPs (MFU-style): recomputation by activation
    checkpointing or a kernel's own choice of algorithm does not change them, so achieved
    TFLOP/s compare across recipes. Training counts forward + backward; Adam is not counted.
    """
    scenario, batch = cfg["bench"]["scenario"], batch_size(cfg)
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


def _with_ema(cfg: Mapping) -> bool:
    return cfg["bench"]["scenario"] == "train_step" and bool(cfg["bench"]["ema"])


def compile_cache(cfg: Mapping, stack: RecipeStack, net: UNet3D, device: torch.device) -> CompileCache | None:
    """The commands' compile cache in ``bench.compile_cache``, under the key ``med_ddpm.sample`` or
    ``med_ddpm.train`` gives the same stack and workload, so a bench job and a command share one compilation; None
    when unset or when the stack compiles nothing."""
    if cfg["bench"]["scenario"] == "train_step":
        train = cfg["train"]
        name, workload = "train", train_workload(cfg["model"], train["batch_size"], train["grad_accum"], 1)
    else:
        name, workload = "sample", sample_workload(net.config, batch_size(cfg), list(cfg["model"]["image_size"]))
    return CompileCache.for_run(cfg["bench"].get("compile_cache"), name, stack, device, workload)


@contextlib.contextmanager
def prepared_parts(cfg: Mapping, device: torch.device, ema: bool | None = None) -> Iterator[Parts]:
    """Inside the stack's session: the prepared model, its EMA (train step, or ``ema``), schedule, stack, inputs
    and the compile cache it loaded.

    Raises:
        UnsupportedStack: a recipe cannot run on ``device``.
    """
    stack = RecipeStack.from_config(cfg.get("recipe") or {})
    ok, reason = stack.supported(device)
    if not ok:
        raise UnsupportedStack(reason)
    seed_everything(int(cfg["seed"]))
    flush(device)
    with stack.session():
        # random (not zero-initialised) residual branches: real data through every kernel, real NaN checks
        net = randomize_zero_init(build_model(cfg["model"]), int(cfg["seed"])).to(device)
        with_ema = _with_ema(cfg) if ema is None else ema
        ema_model = new_ema(net, float(cfg["train"]["ema_decay"])) if with_ema else None  # before prepare, as build()
        schedule = NoiseSchedule.from_config(cfg["diffusion"]).to(device)
        x0, cond = make_inputs(cfg["model"], batch_size(cfg), device, int(cfg["seed"]))
        cache = compile_cache(cfg, stack, net, device)
        if cache is not None:
            cache.load()
        yield Parts(net, stack.prepare_model(net), ema_model, schedule, stack, x0, cond, cache)


@contextlib.contextmanager
def prepared_step(cfg: Mapping, device: torch.device) -> Iterator[tuple[Step, RecipeStack]]:
    """Inside the stack's session: the step of ``cfg``'s scenario, ready to call, and its stack."""
    with prepared_parts(cfg, device) as parts:
        yield SCENARIOS[cfg["bench"]["scenario"]](parts, cfg), parts.stack


def run_scenario(cfg: Mapping, device: torch.device, wrap_step: Callable[[Step], Step] | None = None) -> dict[str, Any]:
    """Warm up and time one scenario under its recipe stack; return the row's measurements
    (:func:`time_workload` on freshly :func:`prepared_parts`).

    Raises:
        UnsupportedStack: a recipe cannot run on ``device``.
        NonFiniteOutput: the first or last timed call produced NaN/Inf, or the guard skipped a step.
    """
    with prepared_parts(cfg, device) as parts:
        return time_workload(parts, cfg, device, wrap_step)


def time_workload(parts: Parts, cfg: Mapping, device: torch.device,
                  wrap_step: Callable[[Step], Step] | None = None) -> dict[str, Any]:
    """Warm up and time ``cfg``'s scenario on prepared ``parts`` (inside their session); the row's measurements.

    The first call is timed on its own (``first_call_s``; when the stack compiles or captures graphs,
    ``compile_s`` = that less the median call) unless ``bench.time_first_call`` is false (a process that is warm
    already: a minute-long sample is then timed once), then ``bench.warmup`` untimed and ``bench.iters`` timed
    calls. The compile cache is saved after them (nothing is written when it was warm).

    Args:
        parts: from :func:`prepared_parts` (:meth:`Parts.for_workload` for another workload of one process).
        cfg: resolved bench config (``model``, ``diffusion``, ``sampler``, ``recipe``, ``bench``, ``seed``).
        device: where to run.
        wrap_step: test hook wrapped around the step (fault injection).
    """
    bench, stack = cfg["bench"], parts.stack
    step = SCENARIOS[bench["scenario"]](parts, cfg)
    if wrap_step is not None:
        step = wrap_step(step)
    last: dict[str, torch.Tensor] = {}
    first_call_s = None
    if bench.get("time_first_call", True):
        first_call_s = time_once(lambda: last.update(out=step()), device)
        _check_finite(last["out"], "on the first call")
    timings = time_fn(lambda: last.update(out=step()), warmup=int(bench["warmup"]), iters=int(bench["iters"]),
                      device=device)
    _check_finite(last["out"], "after the timed calls")
    if parts.cache is not None:
        parts.cache.save()
    if stack.guard.skipped:  # a skipped step is not the step being timed
        raise NonFiniteOutput(f"{stack.guard.skipped} step(s) skipped by the non-finite-loss guard while timing")
    with stack.forward_context():
        precision = active_precision(device.type)
    fields = _measurements(cfg, device, timings, first_call_s, precision, stack.describe(), stack.slow_first_call)
    # recipes that changed nothing here: bench.report gives them no speed-up
    return {**fields, "inert_recipes": stack.inert(device)}


def _measurements(cfg: Mapping, device: torch.device, timings, first_call_s: float | None, precision: str,
                  describe: Any, compiles: bool) -> dict[str, Any]:
    volumes = volumes_per_call(cfg)
    seconds = timings.median / 1e3
    flops = model_flops(cfg)
    tflops = achieved_tflops(flops, timings.median)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "ms_median": timings.median, "ms_p10": timings.p10, "ms_p90": timings.p90,
        "iqr_pct": timings.iqr_pct, "ms_mean": timings.mean, "ms_std": timings.std,
        "iters": len(timings.samples), "warmup": int(cfg["bench"]["warmup"]),
        # compile time = the first call's wall time less one ordinary call
        "first_call_s": first_call_s,
        "compile_s": first_call_s - seconds if compiles and first_call_s is not None else None,
        "peak_mem_gib": peak_memory_gib(device),
        "volumes_per_s": volumes / seconds,
        "voxels_per_s": volumes * math.prod(cfg["model"]["image_size"]) / seconds,
        "flops": flops, "tflops": tflops, "precision": precision,
        "peak_fraction": peak_fraction(tflops, gpu, precision),
        "describe": describe,
    }
