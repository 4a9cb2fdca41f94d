"""Hydra entry point of the benchmark: one job per override set, one row per job.

Example:
    python -m bench.sweep -m 'recipe=[],[tf32],[channels_last_3d],[amp_bf16]' bench=train_step
    python -m bench.sweep -m experiment=bench_smoke 'recipe=[],[amp_bf16]'        # CPU, tiny
    python -m bench.sweep -m experiment=bench_smoke 'recipe=[],[channels_last_3d]' logger=wandb  # + a W&B run each
    python -m bench.sweep -m hydra/sweeper=optuna_pareto bench=full_sample bench.quality=true

Every job is measured in a fresh subprocess (:mod:`bench.core.worker`), so jobs cannot leak global
state into each other and an OOM/NaN/crash becomes a row, and appended to
``<sweep_dir>/results.jsonl`` (:mod:`bench.core.records`). With ``logger=wandb`` each row, once written, is also
one W&B run (:mod:`bench.core.wandb_runs`), offline in the job's folder unless ``logger.mode=online``.

Each launch is one run: the :class:`EnsureBaseline` callback (wired in ``configs/bench.yaml``)
starts a new run id before the first job, so every row of the launch carries it, and a sweep
directory that already holds rows of earlier launches keeps them apart (the report shows the
latest row of each stack, against the baseline of its own run). The strict-FP32 baseline is
always in the run: after the last job, the callback runs a ``recipe=[]`` job for every
workload of this run that has no baseline row yet, using the workload's stored config.

The job function returns ``(ms_median, quality objective)`` so the Optuna sweeper
(``hydra/sweeper=optuna_pareto``) can search the speed/quality Pareto front; a failed job
returns ``(inf, inf)``.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from bench.core.runner import job_spec, keep
from bench.core.worker import run_job
from med_ddpm import cli
from med_ddpm.config_checks import check_device, check_int, check_model_size, check_number
from med_ddpm.samplers import check_sampler
from med_ddpm.tracking import check_logger
from med_ddpm.utils import resolve_device
from optim import RecipeStack

log = logging.getLogger(__name__)


def quality_objective(row: dict[str, Any], metric: str) -> float:
    """Lower-is-better quality number for the Pareto search (inf when unknown or failed)."""
    quality = row.get("quality") or {}
    value = (quality.get("metrics") or {}).get(metric)
    return float(value) if value is not None else math.inf


def record(job: dict[str, Any], sweep_dir: Path, job_dir: Path, timeout_s: float) -> dict[str, Any]:
    """Run one job in a subprocess and append its row to the sweep's results file (and, with ``logger=wandb``,
    make it a W&B run)."""
    return keep(sweep_dir, run_job(job, job_dir, timeout_s))


def sweep_dir_of(hydra_cfg: Any) -> Path:
    """The results directory: the sweep dir in multirun, the run dir for a single job."""
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return Path(hydra_cfg.sweep.dir)
    return Path(hydra_cfg.runtime.output_dir)


def check_options(cfg: DictConfig) -> None:
    """Refuse, before a worker starts, a job the worker would fail on or time wrongly."""
    check_int(cfg, "bench.batch_size", 1)
    check_int(cfg, "bench.iters", 1)
    check_int(cfg, "bench.warmup", 0)
    check_number(cfg, "bench.timeout_s", 0.0, low_open=True)
    if cfg.bench.get("threads") is not None:
        check_int(cfg, "bench.threads", 1)
    check_model_size(cfg)
    check_device(cfg)
    check_sampler(cfg.sampler, cfg.diffusion)
    check_logger(cfg.logger)
    stack = RecipeStack.from_config(cfg.get("recipe"))  # a pair that cannot be combined: one line, not an error row
    if inert := stack.inert(resolve_device(cfg.device)):
        log.warning("%s: inert on this device (it changes nothing here); the row gets no speed-up", ", ".join(inert))


@hydra.main(config_path=cli.CONFIG_PATH, config_name="bench", version_base="1.3")
@cli.entry
def main(cfg: DictConfig) -> tuple[float, float]:
    cli.output_dir(cfg)
    check_options(cfg)
    hc = HydraConfig.get()
    job = job_spec(cfg, hc.runtime.choices.get("model") or "model")
    row = record(job, sweep_dir_of(hc), Path(hc.runtime.output_dir), float(cfg.bench.timeout_s))
    if row["status"] != "ok":
        return math.inf, math.inf
    return float(row["ms_median"]), quality_objective(row, cfg.bench.objective)


console = cli.console(main)  # the med-ddpm-sweep command


if __name__ == "__main__":
    console()
