"""Gates without timings: ``bench.ladder preset=quality_128`` judges the timed 128³ network's stacks and samplers on
its trained weights, one row per gate, each gate run in this process.

Example (on the machine that trained ``experiment=quality_model_128``; docs/quality.md, "The gate at 128³"):
    python -m bench.ladder preset=quality_128 checkpoint=runs/quality_model_128/checkpoints/last.pt \\
        out=bench/results/h100/quality/gates_128 budget_s=480

The times stand in the evidence run (``preset=evidence``); a gate's row here carries the identity of the timed
workload it judges (scenario, sampler, calls, recipes and options: :func:`bench.core.worker.base_row`), so
:mod:`bench.reporting.verdicts` puts its verdict beside that time. A 128³ strict-FP32 reference takes longer than one
10-minute device call (32 x 50.2 s for DDPM-250 on an H100), so each of its batches is cached as it finishes
(:func:`med_ddpm.quality.probe.batched_trajectory`): a call cut by the device's limit leaves the finished batches,
and the same command goes on from there. ``budget_s`` stops *starting* gates; a gate with an ``ok`` row is never run
again, one that failed (an error row) is.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from bench.core import presets
from bench.core.records import RESULTS_FILE, append_row, read_rows
from bench.core.runner import compose_job, picked
from bench.core.worker import base_row, classify
from med_ddpm.config_checks import ConfigError
from med_ddpm.quality.probe import gate_from_config
from med_ddpm.utils import env_info, resolve_device


def gated(out: Path) -> set[str]:
    """The job names with an ``ok`` gate row in ``out``: done."""
    path = out / RESULTS_FILE
    return {r["job_name"] for r in read_rows(path) if r.get("status") == "ok"} if path.exists() else set()


def gate_row(spec: dict[str, Any], name: str, device) -> dict[str, Any]:
    """One gate's row: the timed workload's identity, the gate's report and its seconds; a failure is its status
    and message (a refused option stays a one-line error)."""
    cfg, start = spec["config"], time.perf_counter()
    row = {**base_row(spec), "job_name": name, "env": env_info(device)}
    try:
        report = gate_from_config(cfg, device, checkpoint=cfg["bench"]["checkpoint"])
    except ConfigError:
        raise
    except Exception as err:  # failure is data: the row says what happened, and a rerun runs the gate again
        status, message = classify(err)
        return {**row, "status": status, "message": message}
    return {**row, "status": "ok", "message": "", "quality": report.to_dict(),
            "gate_s": round(time.perf_counter() - start, 1)}


def run(cfg: DictConfig) -> int:
    """Run the preset's gates not yet in ``out`` until ``budget_s`` is spent; return the gates left."""
    jobs = presets.jobs(cfg.preset, cfg)
    if cfg.only:
        chosen = {tuple(o) for o in picked([j.overrides for j in jobs], cfg.only, cfg.preset)}
        jobs = [j for j in jobs if tuple(j.overrides) in chosen]
    out, start, left = Path(cfg.out), time.monotonic(), 0
    done = gated(out)
    device = None if cfg.dry_run else resolve_device("auto")
    for job in jobs:
        if job.name in done:
            continue
        spent = time.monotonic() - start
        if cfg.dry_run or (cfg.budget_s is not None and spent >= float(cfg.budget_s)):
            left += 1
            print(f"[todo] {job.name}: {' '.join(job.overrides)}")
            continue
        row = gate_row(compose_job(job.overrides, out / "jobs" / job.name), job.name, device)
        append_row(out / RESULTS_FILE, row)
        verdict = (row.get("quality") or {}).get("verdict", row["status"])
        print(f"[{verdict}] {job.name} ({row.get('gate_s', '-')} s)", flush=True)
        left += row["status"] != "ok"
    print(f"{left} gate(s) left: rerun the same command" if left else f"every gate of preset={cfg.preset} has a row")
    return left
