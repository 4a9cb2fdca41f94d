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

The N samples are ``quality.n_masks`` synthetic phantom masks x N / n_masks noise draws each, run
``quality.batch_size`` at a time; sample i draws its noise from seed (``seed``, i), whatever the batch. Both runs share the masks, and the weights unless ``quality.candidate_checkpoint`` gives the
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
from med_ddpm.samplers.tuned import file_sha256
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


class SampleNoise(Sequence):
    """The step noise of a batch of samples, each sample's own :class:`StepNoise`: a sample's noise does not
    depend on the batch it runs in. ``seed`` names the family (run_trajectory records it)."""

    def __init__(self, fields: Sequence[StepNoise], seed: int):
        self.fields, self.seed = list(fields), seed

    def __len__(self) -> int:
        return len(self.fields[0])

    def __getitem__(self, k: int) -> torch.Tensor:
        return torch.cat([field[k] for field in self.fields])


def sample_seed(seed: int, i: int) -> int:
    return int(np.random.SeedSequence([seed, i]).generate_state(1)[0])


def batch_noise(shape: Sequence[int], steps: int, seed: int, samples: range, device: torch.device) -> FixedNoise:
    """x_T and ``steps`` noise fields for ``samples`` of a run, each drawn from seed (``seed``, i)."""
    one = (1, *shape[1:])
    per = [fixed_noise(one, steps, sample_seed(seed, i), device) for i in samples]
    return FixedNoise(torch.cat([p.x_T for p in per]), SampleNoise([p.step_noise for p in per], seed))


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


def batched_trajectory(model_fn: ModelFn, sampler: Sampler, cond: torch.Tensor, channels: int, seed: int, batch: int, *,
                       probe_inputs: Mapping[int, torch.Tensor] | None = None,
                       probe_timesteps: Sequence[int] | None = None, forward_context: ContextFactory | None = None,
                       on_batch: Callable[[int], None] | None = None,
                       cache: tuple[str | None, Mapping[str, Any]] | None = None) -> TrajectoryRun:
    """:func:`run_trajectory` over ``batch`` of the N samples at a time, joined into one run: sample i draws its noise
    from seed (``seed``, i) (:func:`batch_noise`), so the run does not depend on ``batch``, and a 128³ gate runs N
    volumes in batches a GPU holds. ``channels``: the image channels sampled; ``on_batch(done)`` is called after each
    batch. ``cache``: (folder, key): each batch is stored in ``folder/batches`` under the key and its samples' range
    (:func:`cached`), so a reference longer than one device call, cut, is finished by the same command from its last
    stored batch."""
    n, steps = len(cond), max(sampler.schedule.num_train_timesteps, len(sampler.timesteps))
    shape = (n, channels, *cond.shape[2:])
    runs = []
    for start in range(0, n, batch):
        part = range(start, min(start + batch, n))
        probes = None if probe_inputs is None else {s: x[part.start:part.stop] for s, x in probe_inputs.items()}

        def one(part: range = part, probes: Mapping[int, torch.Tensor] | None = probes) -> TrajectoryRun:
            return run_trajectory(model_fn, sampler, cond[part.start:part.stop], batch_noise(shape, steps, seed, part,
                                  cond.device), probe_timesteps=probe_timesteps, probe_inputs=probes,
                                  forward_context=forward_context)

        folder, key = cache or (None, {})
        runs.append(cached(folder and Path(folder) / "batches", {**key, "samples": [part.start, part.stop]}, one))
        if on_batch is not None:
            on_batch(part.stop)
    joined = {key: {s: torch.cat([getattr(r, key)[s] for r in runs]) for s in runs[0].eps_probe}
              for key in ("eps_probe", "probe_inputs")}
    return TrajectoryRun(torch.cat([r.samples for r in runs]), torch.cat([r.cond for r in runs]), joined["eps_probe"],
                         joined["probe_inputs"], runs[0].sampler, seed)


def visited_probes(sampler: Sampler) -> list[int]:
    """:func:`default_probe_timesteps`, each moved to the nearest timestep ``sampler`` visits: a reference on a
    few-step sampler (``quality.reference_sampler=same``) records its probes where it calls the network."""
    visited = [int(t) for t in sampler.timesteps]
    return sorted({min(visited, key=lambda v: abs(v - t)) for t in
                   default_probe_timesteps(sampler.schedule.num_train_timesteps)})


