"""One W&B run per results row: the recipe toggles as config, the timings and the gate's verdict as summary.

A row is written to results.jsonl first (:func:`bench.core.runner.keep`); then, when its job's ``logger`` is
``wandb``, it becomes one W&B run, offline by default. A W&B failure costs the run, never the row: it is a one-line
warning and the sweep goes on. Each run logged is recorded in ``<results folder>/wandb_runs.jsonl``, so
``bench.report wandb=true`` publishes later the rows not logged when they were measured, and none twice.

The run (docs/wandb.md shows the panels built from it):

* ``name`` the job (``job_name``, else ``<workload>.b<batch>.<stack>``), ``group`` the launch's ``run_id`` (one
  sweep or ladder), ``job_type`` the workload (``train_step``, ``denoise_step``, ``full_sample``);
* config: ``workload``, ``model``, ``image_size``, ``batch_size``, ``grad_accum``, ``world_size``;
  ``recipe.<name>``: true or false for every recipe in configs/recipe/ (one boolean axis per recipe in a
  parallel-coordinates panel) and ``recipe_options.<name>.<key>`` each chosen recipe's options; ``stack``
  (``strict_fp32``, ``torch_defaults``, the evidence job's stack name, else the recipes joined by ``+``); ``sampler``
  and ``calls``; ``gpu``, ``driver``, ``cuda``, ``cudnn``, ``torch``, ``device``; ``commit`` and ``run_id``;
* summary: ``status`` and ``message`` (a failed job, OOM, NaN or cut, is a failed run), ``ms_median``, ``ms_p10``,
  ``ms_p90``, ``volumes_per_s``, ``peak_mem_gib``, ``compile_s``, ``speedup_vs_strict_fp32`` and
  ``speedup_vs_torch_defaults`` (against the row of that stack of the same workload and run, when the run has it),
  and the gate's ``verdict``, ``worst_p``, ``deciding_check``, ``min_detectable_eps_bias``
  (:func:`med_ddpm.tracking.gate_summary`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.core.records import RESULTS_FILE, baseline_key, code_label, read_rows, recipe_label
from med_ddpm.tracking import WandbTracker, gate_summary, logged, mark_logged, recipe_config

log = logging.getLogger(__name__)
TIMINGS = ("ms_median", "ms_p10", "ms_p90", "volumes_per_s", "peak_mem_gib", "compile_s")
ENV = ("gpu", "driver", "cuda", "cudnn", "torch", "device")
BASELINE_STACKS = ("strict_fp32", "torch_defaults")


def row_key(row: Mapping[str, Any]) -> str:
    """A row's identity in ``wandb_runs.jsonl``: the hash of its JSON line."""
    return hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()[:20]


def stack_name(row: Mapping[str, Any]) -> str:
    """``strict_fp32`` (no recipe), ``torch_defaults``, the stack an evidence job names (``forward.shipped``:
    ``shipped``), else the recipes joined by ``+``."""
    recipes = list(row.get("recipes") or [])
    if not recipes:
        return "strict_fp32"
    if recipes == ["torch_defaults"]:
        return "torch_defaults"
    name = row.get("job_name") or ""
    return name.rsplit(".", 1)[1] if "." in name else "+".join(recipes)


def job_name(row: Mapping[str, Any]) -> str:
    return row.get("job_name") or f"{row.get('scenario')}.b{row.get('batch_size')}.{stack_name(row)}"


def run_config(row: Mapping[str, Any]) -> dict[str, Any]:
    """The run's config: what the row measured (see the module's docstring for the keys)."""
    chosen = ((row.get("config") or {}).get("recipe")) or {}
    env = row.get("env") or {}
    return {"workload": row.get("scenario"), "model": row.get("model"), "image_size": row.get("image_size"),
            "batch_size": row.get("batch_size"), "grad_accum": row.get("grad_accum"),
            "world_size": row.get("world_size"),
            **recipe_config({name: chosen.get(name) for name in row.get("recipes") or []}),
            "recipe_label": recipe_label(row), "stack": stack_name(row),
            "sampler": row.get("sampler"), "calls": row.get("steps"),
            **{key: env.get(key) for key in ENV}, "commit": code_label(row), "run_id": row.get("run_id")}


