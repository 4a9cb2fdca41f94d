"""DDP scaling of the real training step: ``torchrun --nproc_per_node=N -m bench.ddp [overrides]``.

Every rank times :func:`med_ddpm.train.train_step` (forward, loss, ``no_sync`` micro-steps,
backward with DDP's gradient all-reduce, Adam, the all-reduced loss, rank 0's EMA update) on one batch held in
memory, so the input pipeline is not measured. Rank 0 appends one ``results.jsonl`` row
(:mod:`bench.core.records` schema, ``scenario="ddp_train_step"``) with:

* ``ms_median`` of the slowest rank (the ranks wait for each other in the all-reduce),
  ``ms_median_per_rank``;
* ``volumes_per_s`` = world·batch·grad_accum / step time (all GPUs), ``volumes_per_s_per_gpu``;
* ``scaling_efficiency`` = volumes_per_s / (world · 1-process volumes/s). The 1-process figure
  is ``ddp.baseline`` (volumes/s) or, by default, the latest ``world_size=1`` row of the same
  workload in the results file: run ``--nproc_per_node=1`` first. That is another launch, so the row's
  ``baseline_source`` names its run id and commit. A world of one is its own baseline (DDP of one process:
  the wrapper's overhead is in it).

Example (one node; ``configs/ddp.yaml`` is the training config plus ``ddp.*``, so the overrides are the
training ones):
    torchrun --nproc_per_node=1 -m bench.ddp ddp.out=results/ddp model=medddpm_whole_head
    torchrun --nproc_per_node=8 -m bench.ddp ddp.out=results/ddp model=medddpm_whole_head
    python -m bench.report dir=results/ddp
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from torch.utils.data import default_collate

from bench.core import worker
from bench.core.records import RESULTS_FILE, RUN_ID_ENV, append_row, job_key, read_rows, run_id
from bench.core.runner import job_spec
from bench.core.timing import active_precision, flush, peak_memory_gib, time_fn, time_once
from med_ddpm import cli, distributed
from med_ddpm.train import build, check_options, train_step
from med_ddpm.train_state import Job
from med_ddpm.utils import env_info

SCENARIO = "ddp_train_step"


def memory_batches(job: Job):
    """The first ``batch_size`` training volumes, collated once and repeated (no input pipeline timed)."""
    b = job.cfg.train.batch_size
    return itertools.repeat(default_collate([job.dataset[i % len(job.dataset)] for i in range(b)]))


def time_ranks(job: Job, warmup: int, iters: int) -> dict[str, Any]:
    """Time the training step on this rank inside the recipe session; return this rank's numbers."""
    flush(job.device)  # peak memory of the step, not of build()
    with job.stack.session():
        job.model = distributed.wrap_ddp(job.stack.prepare_model(job.net), job.device)
        batches = memory_batches(job)
        step = functools.partial(train_step, job, batches)
        first_call_s = time_once(step, job.device)
        timings = time_fn(step, warmup=warmup, iters=iters, device=job.device)
        with job.stack.forward_context():
            precision = active_precision(job.device.type)
        describe = job.stack.describe()
    return {"timings": timings, "first_call_s": first_call_s, "precision": precision, "describe": describe,
            "peak_mem_gib": peak_memory_gib(job.device)}


