"""Running benchmark jobs into a results folder: a job's spec from its config, the list runner the ladder and the
quality-training verdict use, and the strict-FP32 baselines a run must hold.

A job is a list of Hydra overrides of ``configs/bench.yaml``, composed with Hydra's compose API into the spec that
the subprocess worker (:mod:`bench.core.worker`) measures; each row is appended to ``<out>/results.jsonl``
(:mod:`bench.core.records`).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra import compose
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from bench.core.records import (
    RESULTS_FILE,
    append_row,
    baseline_key,
    is_baseline,
    job_key,
    missing_baselines,
    new_run,
    provenance,
    read_rows,
    recipe_label,
)
from bench.core.wandb_runs import log_job
from bench.core.worker import base_row, cut_by_budget, run_job
from med_ddpm import cli
from med_ddpm.cli import CONFIG_DIR
from med_ddpm.config_checks import ConfigError

log = logging.getLogger(__name__)
RECIPE_DIR = CONFIG_DIR / "recipe"
Job = list[str]  # Hydra overrides of configs/bench.yaml


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


def log_row(row: dict[str, Any]) -> None:
    ms = row.get("ms_median")
    log.info("%s %s batch=%s -> %s %s", row["scenario"], recipe_label(row),
             row["batch_size"], row["status"], f"{ms:.3f} ms" if ms else row["message"].splitlines()[0])


def keep(out: Path, row: dict[str, Any]) -> dict[str, Any]:
    """Append ``row`` to ``out/results.jsonl``, log it, then make it a W&B run when its job's ``logger`` says so
    (after the row is written: a W&B failure never loses it); returns the row as written."""
    row = append_row(out / RESULTS_FILE, row)
    log_row(row)
    log_job(row, out)
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
            keep(sweep_dir, measured)


def recipe_override(stack: Sequence[str]) -> str:
    """The ``recipe=[a,b]`` override that selects ``stack``."""
    return f"recipe=[{','.join(stack)}]"


def experiment_stack(experiment: str, swap: Mapping[str, str] | None = None) -> list[str]:
    """``experiment``'s recipe stack (read from its config, the one source), each recipe named in ``swap`` replaced
    by its value: the stack as ``recipe=[...]`` plus every option the experiment sets on the recipes it keeps."""
    swap = swap or {}
    shipped = _recipes_of((f"experiment={experiment}",))
    names = tuple(swap.get(name, name) for name in shipped)
    plain = _recipes_of((recipe_override(names),))
    options = [f"recipe.{name}.{key}={value}" for name in shipped if name not in swap
               for key, value in shipped[name].items() if plain[name].get(key) != value]
    return [recipe_override(names), *options]


def experiment_train_settings(experiment: str) -> list[str]:
    """``experiment``'s training batch and accumulation as overrides (read from its config, the one source), so
    a strict-FP32 baseline times the same step as the experiment's stack."""
    with cli.configs():
        train = compose("bench", overrides=[f"experiment={experiment}", "bench=train_step", "output_dir=."]).train
    return [f"train.batch_size={train.batch_size}", f"train.grad_accum={train.grad_accum}"]


def picked(jobs: list[Job], only: str, preset: str) -> list[Job]:
    """The jobs the regex ``only`` finds in their overrides; a pattern that is no regex, or names no job, is refused
    (not a ladder that reports 0 jobs left)."""
    try:
        pattern = re.compile(str(only))
    except re.error as err:
        raise ConfigError(f"only={only}: not a regular expression ({err}); quote it on the command line: "
                          "\"only='...'\"") from err
    chosen = [job for job in jobs if pattern.search(" ".join(job))]
    if not chosen:
        raise ConfigError(f"only={only}: names none of preset={preset}'s {len(jobs)} jobs; pass a regex over their "
                          f"overrides (preset={preset} dry_run=true lists them)")
    return chosen


