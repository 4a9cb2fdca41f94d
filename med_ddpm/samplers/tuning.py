"""The fewest model calls that pass the quality gate on one checkpoint: search, gate, stop, and the evidence.

For each budget K (model calls per sample), in increasing order:

1. the Align-Your-Steps grid of K points (:mod:`med_ddpm.samplers.search`): the bound's matrix M is estimated once,
   on the first ``search.n`` volumes of ``data`` with noise seed ``search.seed`` inside the recipe stack, and the
   exact best grid for each K is solved from it;
2. the ``sampler`` on that grid, run with the recipe stack on N = ``quality.n_samples`` volumes (``quality.n_masks``
   masks x N / n_masks noise draws), ``gate.batch`` at a time;
3. the gate (:class:`med_ddpm.quality.gate.QualityGate`, ``quality`` thresholds) against the checkpoint's strict-FP32 DDPM
   over all T steps on the same masks and noise.

It stops at the first K whose verdict is pass and writes ``sampler.yaml`` (:mod:`med_ddpm.samplers.tuned`),
``report.md`` and ``calls_vs_quality.png``; with no K passing, ``sampler.yaml`` records the fail, which
``med_ddpm.sample`` refuses.

Held out: the gate's masks are the first n_masks of ``masks`` (or of phantoms of seed ``gate.seed``) that are not
the mask of one of the search's volumes, and its noise comes from ``gate.seed``, which must differ from
``search.seed``: a grid is never judged on the samples it was chosen on.

Each sample i draws its noise from seed (gate.seed, i), so a run does not depend on ``gate.batch``. M
(``search_distances.npy``) and each budget's result (``tune.json``) are written atomically as they finish and
reused by a rerun with the same settings; the reference run is cached under ``paths.reference_cache`` by the
checkpoint's sha256, the masks, the seed, N and the code that computes it.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from omegaconf import DictConfig, OmegaConf

from med_ddpm.checkpoint import Loaded, load_checkpoint
from med_ddpm.config_checks import (
    ConfigError,
    DataError,
    OutputError,
    as_config_error,
    check_checkpoint_options,
    check_int,
    check_int_value,
)
from med_ddpm.data.datasets import build_dataset, load_condition, read_volume
from med_ddpm.data.encoding import VARIANT_BY_IMAGE_CHANNELS
from med_ddpm.data.masks import list_masks
from med_ddpm.data.phantoms import SyntheticPhantoms
from med_ddpm.quality.gate import QualityGate, TrajectoryRun
from med_ddpm.quality.probe import batched_trajectory, cached, cond_hash, reference_file, reference_key
from med_ddpm.samplers import DDPMSampler, make_timesteps, sampler_from_config
from med_ddpm.samplers.search import (
    describe_data,
    interval_costs,
    kl_bound,
    log_snr_weights,
    optimal_grid,
    search_geometry,
    stack_distances,
)
from med_ddpm.samplers.tuned import file_sha256, write_tuned
from med_ddpm.utils import atomic_write, atomic_write_text, json_safe, resolve_device, save_figure
from optim import RecipeStack

log = logging.getLogger("med_ddpm.tune")
STATE, DISTANCES, RESULT = "tune.json", "search_distances.npy", "sampler.yaml"
DISTRIBUTION = ("kid_vs_ref", "mmd_vs_ref", "histogram_w1_vs_ref", "diversity_gap")  # the checks that decide


# ----------------------------------------------------------------------------------------------------- options
def check_budgets(value: Any) -> list[int]:
    """``budgets``: a non-empty, strictly increasing list of model calls per sample."""
    items = list(value) if OmegaConf.is_list(value) or isinstance(value, list | tuple) else [value]
    example = "budgets=[10,15,20,25,35,50]"
    if not items:
        raise ConfigError(f"budgets=[]: empty; pass the model calls per sample to try, increasing, e.g. {example}")
    for k in items:
        check_int_value("budgets", k, 1)
    if any(b <= a for a, b in zip(items, items[1:])):
        fix = ",".join(str(k) for k in sorted(set(items)))
        raise ConfigError(f"budgets={items}: not increasing; the first budget that passes is kept, so pass them in "
                          f"increasing order, e.g. budgets=[{fix}]")
    return items


def check_options(cfg: DictConfig) -> list[int]:
    """Refuse, before the checkpoint is loaded, an option the run would fail on; returns the budgets."""
    check_checkpoint_options(cfg)
    budgets = check_budgets(cfg.budgets)
    for key, low in (("search.n", 1), ("search.batch", 1), ("search.seed", 0), ("gate.seed", 0), ("gate.batch", 1),
                     ("quality.n_masks", 1)):
        check_int(cfg, key, low)
    n, n_masks = check_int(cfg, "quality.n_samples", 2), cfg.quality.n_masks
    if n % n_masks:
        raise ConfigError(f"quality.n_samples={n}: not a multiple of quality.n_masks={n_masks} (each mask gets "
                          f"N / n_masks noise draws); pass quality.n_samples={max(n - n % n_masks, n_masks)}")
    if cfg.gate.seed == cfg.search.seed:
        raise ConfigError(f"gate.seed={cfg.gate.seed}: the search's noise seed (search.seed); the gate's noise is held "
                          f"out from the search, so pass another, e.g. gate.seed={cfg.search.seed + 1}")
    return budgets


def base_sampler(cfg: DictConfig, loaded: Loaded, budgets: Sequence[int]) -> dict[str, Any]:
    """The ``sampler`` node without its grid, checked to take a grid of K points for K model calls."""
    node = {k: v for k, v in OmegaConf.to_container(cfg.sampler, resolve=True).items() if k not in ("steps", "timesteps")}
    T = loaded.schedule.num_train_timesteps
    for k in budgets:
        check_int_value("budgets", k, 1, T, f" (the checkpoint's schedule has T = {T} training steps)")
    k, name = budgets[0], node["name"]
    grid = make_timesteps(T, k).tolist()
    try:
        sampler_from_config(grid_node({"name": name}, grid), loaded.schedule)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"sampler={name}: takes no timestep grid; tune one that does, e.g. sampler=dpm_solver_pp "
                          "sampler.variant=sde (experiment=fast_sample's)") from err
    with as_config_error("sampler", f"see configs/sampler/{name}.yaml for its options", errors=(ValueError, TypeError)):
        sampler = sampler_from_config(grid_node(node, grid), loaded.schedule)
    if len(sampler.timesteps) != k:
        raise ConfigError(f"sampler={name}: makes {len(sampler.timesteps)} model calls on a {k}-point grid; "
                          "tune a sampler whose calls are its grid's points, e.g. sampler=dpm_solver_pp")
    return node


def grid_node(base: dict[str, Any], grid: Sequence[int]) -> dict[str, Any]:
    return {**base, "steps": len(grid), "timesteps": [int(t) for t in grid]}


# ----------------------------------------------------------------------------------------------------- state
@dataclass
class Tuning:
    """One tuning run: the loaded checkpoint, its geometry and the state written to ``out_dir``."""

    cfg: DictConfig
    out_dir: Path
    device: torch.device
    loaded: Loaded
    sha256: str
    size: list[int]
    budgets: list[int]
    sampler: dict[str, Any]
    state: dict[str, Any]

    @property
    def T(self) -> int:
        return self.loaded.schedule.num_train_timesteps

    @property
    def variant(self) -> str:
        return VARIANT_BY_IMAGE_CHANNELS[self.loaded.model.out_channels]

    @property
    def recipe(self) -> dict[str, Any]:
        return recipe_node(self.cfg)

    def save_state(self) -> None:
        atomic_write_text(self.out_dir / STATE, json.dumps(json_safe(self.state), indent=1) + "\n")


def recipe_node(cfg: DictConfig) -> dict[str, Any]:
    """The recipe stack's config (``{}``: strict FP32; ``'~experiment'`` leaves no ``recipe`` key)."""
    node = cfg.get("recipe")
    return OmegaConf.to_container(node, resolve=True) if node is not None else {}