def probe_run(model_fn: ModelFn, reference: TrajectoryRun, device: torch.device | str, *,
              forward_context: ContextFactory | None = None, batch: int | None = None) -> TrajectoryRun:
    """ε of ``model_fn`` at the reference's probe inputs only, no trajectory (``samples`` is None), ``batch``
    volumes per forward (None: all at once).

    Enough to judge the bias and noise of a denoiser change (the drift checks), at the cost of a
    few forward passes instead of a whole reverse chain.
    """
    eps = _probe_eps(model_fn, reference.probe_inputs, torch.device(device), forward_context, batch)
    return TrajectoryRun(None, reference.cond, eps, reference.probe_inputs, {"name": "probes only"},
                         reference.noise_seed)


@torch.no_grad()
def _probe_eps(model_fn, inputs, device, forward_context, batch: int | None = None) -> dict[int, torch.Tensor]:
    ctx = forward_context or contextlib.nullcontext
    eps = {}
    for t, x in sorted(inputs.items()):
        parts = []
        for part in x.split(batch or len(x)):
            tb = torch.full((part.shape[0],), t, dtype=torch.long, device=device)
            with ctx():
                parts.append(model_fn(part.to(device), tb).detach().float().cpu())
        eps[t] = torch.cat(parts)
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
    The report names both checkpoints. ``quality.reference_sampler=same``: the reference runs the candidate's
    sampler (strict FP32, the same noise), so the verdict is the stack's numerics alone. ``quality.batch_size``: the
    volumes per trajectory batch (a 128³ batch of 32 does not fit an 80 GB GPU in FP32; a batch that does not fit
    is refused in one line on a CUDA device before anything runs).
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
    batch = gate_batch(q, n)
    if device.type == "cuda":
        check_batch_fits(batch, n, measure_volume_gib(model, cond), torch.cuda.get_device_properties(device))
    other = q.get("candidate_checkpoint")
    other_net = candidate_weights(cfg, other, model, schedule) if other else None  # refused before any run
    node = cfg.get("sampler") or {"name": "ddpm"}
    ddpm = DDPMSampler(schedule)
    ddpm.set_timesteps(schedule.num_train_timesteps)
    sampler = ddpm if other_net is not None else sampler_from_config(node, schedule)  # other_net: DDPM, as checked
    ref_node = reference_node(q, node if other_net is None else {"name": "ddpm"}, schedule.num_train_timesteps)
    ref_sampler = sampler_from_config(ref_node, schedule) if q.get("reference_sampler") == "same" else ddpm
    probes = visited_probes(ref_sampler)
    gate = QualityGate(q, device=device)
    gate.check_bias_power(n, len(probes))  # before any trajectory is run

    weights = {"sha256": file_sha256(checkpoint), "weights": "ema"} if checkpoint else {
        "init": {k: cfg.get(k) for k in ("model", "diffusion", "seed")}}
    key = reference_key(weights, cond, seed, ref_node, device)

    def strict_reference() -> TrajectoryRun:
        with RecipeStack([]).session():
            return batched_trajectory(model, ref_sampler, cond, model.out_channels, seed, batch, probe_timesteps=probes,
                                      cache=(q.get("cache_dir"), key))

    reference = cached(q.get("cache_dir"), key, strict_reference)
    cand_seed = seed if q.get("candidate_seed") is None else int(q["candidate_seed"])
    trajectory = bool(q.get("trajectory", True))
    if other_net is not None:
        with RecipeStack([]).session():
            candidate = (batched_trajectory(other_net, sampler, cond, model.out_channels, cand_seed, batch,
                                            probe_inputs=reference.probe_inputs) if trajectory else
                         probe_run(other_net, reference, device, batch=batch))
    else:
        candidate = stack_candidate(cfg, model, sampler, reference, cond, cand_seed if trajectory else None, batch)
    report = gate.run(reference, candidate)
    report.context["checkpoints"] = {"reference": checkpoint, "candidate": other or checkpoint}
    report.context["batch_size"] = batch
    return report


def reference_node(q: Mapping[str, Any], node: Mapping[str, Any], T: int) -> dict[str, Any]:
    """The reference's sampler node: DDPM over all ``T`` steps (``quality.reference_sampler`` null), or the
    candidate's own sampler (``same``: strict FP32 against the stack with the same sampler and noise, the numerics
    alone)."""
    chosen = q.get("reference_sampler")
    if chosen not in (None, "same"):
        raise ConfigError(f"quality.reference_sampler={chosen}: must be null (strict-FP32 DDPM over all {T} steps) or "
                          "same (strict FP32 with the candidate's sampler); pass one of them")
    return dict(node) if chosen == "same" else {"name": "ddpm", "steps": T}


def gate_batch(q: Mapping[str, Any], n: int) -> int:
    """Volumes per trajectory batch: ``quality.batch_size``, a divisor of N (one batch shape for compiled stacks);
    null: all N at once."""
    batch = q.get("batch_size")
    if batch is None:
        return n
    if not isinstance(batch, int) or batch < 1 or n % batch:
        raise ConfigError(f"quality.batch_size={batch}: must be a divisor of quality.n_samples={n} (one batch shape "
                          "for every trajectory); pass e.g. quality.batch_size=8")
    return batch