def _recipes_of(overrides: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """The recipe node ``overrides`` compose to (a copy): each preset job resolves stacks through it, and the configs
    do not change while a process runs, so each set of overrides is composed once per configs folder."""
    return copy.deepcopy(_composed_recipes(str(cli.CONFIG_DIR), overrides))


@functools.lru_cache(maxsize=256)
def _composed_recipes(config_dir: str, overrides: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    with cli.configs():
        recipe = compose("bench", overrides=[*overrides, "output_dir=."]).get("recipe")
    return OmegaConf.to_container(recipe, resolve=True) if recipe is not None else {}


def compose_job(overrides: Job, job_dir: Path) -> dict[str, Any]:
    """Compose one ladder entry into a worker job (the same config ``bench.sweep`` would build)."""
    with cli.configs():
        cfg = compose("bench", overrides=[*overrides, f"output_dir={job_dir}"], return_hydra_config=True)
    model = cfg.hydra.runtime.choices.model
    with open_dict(cfg):
        del cfg["hydra"]
    return job_spec(cfg, model)


def missing_recipes(overrides: Job) -> list[str]:
    """Recipe names of a job that have no ``configs/recipe/<name>.yaml`` (the job is skipped)."""
    stack = next((o for o in overrides if o.startswith("recipe=")), "recipe=[]")
    names = [n for n in stack.removeprefix("recipe=[").removesuffix("]").split(",") if n]
    return [n for n in names if not (CONFIG_DIR / "recipe" / f"{n}.yaml").exists()]


def finished_jobs(out: Path, refresh: str | None) -> tuple[set[str], set[str]]:
    """Job keys with a row in ``out``: any row, and rows measured by this commit, clean (``git_sha``, ``dirty``).

    ``refresh`` jobs count as done only with a row of this code, so after a code change
    ``refresh=REGEX`` re-measures the jobs it names (old rows stay, each labelled with its
    commit in the report) and a resumed run does not measure them twice.
    """
    rows = read_rows(out) if (out / RESULTS_FILE).exists() else []
    sha = provenance()["git_sha"]
    return ({job_key(r) for r in rows},
            {job_key(r) for r in rows if refresh and r.get("git_sha") == sha and not r.get("dirty")})


def run_ladder(out: Path, jobs: list[Job], budget_s: float, dry_run: bool = False, refresh: str | None = None,
               complete_baselines: bool = True, logger: dict[str, Any] | None = None) -> int:
    """Run the jobs not yet in ``out/results.jsonl`` until the budget is spent; return jobs left.

    A speed-up is only ever against the strict-FP32 row of the same run (one launch), so before the first job
    of a workload that this launch measures, the workload's baseline job is measured too, even when an earlier
    (cut) launch already has a row for it: a resumed ladder's rows get their own baseline. A strict-FP32 job is
    its workload's baseline itself, so two of one workload (two checkpoints gated against one reference) are each
    measured once.

    ``refresh``: a regex over a job's overrides; matching jobs rerun unless this code measured them.
    ``complete_baselines``: spend what is left of the budget on strict-FP32 baselines the results miss.
    ``logger``: every job's ``logger`` node (``wandb``: each row is a W&B run, :mod:`bench.core.wandb_runs`).
    """
    out.mkdir(parents=True, exist_ok=True)
    done, current = finished_jobs(out, refresh)
    start, left = time.monotonic(), 0
    specs = {n: compose_job(o, out / "jobs" / f"{n:03d}") for n, o in enumerate(jobs) if not missing_recipes(o)}
    if logger is not None:
        for spec in specs.values():
            spec["config"]["logger"] = logger
    baselines = {baseline_key(base_row(spec)): n for n, spec in specs.items() if is_baseline(base_row(spec))}
    measured: set[str] = set()  # workloads whose baseline this launch measured
    ran: set[int] = set()  # jobs this launch measured

    def measure(n: int) -> bool:
        """Run job ``n``; False when the budget ran out (no row)."""
        remaining = budget_s - (time.monotonic() - start)
        full = float(specs[n]["config"]["bench"]["timeout_s"])
        timeout = min(full, remaining)
        row = run_job(specs[n], out / "jobs" / f"{n:03d}", timeout)
        if cut_by_budget(row, timeout, full, budget_s):
            print(f"[cut] {' '.join(jobs[n])}: the time budget ran out; rerun to measure it")
            return False
        row = keep(out, row)
        ran.add(n)
        if is_baseline(row):
            measured.add(baseline_key(row))
        return True

    for n, overrides in enumerate(jobs):
        if n not in specs:
            print(f"[skip] {' '.join(overrides)}: no recipe config for {missing_recipes(overrides)}")
            continue
        key = baseline_key(base_row(specs[n]))
        stale_ok = not (refresh and re.search(refresh, " ".join(overrides)))
        if job_key(base_row(specs[n])) in (done if stale_ok else current) or n in ran:
            continue
        if dry_run or budget_s - (time.monotonic() - start) <= 0:
            left += 1
            print(f"[todo] {' '.join(overrides)}")
            continue
        needs_baseline = key in baselines and key not in measured and not is_baseline(base_row(specs[n]))
        if needs_baseline and not measure(baselines[key]):
            left += 1
            continue
        if not measure(n):
            left += 1
    if complete_baselines and not dry_run and budget_s - (time.monotonic() - start) > 0:
        EnsureBaseline.complete(out, budget_s - (time.monotonic() - start))
    print(f"ladder: {left} job(s) left{' (rerun the same command to continue)' if left else ''}")
    return left
