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
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from med_ddpm.quality.gate import TrajectoryRun
from med_ddpm.quality.probe import reference_file
from med_ddpm.samplers.search import describe_data, interval_costs, log_snr_weights, stack_distances
from med_ddpm.tuning.gate import ddpm_reference_key, gate_budget, gate_masks, reference_run, search_view
from med_ddpm.tuning.report import write_results
from med_ddpm.tuning.state import DISTANCES, Tuning, prepare
from med_ddpm.utils import atomic_write, json_safe
from optim import RecipeStack

log = logging.getLogger("med_ddpm.tune")


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