def run_key(cfg: DictConfig, sha256: str, size: Sequence[int], sampler: dict[str, Any]) -> dict[str, Any]:
    """What a run's results depend on: a rerun in the same output_dir must match it to reuse them."""
    key = {"checkpoint_sha256": sha256, "weights": cfg.weights, "image_size": list(size),
           "data": describe_data(cfg.data), "search": {"n": cfg.search.n, "seed": cfg.search.seed},
           "masks": cfg.masks, "gate_seed": cfg.gate.seed, "sampler": sampler,
           "recipe": recipe_node(cfg),
           "quality": OmegaConf.to_container(cfg.quality, resolve=True), "torch": str(torch.__version__)}
    return json.loads(json.dumps(json_safe(key)))


def load_state(out_dir: Path, key: dict[str, Any]) -> dict[str, Any]:
    """The state of an earlier run of the same settings in ``out_dir`` (empty when none); another run's is refused."""
    path = out_dir / STATE
    if not path.exists():
        return {"key": key, "budgets": {}}
    try:
        state = json.loads(path.read_text())
    except ValueError as err:
        raise OutputError(f"output_dir={out_dir}: {STATE} is not JSON ({err}); remove it, or choose another "
                          "output_dir=") from err
    differ = [k for k in key if state.get("key", {}).get(k) != key[k]]
    if differ:
        raise OutputError(f"output_dir={out_dir}: holds a tuning with another {', '.join(differ)} ({STATE}); choose "
                          "another output_dir=, or remove it")
    return state


