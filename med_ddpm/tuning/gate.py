"""The gate of one budget, held out from the search: the gate's masks (none of them a searched volume's), the
candidate and reference runs on the same per-sample noise, and the verdict of
:class:`med_ddpm.quality.gate.QualityGate` on the two."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from med_ddpm.config_checks import DataError
from med_ddpm.data.datasets import build_dataset, load_condition, read_volume
from med_ddpm.data.masks import list_masks
from med_ddpm.data.phantoms import SyntheticPhantoms
from med_ddpm.quality.gate import QualityGate, TrajectoryRun
from med_ddpm.quality.probe import batched_trajectory, cached, cond_hash, reference_key
from med_ddpm.samplers import DDPMSampler, make_timesteps, sampler_from_config
from med_ddpm.samplers.search import describe_data, kl_bound, optimal_grid
from med_ddpm.tuning.state import Tuning, grid_node
from optim import RecipeStack

log = logging.getLogger("med_ddpm.tune")
DISTRIBUTION = ("kid_vs_ref", "mmd_vs_ref", "histogram_w1_vs_ref", "diversity_gap")  # the checks that decide


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