def speedups(row: Mapping[str, Any], rows: list[dict[str, Any]]) -> dict[str, float]:
    """The row's speed-up against the latest ok row of each baseline stack of its workload and run."""
    if row.get("status") != "ok" or not row.get("ms_median") or not row.get("run_id"):
        return {}
    out = {}
    for stack in BASELINE_STACKS:
        bases = [r for r in rows if r.get("run_id") == row["run_id"] and baseline_key(r) == baseline_key(row)
                 and r.get("status") == "ok" and r.get("ms_median") and stack_name(r) == stack]
        if bases:
            out[f"speedup_vs_{stack}"] = bases[-1]["ms_median"] / row["ms_median"]
    return out


def run_summary(row: Mapping[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    message = (row.get("message") or "").strip().splitlines()
    return {"status": row.get("status"), "message": message[0][:500] if message else "",
            **{key: row.get(key) for key in TIMINGS}, **speedups(row, rows), **gate_summary(row.get("quality"))}


def publish(row: Mapping[str, Any], logger: Mapping[str, Any], rows: list[dict[str, Any]], folder: Path) -> str:
    """Log ``row`` as one W&B run (``rows``: its results file, for the speed-ups) and record it in ``folder``."""
    tracker = WandbTracker(logger, run_config(row), name=job_name(row), group=row.get("run_id"),
                           job_type=row.get("scenario"))
    tracker.summarize(run_summary(row, rows))
    tracker.finish(exit_code=0 if row.get("status") == "ok" else 1)
    mark_logged(folder, row_key(row), tracker.id)
    return tracker.id


@contextmanager
def warn_on_failure(what: str, kept: str) -> Iterator[None]:
    """Whatever W&B raises becomes one warning line naming ``what`` was not logged and where the rows are
    ``kept``: a tracker's failure never costs a row or stops a sweep."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - whatever W&B raises, the rows stay
        line = " ".join(str(err).split())[:300]
        log.warning("W&B: %s not logged (%s: %s); %s", what, type(err).__name__, line, kept)


def log_job(row: Mapping[str, Any], folder: Path) -> None:
    """Make a just-written row of ``folder`` a W&B run when its job's ``logger`` is ``wandb``."""
    logger = (row.get("config") or {}).get("logger") or {}
    if logger.get("name") != "wandb":
        return
    with warn_on_failure(job_name(row), f"its row is in {folder / RESULTS_FILE}"):
        publish(row, logger, read_rows(folder / RESULTS_FILE), folder)


def publish_unlogged(folder: Path, rows: list[dict[str, Any]], mode: str = "offline") -> list[str]:
    """Log every row of ``folder`` not logged yet (``bench.report wandb=true``), its W&B files in
    ``folder/wandb``; returns the W&B run ids."""
    done = logged(folder)
    logger = {"name": "wandb", "mode": mode, "dir": str(folder)}
    return [publish(row, logger, rows, folder) for row in rows if row_key(row) not in done]


def log_unlogged(folder: Path, mode: str) -> None:
    """After a command preset (``bench.ladder preset=evidence logger=wandb``, whose jobs are processes of their own):
    each row of ``folder`` not logged yet becomes its run."""
    with warn_on_failure(f"rows of {folder / RESULTS_FILE}", f"bench.report dir={folder} wandb=true logs them later"):
        ids = publish_unlogged(folder, read_rows(folder / RESULTS_FILE), mode)
        log.info("W&B: %d row(s) of %s logged as runs (%s)", len(ids), folder / RESULTS_FILE, mode)
