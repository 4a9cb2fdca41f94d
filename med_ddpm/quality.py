"""The speed-vs-quality gate: does a recipe stack, sampler or step count change the samples?

Example (what bench does for one candidate)::

    noise = fixed_noise(x_shape, steps=len(ddpm.timesteps), seed=0)
    with RecipeStack([]).session():                    # strict FP32 reference
        ref = run_trajectory(fp32_model, ddpm, cond, noise)
    with stack.session():
        cand = run_trajectory(fast_model, sampler, cond, noise, probe_inputs=ref.probe_inputs,
                              forward_context=stack.forward_context)
    report = QualityGate.from_config(cfg.quality).run(ref, cand)   # -> verdict pass|warn|fail
    row["quality"] = report.to_dict()

    # or, from a composed config (model, diffusion, sampler, recipe, quality, seed):
    row["quality"] = gate_from_config(cfg, device, checkpoint=path_or_None).to_dict()

Both runs share the weights, the masks, x_T and every per-step noise field. Noise is drawn in
float32 on the CPU from seeds and only then moved to the device, so neither memory layout nor
autocast dtype can change it. Three kinds of evidence (issue 7):

1. *denoiser drift*: ε of the candidate and the reference on the **same** inputs x_t, recorded
   from the reference trajectory at a few timesteps (0, T/4, T/2, 3T/4, T−1);
2. *paired* end-of-trajectory metrics (PSNR, SSIM, MS-SSIM, max error; whole volume and
   brain / tumour); gated only when both runs use the same sampler, since a different
   sampler follows a different path by design;
3. *distribution* metrics (FID / KID / MMD, diversity) of the N samples vs the reference
   samples (and, reported only, vs real or phantom data), when N >= 2.

Every gated number is in a lower-is-better "distance" form (1 − SSIM, RMSE/range = 10^(−PSNR/20))
and is judged against the FP32-vs-FP32 floor measured by :func:`calibrate_floor`:
pass if value <= max(k_pass·floor, abs_pass), warn if <= max(k_warn·floor, abs_warn), else fail.
This module takes callables only; it knows nothing about bench or recipe internals.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from med_ddpm.features import FeatureExtractor, RandomConv3dFeatures
from med_ddpm.metrics import (
    FID,
    KID,
    MAE,
    MMD,
    MSSSIM,
    PSNR,
    SSIM,
    Diversity,
    MaxAbsError,
    NonFiniteCount,
    VolumeMetric,
    region_mask,
)
from med_ddpm.samplers import DDPMSampler, Sampler, sample, sampler_from_config
from med_ddpm.utils import atomic_save

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quality" / "default.yaml"
VERDICTS = ("pass", "warn", "fail")
KINDS = ("drift", "paired", "distribution", "sanity")
REGIONS = ("brain", "tumour")

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
@dataclass
class TrajectoryRun:
    """What the gate compares: final samples, ε at probe inputs, and those inputs (all CPU float32)."""

    samples: torch.Tensor
    cond: torch.Tensor
    eps_probe: dict[int, torch.Tensor]
    probe_inputs: dict[int, torch.Tensor]
    sampler: dict[str, Any] = field(default_factory=dict)


def default_probe_timesteps(num_train_timesteps: int) -> list[int]:
    """0, T/4, T/2, 3T/4 and T−1: low, middle and pure-noise regimes of the denoiser."""
    T = num_train_timesteps
    return sorted({0, T // 4, T // 2, (3 * T) // 4, T - 1})


def describe_sampler(sampler: Sampler) -> dict[str, Any]:
    """Identity of a sampler for the report; two runs are *paired* only if these match."""
    return {"name": type(sampler).__name__, "steps": int(sampler.num_inference_steps)}


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
                         {t: x.cpu() for t, x in probe_inputs.items()}, describe_sampler(sampler))


@torch.no_grad()
def _probe_eps(model_fn, inputs, device, forward_context) -> dict[int, torch.Tensor]:
    ctx = forward_context or contextlib.nullcontext
    eps = {}
    for t, x in sorted(inputs.items()):
        tb = torch.full((x.shape[0],), t, dtype=torch.long, device=device)
        with ctx():
            eps[t] = model_fn(x.to(device), tb).detach().float().cpu()
    return eps


# ----------------------------------------------------------------------------- measuring
def _metric_value(metric: VolumeMetric, pred, target=None, **kw) -> float:
    metric.reset()
    metric.update(pred, target, **kw)
    return metric.compute()


def _distance_form(prefix: str, m: Mapping[str, float]) -> dict[str, float]:
    """Lower-is-better versions of the paired metrics, the numbers the checks judge."""
    out = {f"{prefix}nrmse": 10 ** (-m[f"{prefix}psnr"] / 20)} if f"{prefix}psnr" in m else {}
    for k in ("ssim", "ms_ssim"):
        if f"{prefix}{k}" in m:
            out[f"{prefix}d{k}"] = 1 - m[f"{prefix}{k}"]
    return out


class QualityGate:
    """Judges a candidate :class:`TrajectoryRun` against the strict-FP32 reference run.

    Args:
        thresholds: the ``quality`` config (see ``configs/quality/default.yaml``): ``checks``
            (name -> kind, k_pass, k_warn, abs_pass, abs_warn), ``floor`` (name -> measured
            FP32-vs-FP32 value or null), ``data_range``, ``cond_layout``.
        floor: measured floors that override ``thresholds["floor"]`` (from :func:`calibrate_floor`).
        extractor: features for FID/KID (default: the fixed-seed random 3-D CNN, relative only).
    """

    def __init__(self, thresholds: Mapping[str, Any] | None = None, floor: Mapping[str, float] | None = None,
                 extractor: FeatureExtractor | None = None):
        cfg = dict(thresholds) if thresholds is not None else load_thresholds()
        self.checks = {k: dict(v) for k, v in cfg["checks"].items()}
        for name, c in self.checks.items():
            if c.get("kind") not in KINDS:
                raise ValueError(f"quality check {name!r}: kind must be one of {KINDS}, got {c.get('kind')!r}")
        self.floor = {**(cfg.get("floor") or {}), **(floor or {})}
        self.cond_layout = cfg.get("cond_layout", "whole_head")
        rng, ks = cfg.get("data_range", 2.0), cfg.get("ssim_kernel", 7)
        self.paired = {"psnr": PSNR(rng), "mae": MAE(), "max_error": MaxAbsError(),
                       "ssim": SSIM(rng, kernel_size=ks), "ms_ssim": MSSSIM(rng, kernel_size=ks)}
        self.in_mask = {"psnr": PSNR(rng), "mae": MAE(), "max_error": MaxAbsError()}
        self.nonfinite = NonFiniteCount()
        ext = extractor or RandomConv3dFeatures()
        self.distribution = {"fid": FID(ext), "kid": KID(ext), "mmd": MMD()}
        self.diversity = Diversity(rng, kernel_size=ks)
        self.extractor = ext

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any] | None = None, **kwargs) -> QualityGate:
        """From an OmegaConf/dict ``quality`` node (None: the packaged default.yaml)."""
        if cfg is not None and not isinstance(cfg, dict):
            from omegaconf import OmegaConf

            cfg = OmegaConf.to_container(cfg, resolve=True)
        return cls(cfg, **kwargs)

    # -- numbers ------------------------------------------------------------------------
    def measure(self, reference: TrajectoryRun, candidate: TrajectoryRun,
                real: torch.Tensor | None = None) -> dict[str, float]:
        """Every number of the three evidence kinds, keyed as the checks name them."""
        if reference.samples.shape != candidate.samples.shape:
            raise ValueError(f"reference samples {tuple(reference.samples.shape)} and candidate "
                             f"{tuple(candidate.samples.shape)} differ in shape; use the same masks and noise")
        m = self._drift(reference, candidate)
        m.update(self._paired(reference, candidate))
        if len(candidate.samples) >= 2:
            m.update(self._distribution(reference, candidate, real))
        return m

    def _drift(self, ref: TrajectoryRun, cand: TrajectoryRun) -> dict[str, float]:
        if set(ref.eps_probe) != set(cand.eps_probe):
            raise ValueError(f"probe timesteps differ: reference {sorted(ref.eps_probe)}, "
                             f"candidate {sorted(cand.eps_probe)}; pass probe_inputs=reference.probe_inputs")
        m: dict[str, float] = {}
        for t, e_ref in ref.eps_probe.items():
            diff = cand.eps_probe[t].double() - e_ref.double()
            m[f"eps_rel_l2@t={t}"] = float(diff.norm() / e_ref.double().norm().clamp_min(1e-30))
            m[f"eps_max_abs@t={t}"] = float(diff.abs().max())
        for k in ("eps_rel_l2", "eps_max_abs"):
            m[k] = _nanmax([v for name, v in m.items() if name.startswith(f"{k}@")])
        return m

    def _paired(self, ref: TrajectoryRun, cand: TrajectoryRun) -> dict[str, float]:
        pred, target = cand.samples, ref.samples
        m = {f"x0_{k}": _metric_value(metric, pred, target) for k, metric in self.paired.items()}
        m["x0_nonfinite"] = _metric_value(self.nonfinite, pred)
        for region in REGIONS:
            try:
                mask = region_mask(ref.cond, region, self.cond_layout)
            except ValueError:  # cond has no such channel (e.g. an unconditional toy)
                continue
            if mask.any():
                m.update({f"x0_{region}_{k}": _metric_value(metric, pred, target, mask=mask)
                          for k, metric in self.in_mask.items()})
        m.update(_distance_form("x0_", m))
        for region in REGIONS:
            m.update(_distance_form(f"x0_{region}_", m))
        return m

    def _distribution(self, ref: TrajectoryRun, cand: TrajectoryRun, real: torch.Tensor | None) -> dict[str, float]:
        m = {f"{k}_vs_ref": _metric_value(metric, cand.samples, ref.samples) for k, metric in self.distribution.items()}
        m["diversity_ref"] = _metric_value(self.diversity, ref.samples, cond=ref.cond)
        m["diversity"] = _metric_value(self.diversity, cand.samples, cond=cand.cond)
        m["diversity_gap"] = abs(m["diversity"] - m["diversity_ref"])
        if real is not None and len(real) >= 2:  # reported, not gated: real data has its own floor
            for suffix, run in (("", cand), ("_ref", ref)):
                for k in ("fid", "kid"):
                    m[f"{k}_vs_real{suffix}"] = _metric_value(self.distribution[k], run.samples, real.float())
        return m

    # -- verdict ------------------------------------------------------------------------
    def run(self, reference: TrajectoryRun, candidate: TrajectoryRun,
            real: torch.Tensor | None = None) -> QualityReport:
        """Measure, judge every applicable check, and combine: the worst status wins."""
        metrics = self.measure(reference, candidate, real)
        paired = reference.sampler == candidate.sampler
        checks, reasons = {}, []
        for name, spec in self.checks.items():
            skip = self._skip_reason(name, spec, metrics, paired)
            if skip:
                reasons.append(f"{name}: not gated ({skip})")
                continue
            checks[name] = self._judge(name, spec, metrics[name])
            if checks[name]["status"] != "pass":
                c = checks[name]
                reasons.append(f"{name}={c['value']:.3g} > pass limit {c['pass_limit']:.3g} -> {c['status']}")
        verdict = max((c["status"] for c in checks.values()), key=VERDICTS.index, default="pass")
        if not paired and not any(self.checks[n]["kind"] == "distribution" for n in checks) and verdict == "pass":
            verdict = "warn"
            reasons.append("different sampler and no calibrated distribution check ran (need N >= 2 samples "
                           "and distribution floors): drift alone cannot show the samples are as good")
        context = {"reference_sampler": reference.sampler, "candidate_sampler": candidate.sampler,
                   "paired": paired, "n_samples": len(candidate.samples), "extractor": self.extractor.describe()}
        return QualityReport(verdict, metrics, reasons, checks, context)

    def _skip_reason(self, name: str, spec: Mapping, metrics: Mapping, paired: bool) -> str | None:
        if name not in metrics:
            return "not measured (empty region, or N < 2 for distribution metrics)"
        if spec["kind"] == "paired" and not paired:
            return "different sampler: paths differ by design, judged by distribution checks"
        if spec["kind"] == "distribution" and self.floor.get(name) is None:
            return "no calibrated seed-to-seed floor; run calibrate_floor with a second seed set"
        return None

    def _judge(self, name: str, spec: Mapping, value: float) -> dict[str, Any]:
        floor = max(float(self.floor.get(name) or 0.0), 0.0)
        pass_limit = max(spec.get("k_pass", 0) * floor, spec.get("abs_pass", 0.0))
        warn_limit = max(spec.get("k_warn", 0) * floor, spec.get("abs_warn", 0.0), pass_limit)
        if not math.isfinite(value):
            status = "fail"
        else:
            status = "pass" if value <= pass_limit else "warn" if value <= warn_limit else "fail"
        return {"value": value, "floor": floor, "pass_limit": pass_limit, "warn_limit": warn_limit,
                "kind": spec["kind"], "status": status}


def _nanmax(values: list[float]) -> float:
    """Max that propagates NaN (a NaN probe is a failure, not something to skip)."""
    return math.nan if any(math.isnan(v) for v in values) else max(values)


@dataclass
class QualityReport:
    """The gate's answer: ``verdict`` in pass|warn|fail, every number, and why."""

    verdict: str
    metrics: dict[str, float]
    reasons: list[str]
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    context: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Strict-JSON form for a bench row's ``quality`` field (inf/nan become strings)."""
        return _json_safe({"verdict": self.verdict, "reasons": self.reasons, "metrics": self.metrics,
                           "checks": self.checks, **self.context})


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)  # "inf", "-inf", "nan": float() reads them back
    return obj