def prepare(cfg: DictConfig, out_dir: Path) -> Tuning:
    """Check the options, load the checkpoint and the state of an earlier run of the same settings."""
    budgets = check_options(cfg)
    device = resolve_device(cfg.device)
    loaded = load_checkpoint(cfg.checkpoint, weights=cfg.weights)
    size = search_geometry(cfg, loaded)
    sampler = base_sampler(cfg, loaded, budgets)
    sha256 = file_sha256(cfg.checkpoint)
    state = load_state(out_dir, run_key(cfg, sha256, size, sampler))
    return Tuning(cfg, out_dir, device, loaded, sha256, size, budgets, sampler, state)


# ----------------------------------------------------------------------------------------------------- masks
def search_view(cfg: DictConfig) -> DictConfig:
    """The options :func:`med_ddpm.samplers.search.stack_distances` reads, from the ``search`` node; the data uncached,
    so that only the ``search.n`` volumes the search uses are read."""
    data = OmegaConf.merge(cfg.data, {"cache": "none"})
    return OmegaConf.create({"data": data, "n": cfg.search.n, "batch": cfg.search.batch, "seed": cfg.search.seed,
                             "progress": cfg.progress})


def search_masks(t: Tuning) -> list[str]:
    """Hashes of the masks of the search's volumes, read from the data once and kept in the state."""
    if "search_masks" not in t.state:
        dataset, n = build_dataset(search_view(t.cfg).data, t.size), t.cfg.search.n
        if len(dataset) < n:
            more = "data.num_volumes=N" if t.cfg.data.name == "synthetic" else "a data.root with more cases"
            raise DataError(f"search.n={n}: {describe_data(t.cfg.data)} hold {len(dataset)} volume(s); pass "
                            f"search.n={len(dataset)} or {more}")
        t.state["search_masks"] = [cond_hash(dataset[i]["cond"]) for i in range(n)]
    return t.state["search_masks"]