HEADROOM = 0.9  # of the GPU's memory a gate's batch may plan on: the allocator's fragments and cuDNN's workspaces


@torch.no_grad()
def measure_volume_gib(model: torch.nn.Module, cond: torch.Tensor) -> tuple[float, float]:
    """(GiB the forward needs whatever the batch, GiB more per volume): the peak of strict-FP32 forwards of one and
    two volumes at the gate's size, the largest of the gate's arms."""
    from optim import RecipeStack

    peaks = []
    for b in (1, 2):
        x = torch.zeros(b, model.out_channels, *cond.shape[2:], device=cond.device)
        torch.cuda.reset_peak_memory_stats(cond.device)
        with RecipeStack([]).session():
            model(torch.cat([x, cond[:1].expand(b, *cond.shape[1:])], 1), torch.zeros(b, dtype=torch.long,
                                                                                       device=cond.device))
        peaks.append(torch.cuda.max_memory_allocated(cond.device) / 2**30)
    per_volume = max(peaks[1] - peaks[0], 1e-6)
    return peaks[0] - per_volume, per_volume


def check_batch_fits(batch: int, n: int, need: tuple[float, float], gpu: Any) -> None:
    """Refuse a batch the GPU cannot hold, in one line naming the largest divisor of N that fits (``need``: fixed and
    per-volume GiB, :func:`measure_volume_gib`; ``gpu``: ``name`` and ``total_memory`` in bytes)."""
    fixed, per_volume = need
    total = gpu.total_memory / 2**30
    fits = int((HEADROOM * total - fixed) // per_volume)
    if batch <= fits:
        return
    divisors = [d for d in range(1, n + 1) if n % d == 0 and d <= fits]
    fix = f"pass quality.batch_size={divisors[-1]}" if divisors else "it cannot hold one volume: use a larger GPU"
    raise ConfigError(f"quality.batch_size={batch}: a strict-FP32 batch of {batch} needs about "
                      f"{fixed + batch * per_volume:.0f} GiB ({per_volume:.2f} GiB a volume, measured) and {gpu.name} "
                      f"has {total:.0f} GiB; {fix}")


def stack_candidate(cfg: Mapping[str, Any], model: torch.nn.Module, sampler: Sampler, reference: TrajectoryRun,
                    cond: torch.Tensor, seed: int | None, batch: int) -> TrajectoryRun:
    """The candidate arm of a recipe gate: the reference's weights under ``cfg``'s stack, sampled with
    ``sampler`` (built from ``cfg``'s sampler node) on noise ``seed`` (None: probe-only), ``batch`` at a time."""
    from optim import RecipeStack

    stack = RecipeStack.from_config(cfg.get("recipe"))
    with stack.session():
        fast = stack.prepare_model(copy.deepcopy(model))
        model_fn = lambda x, t: fast(stack.prepare_input(x), t)  # noqa: E731
        if seed is None:
            return probe_run(model_fn, reference, cond.device, forward_context=stack.forward_context, batch=batch)
        return batched_trajectory(model_fn, sampler, cond, model.out_channels, seed, batch,
                                  probe_inputs=reference.probe_inputs, forward_context=stack.forward_context)


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

def cond_hash(cond: torch.Tensor) -> str:
    """One volume's conditioning, by its bytes."""
    return hashlib.sha256(cond.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def reference_key(weights: Mapping[str, Any], cond: torch.Tensor, seed: int, sampler: Mapping[str, Any],
                  device: torch.device) -> dict[str, Any]:
    """What a strict-FP32 reference run depends on: the weights (a checkpoint's sha256, or a seeded init), the N
    masks (one hash a volume), the noise seed, the sampler's whole config and the code that computes it. Another
    value of any is another file: a cache of other weights, sampler or code is recomputed, never reused."""
    return {"weights": dict(weights), "masks": [cond_hash(c) for c in cond], "seed": seed,
            "sampler": json_safe(dict(sampler)), "device": device.type, "code": reference_code_digest()}


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
        trained = (loaded.config.get("model") or {}).get("image_size")
        if trained is not None and list(trained) != list(cfg["model"]["image_size"]):
            raise ConfigError(f"checkpoint {checkpoint}: trained at {'x'.join(map(str, trained))}, but the gate's masks "
                              f"are {'x'.join(map(str, cfg['model']['image_size']))} (model.image_size); pass the "
                              f"model config it was trained with, e.g. model.image_size=[{','.join(map(str, trained))}]")
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