def baseline_volumes_per_s(path: Path, row: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """Per-GPU volumes/s of the latest ok 1-process row of the same workload in ``path``, and where it comes from.

    A world of N and a world of one are two torchrun launches, so this baseline is always from another run: the
    row records that run's id and commit (``baseline_source``) and the report labels the efficiency with it."""
    if not path.exists():
        return None, None
    one = job_key({**row, "world_size": 1})  # the same workload in a world of one
    same = [r for r in read_rows(path) if r.get("status") == "ok" and job_key(r) == one]
    if not same:
        return None, None
    return same[-1]["volumes_per_s"], {"run_id": same[-1].get("run_id"), "git_sha": same[-1].get("git_sha")}


def base_row(cfg: DictConfig, model_name: str | None, world: int) -> dict[str, Any]:
    """:func:`bench.core.worker.base_row` of the training step this run times, as scenario ``ddp_train_step``."""
    job = job_spec(cfg, model_name)
    step = {**job, "config": {**job["config"], "bench": {"scenario": "train_step"}}}
    return worker.base_row(step) | {"scenario": SCENARIO, "world_size": world, "message": "", "config": job["config"]}


def measurements(cfg, ranks: list[dict[str, Any]], world: int, baseline: float | None, iters: int,
                 warmup: int) -> dict[str, Any]:
    """Row fields from every rank's timings: the slowest rank sets the step time."""
    slowest = max(ranks, key=lambda r: r["timings"].median)
    t = slowest["timings"]
    per_gpu = cfg.train.batch_size * cfg.train.grad_accum / (t.median / 1e3)
    total = per_gpu * world
    if baseline is None and world == 1:
        baseline = per_gpu
    voxels = math.prod(int(s) for s in cfg.model.image_size)
    return {
        "ms_median": t.median, "ms_p10": t.p10, "ms_p90": t.p90, "iqr_pct": t.iqr_pct, "ms_mean": t.mean,
        "ms_std": t.std, "iters": iters, "warmup": warmup, "first_call_s": max(r["first_call_s"] for r in ranks),
        "compile_s": None, "peak_mem_gib": max((r["peak_mem_gib"] or 0.0) for r in ranks) or None,
        "volumes_per_s": total, "voxels_per_s": total * voxels, "precision": slowest["precision"],
        "describe": slowest["describe"], "volumes_per_s_per_gpu": per_gpu,
        "ms_median_per_rank": [r["timings"].median for r in ranks],
        "baseline_volumes_per_s": baseline,
        "scaling_efficiency": total / (world * baseline) if baseline else None,
    }


def measure(cfg: DictConfig, model_name: str | None) -> dict[str, Any] | None:
    """Run on every rank; rank 0 writes and returns the row."""
    opts = cfg.ddp
    out = Path(opts.out)
    job = build(cfg)  # joins torchrun's process group
    os.environ[RUN_ID_ENV] = distributed.broadcast_object(run_id())  # one launch: one run id on every rank
    world, results = distributed.world_size(), out / RESULTS_FILE
    row = base_row(cfg, model_name, world) | {"env": env_info(job.device)}
    start = time.perf_counter()
    try:
        mine = time_ranks(job, opts.warmup, opts.iters)
    except Exception as err:  # the failing rank records why (under the launch's run id); torchrun stops the others
        row["status"], row["message"] = worker.classify(err)
        append_row(results, row | {"message": f"rank {distributed.rank()}: {row['message']}"})
        raise
    ranks = distributed.all_gather_object(mine)
    if distributed.is_main():
        if opts.baseline is not None:
            baseline, source = opts.baseline, "ddp.baseline"
        elif world == 1:
            baseline, source = None, "this run"
        else:
            baseline, source = baseline_volumes_per_s(results, row)
        row.update(measurements(cfg, ranks, world, baseline, opts.iters, opts.warmup), status="ok",
                   wall_s=time.perf_counter() - start, baseline_source=source)
        append_row(results, row)
        eff = row["scaling_efficiency"]
        print(f"{SCENARIO} world={world}: {row['ms_median']:.1f} ms/step, {row['volumes_per_s_per_gpu']:.2f} "
              f"vol/s/GPU, {row['volumes_per_s']:.2f} vol/s total, scaling efficiency "
              f"{'n/a (no 1-process baseline)' if eff is None else f'{eff:.1%}'} -> {results}")
    distributed.cleanup()
    return row if distributed.rank() == 0 else None


@hydra.main(config_path=cli.CONFIG_PATH, config_name="ddp", version_base="1.3")
@cli.entry
def main(cfg: DictConfig) -> None:
    check_options(cfg)  # the training command's checks: a bad option is one line, not a traceback per rank
    measure(cfg, HydraConfig.get().runtime.choices.get("model"))


if __name__ == "__main__":
    cli.run(main)
