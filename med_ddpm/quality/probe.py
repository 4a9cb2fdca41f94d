"""The speed-vs-quality gate's runs: fixed noise, the reference and candidate trajectories, and the
config entry point that bench calls for every gated job.

Example (what bench does for one candidate)::

    row["quality"] = gate_from_config(cfg, device, checkpoint=path_or_None).to_dict()

or by hand::

    noise = fixed_noise(x_shape, steps=len(ddpm.timesteps), seed=0)
    with RecipeStack([]).session():                    # strict FP32 reference
        ref = run_trajectory(fp32_model, ddpm, cond, noise)
    with stack.session():
        cand = run_trajectory(fast_model, sampler, cond, noise, probe_inputs=ref.probe_inputs,
                              forward_context=stack.forward_context)
    report = QualityGate(load_thresholds(), device=device).run(ref, cand)   # -> verdict pass|warn|fail

The N samples are ``quality.n_masks`` synthetic phantom masks x N / n_masks noise draws each, one
batch. Both runs share the masks, and the weights unless ``quality.candidate_checkpoint`` gives the
candidate its own (two trained models, both strict FP32); with the same ``seed`` they share x_T and
every per-step noise field too (paired). Noise is drawn in float32 on the CPU from seeds and only then
moved to the device, so neither memory layout nor autocast dtype can change it. What the gate
judges, and how, is in :mod:`med_ddpm.quality.gate`. This module takes callables only; it knows nothing
about bench or recipe internals.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from med_ddpm.cli import CONFIG_DIR
from med_ddpm.config_checks import ConfigError
from med_ddpm.quality.gate import QualityGate, QualityReport, TrajectoryRun
from med_ddpm.samplers import DDPMSampler, Sampler, sample, sampler_from_config
from med_ddpm.utils import atomic_save, json_safe

DEFAULT_CONFIG = CONFIG_DIR / "quality" / "default.yaml"

ModelFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ContextFactory = Callable[[], contextlib.AbstractContextManager]


# ----------------------------------------------------------------------------- fixed noise
class StepNoise(Sequence):
    """``step_noise[k]``: the N(0, I) field for reverse step k, drawn on demand in float32 on the CPU.

    Each step has its own generator seeded from ``SeedSequence([seed, k])``, so nothing is
    held in memory (250 steps of a 128³ batch would be gigabytes) and step k's noise does
    not depend on which other steps were drawn.
    """

    def __init__(self, shape: Sequence[int], steps: int, seed: int, device: torch.device | str = "cpu"):
        self.shape, self.steps, self.seed, self.device = tuple(shape), steps, seed, torch.device(device)

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, k: int) -> torch.Tensor:
        if not 0 <= k < self.steps:
            raise IndexError(f"step {k} out of range for {self.steps} steps")
        g = torch.Generator().manual_seed(int(np.random.SeedSequence([self.seed, k + 1]).generate_state(1)[0]))
        return torch.randn(self.shape, generator=g, dtype=torch.float32).to(self.device)


@dataclass
class FixedNoise:
    """Initial noise x_T and the per-step noise of one reverse trajectory."""

    x_T: torch.Tensor
    step_noise: StepNoise

    def to(self, device: torch.device | str) -> FixedNoise:
        sn = self.step_noise
        return FixedNoise(self.x_T.to(device), StepNoise(sn.shape, sn.steps, sn.seed, device))


def fixed_noise(shape: Sequence[int], steps: int, seed: int, device: torch.device | str = "cpu") -> FixedNoise:
    """x_T and ``steps`` step-noise fields for a (B, C, D, H, W) sample, float32, CPU-drawn, then moved."""
    g = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, 0]).generate_state(1)[0]))
    x_T = torch.randn(tuple(shape), generator=g, dtype=torch.float32)
    return FixedNoise(x_T, StepNoise(shape, steps, seed)).to(device)


# ----------------------------------------------------------------------------- trajectories
def default_probe_timesteps(num_train_timesteps: int) -> list[int]:
    """0, T/4, T/2, 3T/4 and T−1: low, middle and pure-noise regimes of the denoiser."""
    T = num_train_timesteps
    return sorted({0, T // 4, T // 2, (3 * T) // 4, T - 1})


def describe_sampler(sampler: Sampler) -> dict[str, Any]:
    """Identity of a sampler for the report; two runs are *paired* only if these match. ``calls``: model calls
    per sample (``steps`` plus any restart segments)."""
    return {"name": type(sampler).__name__, "steps": int(sampler.num_inference_steps), "calls": len(sampler.timesteps)}


def run_trajectory(
    model_fn: ModelFn,
    sampler: Sampler,
    cond: torch.Tensor,
    noise: FixedNoise,
    *,
    probe_timesteps: Sequence[int] | None = None,
    probe_inputs: Mapping[int, torch.Tensor] | None = None,
    forward_context: ContextFactory | None = None,
) -> TrajectoryRun:
    """Sample with fixed noise through :func:`med_ddpm.samplers.sample`, then probe ε.

    Without ``probe_inputs`` (the reference run) the network inputs at ``probe_timesteps``
    (default :func:`default_probe_timesteps`) are recorded from this very trajectory, so the
    probe sees realistic x_t, not pure noise. A candidate passes the reference's
    ``probe_inputs`` so both networks are probed on identical tensors.
    """
    record = probe_inputs is None
    wanted = set(probe_timesteps or default_probe_timesteps(sampler.schedule.num_train_timesteps))
    recorded: dict[int, torch.Tensor] = {}

    def recording_fn(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t0 = int(t[0])
        if record and t0 in wanted and t0 not in recorded:
            recorded[t0] = x.detach().float().cpu().clone()
        return model_fn(x, t)

    samples = sample(recording_fn, sampler, cond, x_T=noise.x_T, step_noise=noise.step_noise,
                     progress=False, forward_context=forward_context)
    if record:
        missing = sorted(wanted - set(recorded))
        if missing:
            raise ValueError(f"probe timesteps {missing} are not visited by {describe_sampler(sampler)}; "
                             "record probes on the DDPM reference run and pass them as probe_inputs")
        probe_inputs = recorded
    eps = _probe_eps(model_fn, probe_inputs, cond.device, forward_context)
    return TrajectoryRun(samples.detach().float().cpu(), cond.detach().float().cpu(), eps,
                         {t: x.cpu() for t, x in probe_inputs.items()}, describe_sampler(sampler),
                         noise.step_noise.seed)


def probe_run(model_fn: ModelFn, reference: TrajectoryRun, device: torch.device | str, *,
              forward_context: ContextFactory | None = None) -> TrajectoryRun:
    """ε of ``model_fn`` at the reference's probe inputs only, no trajectory (``samples`` is None).

    Enough to judge the bias and noise of a denoiser change (the drift checks), at the cost of a
    few forward passes instead of a whole reverse chain.
    """
    eps = _probe_eps(model_fn, reference.probe_inputs, torch.device(device), forward_context)
    return TrajectoryRun(None, reference.cond, eps, reference.probe_inputs, {"name": "probes only"},
                         reference.noise_seed)


@torch.no_grad()
def _probe_eps(model_fn, inputs, device, forward_context) -> dict[int, torch.Tensor]:
    ctx = forward_context or contextlib.nullcontext
    eps = {}
    for t, x in sorted(inputs.items()):
        tb = torch.full((x.shape[0],), t, dtype=torch.long, device=device)
        with ctx():
            eps[t] = model_fn(x.to(device), tb).detach().float().cpu()
    return eps


def load_thresholds(path: str | Path = DEFAULT_CONFIG) -> dict[str, Any]:
    """The gate thresholds from a YAML file (default: ``configs/quality/default.yaml``)."""
    from omegaconf import OmegaConf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"quality thresholds not found: {path}")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


# ----------------------------------------------------------------------------- config entry point
def gate_from_config(cfg: Mapping[str, Any], device: torch.device | str, *, checkpoint: str | None = None,
                     n_samples: int | None = None) -> QualityReport:
    """The gate for a config's recipe stack and sampler vs strict-FP32 DDPM on the same weights.

    Reads only the shared keys: ``model``, ``diffusion``, ``sampler``, ``recipe``, ``quality`` (absent:
    ``configs/quality/default.yaml``), ``seed``; ``quality.cond_layout`` is the network's data variant. Weights
    come from ``checkpoint`` (this project's or an original Med-DDPM file) or, when None, a ``seed``-fixed random
    init of ``model``. N is the larger of ``n_samples`` and
    ``quality.n_samples``: ``quality.n_masks`` phantom masks, N / n_masks noise draws each. The
    reference uses noise ``seed``; the candidate ``quality.candidate_seed`` (null: the same, so the
    runs are paired). ``quality.trajectory=false`` probes the candidate's ε only (drift checks).
    ``quality.candidate_checkpoint``: the candidate arm is that checkpoint's weights, run exactly as
    the reference (strict FP32, DDPM, same masks and probes), so the gate compares two trained models.
    The report names both checkpoints.
    """
    from med_ddpm.data.encoding import VARIANT_BY_IMAGE_CHANNELS
    from optim import RecipeStack

    cfg = _as_dict(cfg)
    device, seed = torch.device(device), int(cfg.get("seed", 0))
    model, schedule = gate_model(cfg, checkpoint, seed)
    model, schedule = model.to(device).eval(), schedule.to(device)
    variant = VARIANT_BY_IMAGE_CHANNELS[model.out_channels]
    q = {**load_thresholds(), **(cfg.get("quality") or {}), "cond_layout": variant}  # the masks are this variant's
    n = max(int(n_samples or 0), int(q["n_samples"]))
    cond = phantom_masks(n, int(q["n_masks"]), tuple(cfg["model"]["image_size"]), variant, seed).to(device)
    T = schedule.num_train_timesteps
    gate = QualityGate(q, device=device)
    gate.check_bias_power(n, len(default_probe_timesteps(T)))  # before any trajectory is run
    ddpm = DDPMSampler(schedule)
    ddpm.set_timesteps(T)
    shape = (n, model.out_channels, *cond.shape[2:])
    other = q.get("candidate_checkpoint")
    other_net = candidate_weights(cfg, other, model, schedule) if other else None  # refused before any run

    def strict_reference() -> TrajectoryRun:
        with RecipeStack([]).session():
            return run_trajectory(model, ddpm, cond, fixed_noise(shape, T, seed, device))

    key = {"cfg": {k: cfg.get(k) for k in ("model", "diffusion", "seed")}, "n": n, "n_masks": q["n_masks"],
           "device": device.type, "checkpoint": _file_identity(checkpoint), "code": reference_code_digest()}
    reference = cached(q.get("cache_dir"), key, strict_reference)
    cand_seed = seed if q.get("candidate_seed") is None else int(q["candidate_seed"])
    node = cfg.get("sampler") or {"name": "ddpm"}
    sampler = ddpm if other_net is not None else sampler_from_config(node, schedule)  # other_net: DDPM, as checked
    calls = max(T, len(sampler.timesteps))  # restart sampling can call the model more than T times
    noise = fixed_noise(shape, calls, cand_seed, device) if q.get("trajectory", True) else None
    if other_net is not None:
        with RecipeStack([]).session():
            candidate = (probe_run(other_net, reference, device) if noise is None else
                         run_trajectory(other_net, sampler, cond, noise, probe_inputs=reference.probe_inputs))
    else:
        candidate = stack_candidate(cfg, model, sampler, reference, cond, noise)
    report = gate.run(reference, candidate)
    report.context["checkpoints"] = {"reference": checkpoint, "candidate": other or checkpoint}
    return report


def stack_candidate(cfg: Mapping[str, Any], model: torch.nn.Module, sampler: Sampler, reference: TrajectoryRun,
                    cond: torch.Tensor, noise: FixedNoise | None) -> TrajectoryRun:
    """The candidate arm of a recipe gate: the reference's weights under ``cfg``'s stack, sampled with
    ``sampler`` (built from ``cfg``'s sampler node; ``noise`` None: probe-only)."""
    from optim import RecipeStack

    stack = RecipeStack.from_config(cfg.get("recipe"))
    with stack.session():
        fast = stack.prepare_model(copy.deepcopy(model))
        model_fn = lambda x, t: fast(stack.prepare_input(x), t)  # noqa: E731
        if noise is None:
            return probe_run(model_fn, reference, cond.device, forward_context=stack.forward_context)
        return run_trajectory(model_fn, sampler, cond, noise, probe_inputs=reference.probe_inputs,
                              forward_context=stack.forward_context)


def candidate_weights(cfg: Mapping[str, Any], path: str, model: torch.nn.Module, schedule) -> torch.nn.Module:
    """The network of ``quality.candidate_checkpoint``, on the reference's device, checked comparable.

    Refuses a recipe stack or another sampler (the candidate arm runs as the reference does, so they would
    be silently ignored) and weights of another architecture or noise schedule.
    """
    from optim import RecipeStack

    names = RecipeStack.from_config(cfg.get("recipe")).names
    sampler = (cfg.get("sampler") or {}).get("name", "ddpm")
    if names or sampler != "ddpm":
        raise ConfigError(f"quality.candidate_checkpoint={path}: compares weights under strict FP32 DDPM; pass "
                          f"recipe=[] sampler=ddpm (got recipe={list(names)}, sampler={sampler})")
    net, other = gate_model(cfg, path, 0)
    check_same_network(path, (net, other), (model, schedule))
    return net.to(schedule.betas.device).eval()


def check_same_network(path: str, candidate: tuple[torch.nn.Module, Any], reference: tuple[torch.nn.Module, Any]) -> None:
    """Two checkpoints are comparable only with the same parameter shapes and the same noise schedule."""
    shapes = [{k: tuple(v.shape) for k, v in net.state_dict().items()} for net, _ in (candidate, reference)]
    betas = [schedule.betas.detach().cpu().double() for _, schedule in (candidate, reference)]
    if shapes[0] != shapes[1] or betas[0].shape != betas[1].shape or not torch.allclose(*betas):
        raise ConfigError(f"quality.candidate_checkpoint={path}: another network or noise schedule than the "
                          "reference's (bench.checkpoint); compare two checkpoints of one model config")


def phantom_masks(n: int, n_masks: int, image_size: Sequence[int], variant: str, seed: int) -> torch.Tensor:
    """(n, C, D, H, W) conditioning: ``n_masks`` synthetic phantom masks, each repeated n / n_masks times."""
    from med_ddpm.data.phantoms import SyntheticPhantoms

    if n_masks < 1 or n % n_masks:
        raise ValueError(f"quality.n_samples={n} must be a multiple of quality.n_masks={n_masks}")
    phantoms = SyntheticPhantoms(n_masks, tuple(image_size), variant=variant, seed=seed)
    masks = torch.stack([phantoms[i]["cond"] for i in range(n_masks)])
    return masks.repeat_interleave(n // n_masks, dim=0).contiguous()

def _file_identity(path: str | None) -> list[Any] | None:
    """A checkpoint's path, size and mtime: a retrained file at the same path is a new key."""
    if path is None:
        return None
    stat = Path(path).stat()
    return [str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns]


REFERENCE_CODE = ("model.py", "diffusion.py", "samplers/base.py", "samplers/ddpm.py", "quality/probe.py",
                  "data/phantoms.py", "data/encoding.py")  # what the reference runs, relative to med_ddpm/


def reference_code_digest() -> str:
    """torch's version and a hash of the code that computes the reference: an edit to either is a new reference,
    never a stale one read from the cache."""
    here = Path(__file__).parents[1]
    text = torch.__version__ + "".join((here / name).read_text() for name in REFERENCE_CODE)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def reference_file(cache_dir: str | Path, key: Mapping[str, Any]) -> Path:
    """Where the reference run of ``key`` is stored under ``cache_dir``: named by a hash of the key."""
    digest = hashlib.sha256(json.dumps(json_safe(key), sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"reference_{digest}.pt"


def cached(cache_dir: str | None, key: Mapping[str, Any], compute: Callable[[], Any]) -> Any:
    """``compute()``, stored under ``cache_dir`` by a hash of ``key`` and reused while it matches.

    The strict-FP32 reference (and its calibrated floors) depends only on the weights, schedule,
    masks, noise and N, not on the candidate, so a ladder of gates over one model computes it
    once instead of once per job (each bench job is a fresh process). Written atomically, so
    concurrent jobs at worst both compute it.
    """
    if not cache_dir:
        return compute()
    path = reference_file(cache_dir, key)
    if path.exists():
        return torch.load(path, weights_only=False)
    value = compute()
    atomic_save(value, path)
    return value


CONFIG_KEYS = ("model", "diffusion", "sampler", "recipe", "quality", "seed")


def _as_dict(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Plain dicts of the keys the gate reads (only those are resolved: ``output_dir`` may need Hydra)."""
    from omegaconf import OmegaConf

    return {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
            for k in CONFIG_KEYS if k in cfg}


def gate_model(cfg: Mapping[str, Any], checkpoint: str | None, seed: int):
    """(model, schedule) from a checkpoint, or the config's architecture with a seeded init."""
    from med_ddpm.checkpoint import load_checkpoint
    from med_ddpm.diffusion import NoiseSchedule
    from med_ddpm.model import build_model

    if checkpoint is not None:
        loaded = load_checkpoint(checkpoint)
        return loaded.model, loaded.schedule
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(cfg["model"])
    randomize_zero_init(model, seed)
    schedule = NoiseSchedule.from_config(cfg.get("diffusion"))
    return model, schedule


def randomize_zero_init(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every all-zero conv / linear layer PyTorch's default random init, seeded, in place.

    A fresh Med-DDPM network zero-initialises its output conv and residual branches, so it
    predicts ε = 0 whatever the input and every recipe would "pass" trivially. Re-initialising
    those layers (as the shared reference checkpoint was made) makes every path count, so a
    random-weights gate still measures each kernel's numerics.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in model.modules():
            if isinstance(m, torch.nn.Conv3d | torch.nn.Conv1d | torch.nn.Linear) and not m.weight.any():
                m.reset_parameters()
    return model