def mask_pool(t: Tuning, extra: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, cond) of the candidate gate masks in order: ``masks``, else phantoms of seed ``gate.seed``."""
    cfg = t.cfg
    if cfg.masks is None:
        phantoms = SyntheticPhantoms(cfg.quality.n_masks + extra, t.size, variant=t.variant, seed=cfg.gate.seed)
        for i in range(len(phantoms)):
            yield f"phantom {i} (seed {cfg.gate.seed})", phantoms[i]["cond"]
        return
    for path in list_masks(cfg.masks):
        native = list(reversed(read_volume(path, "mask")[0].shape))
        if native != t.size:
            raise DataError(f"masks={cfg.masks}: {path.name} is {native} (D, H, W), but checkpoint={cfg.checkpoint} "
                            f"samples at {t.size}; pass masks of that size (preprocessed as the training data were)")
        cond, _ = load_condition(path, t.variant, t.size, seg_labels=cfg.data.get("seg_labels", "auto"))
        yield path.name, cond


def gate_masks(t: Tuning) -> tuple[torch.Tensor, list[str], list[str]]:
    """(N conds, the masks' names, the names left out as the search's): the first ``quality.n_masks`` masks of
    the pool that are not the mask of a search volume, each repeated N / n_masks times."""
    searched, n_masks = set(search_masks(t)), t.cfg.quality.n_masks
    chosen, left_out = [], []
    for name, cond in mask_pool(t, len(searched)):
        if cond_hash(cond) in searched:
            left_out.append(name)
            continue
        chosen.append((name, cond))
        if len(chosen) == n_masks:
            break
    if len(chosen) < n_masks:
        raise DataError(f"masks={t.cfg.masks}: {len(chosen)} mask(s) besides the {len(left_out)} of the search's "
                        f"volumes, and the gate needs quality.n_masks={n_masks}; pass more masks, or "
                        f"quality.n_masks={max(len(chosen), 1)} with quality.n_samples a multiple of it")
    conds = torch.stack([c for _, c in chosen]).repeat_interleave(t.cfg.quality.n_samples // n_masks, dim=0)
    return conds.contiguous(), [name for name, _ in chosen], left_out


# ----------------------------------------------------------------------------------------------------- runs
def batched_run(model_fn, sampler, cond: torch.Tensor, t: Tuning, *, reference: TrajectoryRun | None = None,
                forward_context=None) -> TrajectoryRun:
    """:func:`med_ddpm.quality.probe.batched_trajectory` over ``gate.batch`` samples at a time on noise ``gate.seed``,
    each batch logged as it finishes."""
    begin = time.perf_counter()

    def logged(done: int) -> None:
        log.info("  %d model calls: %d of %d volumes sampled (%.0f s)", len(sampler.timesteps), done, len(cond),
                 time.perf_counter() - begin)

    return batched_trajectory(model_fn, sampler, cond.to(t.device), t.loaded.model.out_channels, t.cfg.gate.seed,
                              t.cfg.gate.batch, probe_inputs=None if reference is None else reference.probe_inputs,
                              forward_context=forward_context, on_batch=logged)


def ddpm_reference_key(t: Tuning, cond: torch.Tensor) -> dict[str, Any]:
    """The reference's key (:func:`med_ddpm.quality.probe.reference_key`): the gate's strict-FP32 DDPM over all T
    steps of these weights, masks and noise, so ``bench.ladder preset=quality_128`` and this run share one file."""
    return reference_key({"sha256": t.sha256, "weights": t.cfg.weights}, cond, t.cfg.gate.seed,
                         {"name": "ddpm", "steps": t.T}, t.device)


def reference_run(t: Tuning, cond: torch.Tensor, key: dict[str, Any]) -> TrajectoryRun:
    """The checkpoint's strict-FP32 DDPM over all T steps on the gate's masks and noise (cached)."""
    ddpm = DDPMSampler(t.loaded.schedule.to(t.device))
    ddpm.set_timesteps(t.T)

    def compute() -> TrajectoryRun:
        log.info("reference: strict-FP32 DDPM-%d on %d volumes", t.T, len(cond))
        with RecipeStack([]).session():
            return batched_run(t.loaded.model.to(t.device).eval(), ddpm, cond, t)

    return cached(Path(t.cfg.paths.reference_cache).expanduser(), key, compute)


def gate_budget(t: Tuning, k: int, costs: np.ndarray, model_fn, stack: RecipeStack, reference: TrajectoryRun,
                cond: torch.Tensor) -> dict[str, Any]:
    """The searched K-point grid, sampled with the stack, judged against the reference."""
    start = time.perf_counter()
    grid = optimal_grid(costs, k)
    node = grid_node(t.sampler, grid)
    sampler = sampler_from_config(node, t.loaded.schedule.to(t.device))
    candidate = batched_run(model_fn, sampler, cond, t, reference=reference, forward_context=stack.forward_context)
    sampled = time.perf_counter()
    with RecipeStack([]).session():  # the gate's own numbers in strict FP32, whatever the stack sets
        report = QualityGate(OmegaConf.to_container(t.cfg.quality, resolve=True) | {"cond_layout": t.variant},
                             device=t.device).run(reference, candidate)
    return {"calls": len(sampler.timesteps), "grid": grid, "sampler": node, "bound": kl_bound(costs, grid),
            "trailing_bound": kl_bound(costs, make_timesteps(t.T, k).tolist()), "verdict": report.verdict,
            "worst_p": worst_p(report.checks), "report": report.to_dict(),
            "sampling_s": round(sampled - start, 3), "gate_s": round(time.perf_counter() - sampled, 3)}


def worst_p(checks: dict[str, dict[str, Any]]) -> float:
    """The smallest p-value of the distribution checks: the check that decides a sampler's verdict."""
    return min((float(checks[c]["p_value"]) for c in DISTRIBUTION if c in checks), default=math.nan)