def load_thresholds(path: str | Path = DEFAULT_CONFIG) -> dict[str, Any]:
    """The gate thresholds from a YAML file (default: ``configs/quality/default.yaml``)."""
    from omegaconf import OmegaConf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"quality thresholds not found: {path}")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


# ----------------------------------------------------------------------------- calibration
@contextlib.contextmanager
def equivalent_execution() -> Iterator[None]:
    """A different but mathematically equivalent FP32 execution, to expose round-off.

    Toggles ``torch.backends.cudnn.benchmark`` (cuDNN picks other conv algorithms) and
    halves the CPU thread count (other reduction orders). Restores both on exit.
    """
    benchmark, threads = torch.backends.cudnn.benchmark, torch.get_num_threads()
    torch.backends.cudnn.benchmark = not benchmark
    torch.set_num_threads(max(1, threads // 2))
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = benchmark
        torch.set_num_threads(threads)


def calibrate_floor(
    model_fn: ModelFn,
    sampler: Sampler,
    cond: torch.Tensor,
    noise: FixedNoise,
    second_noise: FixedNoise | None = None,
    *,
    gate: QualityGate | None = None,
    probe_timesteps: Sequence[int] | None = None,
    forward_context: ContextFactory | None = None,
    reference: TrajectoryRun | None = None,
) -> dict[str, float]:
    """Measure the FP32-vs-FP32 floor of every check, to feed :class:`QualityGate` (``floor=``).

    Drift and paired floors: the reference against itself under :func:`equivalent_execution`
    (same noise). Distribution floors: the reference against a second seed set
    (``second_noise``), i.e. how much FID/KID/MMD/diversity move from sampling alone. Call
    it inside the strict-FP32 session (``RecipeStack([]).session()``) with the FP32 model;
    pass ``reference`` when that run of ``noise`` is already at hand (saves one trajectory).
    """
    gate = gate or QualityGate()
    run = lambda nz, probes=None: run_trajectory(  # noqa: E731
        model_fn, sampler, cond, nz, probe_timesteps=probe_timesteps, probe_inputs=probes,
        forward_context=forward_context)
    reference = reference or run(noise)
    with equivalent_execution():
        rerun = run(noise, reference.probe_inputs)
    measured = gate.measure(reference, rerun)
    floors = {n: measured[n] for n, c in gate.checks.items() if c["kind"] != "distribution" and n in measured}
    if second_noise is not None:
        other = gate.measure(reference, run(second_noise, reference.probe_inputs))
        floors.update({n: other[n] for n, c in gate.checks.items() if c["kind"] == "distribution" and n in other})
    # |.|: KID and MMD are unbiased estimates that scatter around 0 for equal distributions,
    # so the size of that scatter, not its sign, is the floor.
    return {n: abs(float(v)) for n, v in floors.items()}


# ----------------------------------------------------------------------------- config entry point
def gate_from_config(cfg: Mapping[str, Any], device: torch.device | str, *, checkpoint: str | None = None,
                     n_samples: int = 2) -> QualityReport:
    """The gate for a config's recipe stack and sampler vs strict-FP32 DDPM on the same weights.

    Reads only the shared keys: ``model``, ``diffusion``, ``sampler``, ``recipe``, ``quality``,
    ``seed``. Weights come from ``checkpoint`` (this project's or an original Med-DDPM file) or,
    when None, a ``seed``-fixed random init of ``model``. The masks are ``n_samples`` copies of
    one synthetic phantom's (so diversity has pairs); ``n_samples`` phantom images serve as the
    "real" set. With ``quality.calibrate`` the floors are measured first (3 more trajectories).
    """
    from med_ddpm.data import VARIANT_BY_IMAGE_CHANNELS
    from med_ddpm.phantoms import SyntheticPhantoms
    from optim import RecipeStack

    cfg = _as_dict(cfg)
    device, seed = torch.device(device), int(cfg.get("seed", 0))
    model, schedule = _gate_model(cfg, checkpoint, seed)
    model, schedule = model.to(device).eval(), schedule.to(device)
    variant = VARIANT_BY_IMAGE_CHANNELS[model.out_channels]
    phantoms = SyntheticPhantoms(n_samples, tuple(cfg["model"]["image_size"]), variant=variant, seed=seed)
    cond = phantoms[0]["cond"][None].expand(n_samples, -1, -1, -1, -1).contiguous().to(device)
    real = torch.stack([phantoms[i]["image"] for i in range(n_samples)])
    T = schedule.num_train_timesteps
    ddpm = DDPMSampler(schedule)
    ddpm.set_timesteps(T)
    sampler = sampler_from_config(cfg.get("sampler") or {"name": "ddpm"}, schedule)
    noise = fixed_noise((n_samples, model.out_channels, *cond.shape[2:]), T, seed, device)
    thresholds = {**(cfg.get("quality") or load_thresholds()), "cond_layout": variant}

    def strict_reference() -> tuple[TrajectoryRun, dict[str, float] | None]:
        with RecipeStack([]).session():
            reference = run_trajectory(model, ddpm, cond, noise)
            if not thresholds.get("calibrate"):
                return reference, None
            second = fixed_noise(noise.x_T.shape, T, seed + 1, device)
            return reference, calibrate_floor(model, ddpm, cond, noise, second, gate=QualityGate(thresholds),
                                              reference=reference)

    key = {"cfg": {k: cfg.get(k) for k in ("model", "diffusion", "seed")}, "n": n_samples, "device": device.type,
           "thresholds": thresholds, "checkpoint": _file_identity(checkpoint)}
    reference, floor = _cached(thresholds.get("cache_dir"), key, strict_reference)
    stack = RecipeStack.from_config(cfg.get("recipe"))
    with stack.session():
        fast = stack.prepare_model(copy.deepcopy(model))
        candidate = run_trajectory(lambda x, t: fast(stack.prepare_input(x), t), sampler, cond, noise,
                                   probe_inputs=reference.probe_inputs, forward_context=stack.forward_context)
    return QualityGate(thresholds, floor=floor).run(reference, candidate, real=real)


def _file_identity(path: str | None) -> list[Any] | None:
    """A checkpoint's path, size and mtime: a retrained file at the same path is a new key."""
    if path is None:
        return None
    stat = Path(path).stat()
    return [str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns]


def _cached(cache_dir: str | None, key: Mapping[str, Any], compute: Callable[[], Any]) -> Any:
    """``compute()``, stored under ``cache_dir`` by a hash of ``key`` and reused while it matches.

    The strict-FP32 reference (and its calibrated floors) depends only on the weights, schedule,
    masks, noise and N, not on the candidate, so a ladder of gates over one model computes it
    once instead of once per job (each bench job is a fresh process). Written atomically, so
    concurrent jobs at worst both compute it.
    """
    if not cache_dir:
        return compute()
    digest = hashlib.sha256(json.dumps(_json_safe(key), sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"reference_{digest}.pt"
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


def _gate_model(cfg: Mapping[str, Any], checkpoint: str | None, seed: int):
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
