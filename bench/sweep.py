"""Hydra entry point of the benchmark: one job per override set, one row per job.

Example:
    python -m bench.sweep -m 'recipe=[],[tf32],[channels_last_3d],[amp_bf16]' bench=train_step
    python -m bench.sweep -m experiment=bench_smoke 'recipe=[],[amp_bf16]'        # CPU, tiny
    python -m bench.sweep -m hydra/sweeper=optuna_pareto bench=full_sample bench.quality=true

Every job is measured in a fresh subprocess (:mod:`bench.worker`), so jobs cannot leak global
state into each other and an OOM/NaN/crash becomes a row, and appended to
``<sweep_dir>/results.jsonl`` (:mod:`bench.records`).

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

import copy
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from bench.records import RESULTS_FILE, append_row, missing_baselines, new_run, read_rows, recipe_label
from bench.worker import cut_by_budget, run_job
from med_ddpm import cli
from med_ddpm.errors import check_device, check_int, check_model_size, check_number, check_sampler
from med_ddpm.utils import resolve_device
from optim import RecipeStack

log = logging.getLogger(__name__)
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
RECIPE_DIR = CONFIG_DIR / "recipe"


def recipe_options(recipes: dict[str, Any]) -> list[str]:
    """The options a job sets away from each recipe's config-group default, as ``name.key=value``.

    Two jobs with the same recipes and other options (``recipe.cudnn_benchmark.limit=0``) are
    two jobs: the options enter the row's key and its label.
    """
    options = []
    for name, node in recipes.items():
        path = RECIPE_DIR / f"{name}.yaml"
        defaults = OmegaConf.to_container(OmegaConf.load(path))[name] if path.exists() else {}
        options += [f"{name}.{key}={json.dumps(value)}" for key, value in node.items()
                    if key != "_target_" and value != defaults.get(key)]
    return options


def job_spec(cfg: DictConfig, model_name: str) -> dict[str, Any]:
    """The resolved, JSON-able job a worker runs (config + the names the row reports)."""
    config = OmegaConf.to_container(cfg, resolve=True)
    recipes = config.get("recipe") or {}
    return {"config": config, "model": model_name, "recipes": list(recipes),
            "recipe_options": recipe_options(recipes)}


def baseline_job(row: dict[str, Any]) -> dict[str, Any]:
    """The strict-FP32 twin of a row's job: same workload, no recipe, no injected fault."""
    config = copy.deepcopy(row["config"])
    config["recipe"] = {}
    config["bench"]["inject"] = None
    return {"config": config, "model": row["model"], "recipes": [], "recipe_options": []}


def quality_objective(row: dict[str, Any], metric: str) -> float:
    """Lower-is-better quality number for the Pareto search (inf when unknown or failed)."""
    quality = row.get("quality") or {}
    value = (quality.get("metrics") or {}).get(metric)
    return float(value) if value is not None else math.inf


def log_row(row: dict[str, Any]) -> None:
    ms = row.get("ms_median")
    log.info("%s %s batch=%s -> %s %s", row["scenario"], recipe_label(row),
             row["batch_size"], row["status"], f"{ms:.3f} ms" if ms else row["message"].splitlines()[0])


def record(job: dict[str, Any], sweep_dir: Path, job_dir: Path, timeout_s: float) -> dict[str, Any]:
    """Run one job in a subprocess and append its row to the sweep's results file."""
    row = run_job(job, job_dir, timeout_s)
    append_row(sweep_dir / RESULTS_FILE, row)
    log_row(row)
    return row


class EnsureBaseline(Callback):
    """A new run id per launch; after it, measure the strict-FP32 baseline of every workload of the
    run that lacks one."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        new_run()

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        new_run()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self.complete(Path(config.hydra.sweep.dir))

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        self.complete(Path(config.hydra.runtime.output_dir))

    @staticmethod
    def complete(sweep_dir: Path, budget_s: float = math.inf) -> None:
        """Run the missing ``recipe=[]`` jobs of ``sweep_dir`` (also used by the ladder), starting
        none once ``budget_s`` seconds have passed and cutting each at what is left of it."""
        if not (sweep_dir / RESULTS_FILE).exists():
            return
        deadline = time.monotonic() + budget_s
        for n, row in enumerate(missing_baselines(read_rows(sweep_dir))):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.info("time budget spent: strict-FP32 baseline of %s batch=%s not measured",
                         row["scenario"], row["batch_size"])
                continue
            log.info("sweep had no recipe=[] job for %s batch=%s: adding the strict-FP32 baseline",
                     row["scenario"], row["batch_size"])
            full = float(row["config"]["bench"]["timeout_s"])
            timeout = min(full, remaining)
            measured = run_job(baseline_job(row), sweep_dir / f"baseline_{n}", timeout)
            # budget_s is only what the ladder left over: any shortened limit is a cut (a rerun retries it)
            if cut_by_budget(measured, timeout, full, math.inf):
                log.info("time budget ran out during the strict-FP32 baseline of %s batch=%s: no row, "
                         "rerun to measure it", row["scenario"], row["batch_size"])
                continue
            append_row(sweep_dir / RESULTS_FILE, measured)
            log_row(measured)


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
    stack = RecipeStack.from_config(cfg.get("recipe"))  # a pair that cannot be combined: one line, not an error row
    if inert := stack.inert(resolve_device(cfg.device)):
        log.warning("%s: inert on this device (it changes nothing here); the row gets no speed-up", ", ".join(inert))


@hydra.main(config_path="../configs", config_name="bench", version_base="1.3")
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


if __name__ == "__main__":
    cli.run(main)