# ----------------------------------------------------------------------------------------------------- plan
@torch.no_grad()
def seconds_per_volume(t: Tuning, cond: torch.Tensor) -> float:
    """One strict-FP32 forward of a ``gate.batch`` batch, timed after a first one, per volume."""
    model, part = t.loaded.model.to(t.device).eval(), cond[:t.cfg.gate.batch].to(t.device)
    x = torch.cat([torch.zeros(len(part), model.out_channels, *part.shape[2:], device=t.device), part], 1)
    steps = torch.full((len(part),), t.T - 1, device=t.device)
    with RecipeStack([]).session():
        for _ in range(2):  # the second call is timed: the first one sets up the kernels
            if t.device.type == "cuda":
                torch.cuda.synchronize(t.device)
            start = time.perf_counter()
            model(x, steps)
            if t.device.type == "cuda":
                torch.cuda.synchronize(t.device)
    return (time.perf_counter() - start) / len(part)


def plan(t: Tuning, searched: bool, referenced: bool, per_volume_s: float) -> str:
    """What is left to run, in volume-forwards, and the time it would take in strict FP32: a bound on a GPU of its
    own (the stack's forwards are faster); a GPU shared with other work takes longer."""
    n = t.cfg.quality.n_samples
    left = [k for k in t.budgets if str(k) not in t.state["budgets"]]
    parts = {"search": 0 if searched else t.cfg.search.n * t.T, "reference": 0 if referenced else n * t.T,
             "candidates": n * sum(left)}
    total = sum(parts.values()) * per_volume_s
    listed = ", ".join(f"{name} {count}" for name, count in parts.items())
    return (f"plan: {listed} volume-forwards (budgets {left or 'all done'}); a strict-FP32 forward takes "
            f"{per_volume_s:.3g} s per volume here, so at most {total / 60:.1f} min on a GPU of its own (the stack's "
            "forwards are faster; its first call compiles)")


# ----------------------------------------------------------------------------------------------------- the run
def search_costs(t: Tuning, stack: RecipeStack) -> np.ndarray:
    """The bound's interval costs: M from an earlier run of these settings, else estimated and written."""
    path = t.out_dir / DISTANCES
    if "search" in t.state and path.exists():
        distances = np.load(path)
    else:
        start = time.perf_counter()
        log.info("search: x̂0 at every t on %d %s", t.cfg.search.n, describe_data(t.cfg.data))
        distances = stack_distances(search_view(t.cfg), copy.deepcopy(t.loaded.model), t.loaded.schedule, t.size,
                                    stack, t.device)
        atomic_write(path, lambda f: np.save(f, distances))
        t.state["search"] = {"seconds": round(time.perf_counter() - start, 3)}
        t.save_state()
    return interval_costs(distances, log_snr_weights(t.loaded.schedule))


def stack_model(t: Tuning, stack: RecipeStack):
    """A copy of the checkpoint's network prepared by the stack, called on inputs in the stack's layout."""
    prepared = stack.prepare_model(copy.deepcopy(t.loaded.model).to(t.device).eval())
    return lambda x, s: prepared(stack.prepare_input(x), s)


def gate_budgets(t: Tuning, costs: np.ndarray, stack: RecipeStack, reference: TrajectoryRun,
                 cond: torch.Tensor) -> list[dict[str, Any]]:
    """Each budget's result in increasing order (reused when done), up to the first that passes."""
    results, model_fn = [], None
    with stack.session():
        for k in t.budgets:
            result = t.state["budgets"].get(str(k))
            if result is None:
                model_fn = model_fn or stack_model(t, stack)
                result = json_safe(gate_budget(t, k, costs, model_fn, stack, reference, cond))
                t.state["budgets"][str(k)] = result
                t.save_state()
            log.info("%d calls: %s (worst p %.3g; sampled in %s s, gated in %s s)", k, result["verdict"],
                     float(result["worst_p"]), result["sampling_s"], result["gate_s"])
            results.append(result)
            if result["verdict"] == "pass":
                break
    return results


def run(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Search, gate and stop; returns the record written to ``sampler.yaml``."""
    t = prepare(cfg, out_dir)
    stack = RecipeStack.from_config(cfg.get("recipe"))
    stack.require(t.device)
    cond, names, left_out = gate_masks(t)
    key = ddpm_reference_key(t, cond)
    referenced = reference_file(Path(cfg.paths.reference_cache).expanduser(), key).exists()
    log.info(plan(t, "search" in t.state and (out_dir / DISTANCES).exists(), referenced, seconds_per_volume(t, cond)))
    costs = search_costs(t, stack)
    start = time.perf_counter()
    reference = reference_run(t, cond, key)
    t.state["reference_s"] = t.state.get("reference_s") if referenced else round(time.perf_counter() - start, 3)
    results = gate_budgets(t, costs, stack, reference, cond)
    held_out = {"masks": names, "left_out": left_out, "noise_seed": cfg.gate.seed,
                "search_noise_seed": cfg.search.seed}
    t.state["held_out"] = held_out
    t.save_state()
    return write_results(t, results, held_out)


# ----------------------------------------------------------------------------------------------------- results
def failing_checks(report: dict[str, Any]) -> list[str]:
    return [name for name, check in report["checks"].items() if check["status"] != "pass"]


def record_of(t: Tuning, results: list[dict[str, Any]], held_out: dict[str, Any]) -> dict[str, Any]:
    """What ``sampler.yaml`` holds: the last budget gated (the passing one, or the largest tried)."""
    cfg, chosen = t.cfg, results[-1]
    report = chosen["report"]
    failing = failing_checks(report)
    statistics = {"verdict": report["verdict"], "n_samples": report["n_samples"],
                  "reasons": [r for r in report["reasons"] if r.split("=", 1)[0] in failing],
                  "n_masks": report["n_masks"], "extractor": report["extractor"],
                  "checks": {name: {k: c[k] for k in ("value", "status", "p_value") if k in c}
                             for name, c in report["checks"].items()}}
    return {"sampler": chosen["sampler"], "calls": chosen["calls"], "verdict": chosen["verdict"],
            "checkpoint": {"path": str(cfg.checkpoint), "sha256": t.sha256, "weights": cfg.weights},
            "recipe": t.recipe, "torch": str(torch.__version__),
            "gate": {"reference": f"strict-FP32 DDPM over all {t.T} steps, same masks and noise",
                     "image_size": t.size, "held_out": held_out, "statistics": statistics},
            "search": {"data": describe_data(cfg.data), "n": cfg.search.n, "kl_bound": chosen["bound"],
                       "trailing_kl_bound": chosen["trailing_bound"]},
            "budgets": [{"calls": r["calls"], "verdict": r["verdict"], "worst_p": r["worst_p"]} for r in results]}


def headline(record: dict[str, Any]) -> str:
    grid = f"`{record['sampler']['name']}` on the grid searched for this checkpoint, `{record['sampler']['timesteps']}`"
    if record["verdict"] == "pass":
        return f"**{record['calls']} model calls pass** the gate: {grid}."
    return (f"**No budget passed** up to {record['calls']} model calls ({grid}): `sampler.yaml` records the "
            f"{record['verdict']}, which `med_ddpm.sample` refuses; try larger `budgets=[...]`.")


def report_page(t: Tuning, results: list[dict[str, Any]], record: dict[str, Any]) -> str:
    cfg, n, n_masks = t.cfg, t.cfg.quality.n_samples, t.cfg.quality.n_masks
    held = record["gate"]["held_out"]
    rows = "\n".join(f"| {r['calls']} | {r['verdict']} | {float(r['worst_p']):.3g} | "
                     f"{', '.join(failing_checks(r['report'])) or '-'} | {r['bound']:.4g} | {r['trailing_bound']:.4g} | "
                     f"{r['sampling_s']} | {r['gate_s']} |" for r in results)
    left_out = (f"; {len(held['left_out'])} mask(s) of `masks` were the masks of search volumes and were left out "
                f"({', '.join(held['left_out'])})" if held["left_out"] else "")
    reference = (f"{t.state['reference_s']} s" if t.state.get("reference_s") is not None else "read from the cache")
    return f"""# Tuned sampler for `{cfg.checkpoint}`

{headline(record)}

| model calls | verdict | worst p | checks not passing | KL bound, searched grid | KL bound, trailing | sampling s | gate s |
| --- | --- | --- | --- | --- | --- | --- | --- |
{rows}

"Worst p": the smallest permutation p-value of the distribution checks (KID, MMD, histogram W1, diversity gap);
below {cfg.quality.alpha.fail} fails, below {cfg.quality.alpha.warn} warns. The KL bound (Align Your Steps) ranks
grids of one size; lower is better.

**Held out.** The gate's N = {n} volumes are {n_masks} masks x {n // n_masks} noise draws: masks
{', '.join(held['masks'])}, noise seed {held['noise_seed']}. The search estimated its bound on
{cfg.search.n} {describe_data(cfg.data)} with noise seed {held['search_noise_seed']}{left_out}: no mask or noise of
the gate was seen by the search.

**Reference.** The checkpoint's strict-FP32 DDPM over all {t.T} steps on the same masks and noise
({reference}). **Candidates**: each grid sampled with recipes {sorted(t.recipe) or '[] (strict FP32)'} on
{t.device.type}, torch {torch.__version__}, {t.size} voxels, batches of {cfg.gate.batch}.

Checkpoint sha256 `{t.sha256}` ({cfg.weights} weights). Search: {t.state['search']['seconds']} s.

![model calls against the worst distribution p-value](calls_vs_quality.png)
"""


def plot(results: list[dict[str, Any]], alpha: DictConfig, path: Path) -> Path:
    """Model calls against the worst distribution p-value, coloured by verdict, with the gate's limits."""
    fig = Figure(figsize=(5.5, 3.5))
    ax = fig.subplots()
    for verdict, colour in (("pass", "tab:green"), ("warn", "tab:orange"), ("fail", "tab:red")):
        points = [(r["calls"], float(r["worst_p"])) for r in results if r["verdict"] == verdict]
        if points:
            ax.scatter(*zip(*points), color=colour, label=verdict, zorder=3)
    ax.axhline(alpha.fail, color="tab:red", ls="--", lw=0.8, label=f"fail below {alpha.fail}")
    ax.axhline(alpha.warn, color="tab:orange", ls=":", lw=0.8, label=f"warn below {alpha.warn}")
    ax.set(xlabel="model calls per sample", ylabel="worst distribution p-value", yscale="log")
    ax.legend(fontsize=7)
    fig.subplots_adjust(left=0.16, bottom=0.15, right=0.97, top=0.95)
    return save_figure(fig, path, dpi=120)


SAMPLE_HINT = "python -m med_ddpm.sample experiment=fast_sample checkpoint={checkpoint} masks=MASKS tuned={tuned}"


def write_results(t: Tuning, results: list[dict[str, Any]], held_out: dict[str, Any]) -> dict[str, Any]:
    """``report.md`` and ``calls_vs_quality.png``, then ``sampler.yaml`` (last: a run that ends before it wrote
    no result)."""
    record = record_of(t, results, held_out)
    plot(results, t.cfg.quality.alpha, t.out_dir / "calls_vs_quality.png")
    atomic_write_text(t.out_dir / "report.md", report_page(t, results, record))
    header = ("# Written by med_ddpm.tune (report.md beside it). An edit fails the content_sha256 line: tune again.\n"
              f"# {SAMPLE_HINT.format(checkpoint=t.cfg.checkpoint, tuned=t.out_dir / RESULT)}\n")
    write_tuned(t.out_dir / RESULT, record, header)
    return record
