"""One benchmark job in its own process: isolation, and failure recorded as data.

Hydra's basic launcher runs every multirun job in one process, so TF32 flags, cuDNN
autotune caches, compiled graphs and a fragmented CUDA allocator would leak from one job to
the next and make results depend on job order. Each job therefore runs here, in a fresh
interpreter (``python -m bench.core.worker JOB.json ROW.json``); a CUDA OOM, a NaN, a refused recipe,
a Python error or even a segfault ends that job with a row saying so, and the sweep goes on.

A list of jobs of one model and recipe stack runs in one process instead (one start-up, one model, one
compilation: the ladder's ``process``), each with its own inputs, warm-up, timing and row.

The worker writes a placeholder row (status ``error``, with the environment) before it
starts measuring, so a hard crash still leaves a row that :func:`run_job` completes with the
exit code and the stderr tail.

Example:
    >>> row = run_job({"config": cfg_dict, "model": "tiny", "recipes": []}, Path("job0"), timeout_s=600)
    >>> row["status"], row["ms_median"]
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from bench.core.records import MEASURED_FIELDS, provenance
from bench.core.scenarios import (
    NonFiniteOutput,
    Parts,
    Step,
    UnsupportedStack,
    batch_size,
    prepared_parts,
    sampler_calls,
    time_workload,
)
from bench.core.subprocesses import STDERR_TAIL
from bench.core.timing import flush
from med_ddpm.cli import CONFIG_DIR
from med_ddpm.quality.probe import gate_from_config
from med_ddpm.samplers import sampler_options
from med_ddpm.utils import atomic_write_text, env_info, resolve_device

FAULTS = ("oom", "nan", "error", "segfault")  # bench.inject: test-only fault injection
OOM_PATTERN = re.compile(r"out of memory|CUDNN_STATUS_ALLOC_FAILED|CUBLAS_STATUS_ALLOC_FAILED", re.I)
PLACEHOLDER = "worker exited before finishing"
TIMEOUT_PREFIX = "worker timed out"


def quality_report(cfg: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """The speed-vs-quality gate of the job's stack + sampler (``med_ddpm.quality.probe.gate_from_config``)
    on ``bench.checkpoint`` or seeded random weights, with ``bench.batch_size`` (at least 2) samples."""
    n = max(2, int(cfg["bench"]["batch_size"]))
    return gate_from_config(cfg, device, checkpoint=cfg["bench"].get("checkpoint"), n_samples=n).to_dict()


def inject_fault(step: Step, kind: str) -> Step:
    """Wrap ``step`` so that it fails like ``kind`` would (tests prove the sweep survives it)."""
    if kind not in FAULTS:
        raise ValueError(f"bench.inject must be null or one of {FAULTS}, got {kind!r}")

    def faulty() -> torch.Tensor:
        if kind == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory (injected by bench.inject=oom)")
        if kind == "error":
            raise RuntimeError("injected failure (bench.inject=error)")
        if kind == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        return torch.full_like(step(), float("nan"))

    return faulty


def classify(err: BaseException) -> tuple[str, str]:
    """Exception -> (status, message) of a results row."""
    message = f"{type(err).__name__}: {err}".strip()[:STDERR_TAIL]
    if isinstance(err, UnsupportedStack):
        return "unsupported", message
    if isinstance(err, torch.OutOfMemoryError) or OOM_PATTERN.search(str(err)):
        return "oom", message
    if isinstance(err, NonFiniteOutput):
        return "nan", message
    return "error", message + "\n" + "".join(traceback.format_tb(err.__traceback__)[-3:])


def sampler_label(node: Mapping[str, Any]) -> str:
    """The sampler's name, plus the options that differ from its config group's defaults:
    ``ddim`` for ``configs/sampler/ddim.yaml`` as is, ``ddim(eta=1.0)`` for ``sampler.eta=1.0``,
    so rows of one sampler with different options are different workloads (and job keys)."""
    path = Path(CONFIG_DIR) / "sampler" / f"{node['name']}.yaml"
    defaults = OmegaConf.to_container(OmegaConf.load(path)) if path.exists() else {}
    changed = [f"{k}={v}" for k, v in sampler_options(node).items() if defaults.get(k, v) != v]
    return f"{node['name']}({','.join(changed)})" if changed else str(node["name"])


def base_row(job: Mapping[str, Any]) -> dict[str, Any]:
    """Identity fields of a job's row, known before anything runs."""
    cfg = job["config"]
    sampling = cfg["bench"]["scenario"] == "full_sample"
    training = cfg["bench"]["scenario"] == "train_step"
    return {
        "scenario": cfg["bench"]["scenario"],
        "model": job["model"],
        "image_size": list(cfg["model"]["image_size"]),
        "batch_size": batch_size(cfg),
        "grad_accum": int(cfg["train"]["grad_accum"]) if training else None,
        "sampler": sampler_label(cfg["sampler"]) if sampling else None,
        "steps": sampler_calls(cfg) if sampling else None,
        "recipes": list(job["recipes"]),
        "recipe_options": list(job.get("recipe_options") or []),
        **dict.fromkeys(MEASURED_FIELDS),
        "status": "error",
        "message": PLACEHOLDER,
        "quality": None,
        "env": None,
        "config": cfg,
    }


def measure(jobs: list[Mapping[str, Any]], row_path: Path) -> list[dict[str, Any]]:
    """Run ``jobs`` in this process and write their rows as they finish (placeholders first).

    Several jobs share one model, recipe stack and compilation (``bench.ladder``'s processes: one start-up and one
    warm-up for the rows of a stack); each has its own inputs, warm-up and timed calls, and its own peak memory. A
    failure of one is its row; one of the shared preparation (a refused stack) is every row's."""
    cfg = jobs[0]["config"]
    device = resolve_device(cfg["device"])
    if cfg["bench"].get("threads"):
        torch.set_num_threads(int(cfg["bench"]["threads"]))
    rows = [{**base_row(job), "env": env_info(device)} for job in jobs]
    atomic_write_text(row_path, json.dumps(rows, default=str))
    try:
        with prepared_parts(cfg, device, ema=any(_trains(job) for job in jobs)) as parts:
            for n, job in enumerate(jobs):
                if n:
                    flush(device)
                rows[n].update(_timed(job, parts.for_workload(job["config"], device) if n else parts, device))
                atomic_write_text(row_path, json.dumps(rows, default=str))
    except Exception as err:  # failure is data: the preparation's exception ends every row not yet measured
        status, message = classify(err)
        for row in rows:
            if row["message"] == PLACEHOLDER:
                row.update(status=status, message=message)
    atomic_write_text(row_path, json.dumps(rows, default=str))
    return rows


def _trains(job: Mapping[str, Any]) -> bool:
    return job["config"]["bench"]["scenario"] == "train_step" and bool(job["config"]["bench"]["ema"])


def _timed(job: Mapping[str, Any], parts: Parts, device: torch.device) -> dict[str, Any]:
    """One job's measurement on prepared parts, its failure as status and message, its warnings and its gate."""
    cfg = job["config"]
    inject = cfg["bench"].get("inject")
    wrap = (lambda step: inject_fault(step, str(inject))) if inject else None  # YAML reads nan as a float
    fields: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        try:
            fields.update(time_workload(parts, cfg, device, wrap_step=wrap), status="ok", message="")
        except Exception as err:  # failure is data: every exception becomes a row
            fields["status"], fields["message"] = classify(err)
    fields["warnings"] = sorted({str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)})
    if fields["status"] == "ok" and cfg["bench"].get("quality"):
        try:
            fields["quality"] = quality_report(cfg, device)
        except Exception as err:  # the timing stands; the gate's failure is reported in its place
            fields["quality"] = {"verdict": "error", "reasons": [classify(err)[1]]}
    return fields


def _text(stream: bytes | str | None) -> str:
    return stream.decode(errors="replace") if isinstance(stream, bytes) else (stream or "")


def _exit_reason(returncode: int) -> str:
    if returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def cut_by_budget(row: Mapping[str, Any], timeout_s: float, own_limit_s: float, budget_s: float) -> bool:
    """Whether ``row`` timed out because a run's time budget shortened its limit (``timeout_s``), not
    at the job's own ``bench.timeout_s``: such a row is no measurement (rerunning measures it), unless
    the job had (nearly) the whole budget to itself, in which case it would never fit and is recorded."""
    return row["message"].startswith(TIMEOUT_PREFIX) and timeout_s < min(own_limit_s, 0.9 * budget_s)


def run_job(job: Mapping[str, Any] | list[Mapping[str, Any]], job_dir: Path, timeout_s: float,
            env: Mapping[str, str] | None = None) -> Any:
    """Run ``job`` in a fresh ``python -m bench.core.worker`` and return its row, whatever happened; a list of jobs
    (one model and stack) runs in one process and returns their rows.

    Args:
        job: ``{"config": resolved config dict, "model": name, "recipes": [names]}``, or a list of them.
        job_dir: gets job.json, row.json and worker.log.
        timeout_s: wall limit; a job past it is killed and recorded as ``error``.
        env: environment variables the worker gets on top of this process's.
    """
    jobs = job if isinstance(job, list) else [job]
    job_dir.mkdir(parents=True, exist_ok=True)
    job_path, row_path, log_path = job_dir / "job.json", job_dir / "row.json", job_dir / "worker.log"
    atomic_write_text(job_path, json.dumps(jobs, default=str))
    row_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.core.worker", str(job_path), str(row_path)]
    code = provenance()  # the commit that is measured: read before the job, not when its row is appended
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **(env or {})})
        returncode, stderr = proc.returncode, proc.stderr
        log_path.write_text(proc.stdout + proc.stderr, encoding="utf-8")
    except subprocess.TimeoutExpired as err:
        returncode, stderr = None, _text(err.stderr)
    rows = json.loads(row_path.read_text()) if row_path.exists() else [base_row(j) for j in jobs]
    why = f"{TIMEOUT_PREFIX} after {timeout_s:.0f} s" if returncode is None else f"worker {_exit_reason(returncode)}"
    wall_s = time.perf_counter() - start  # the process's, for each of its rows
    for row in rows:
        if row["message"] == PLACEHOLDER:
            row["message"] = f"{why}; stderr tail:\n{stderr[-STDERR_TAIL:]}"
        row["wall_s"] = wall_s
    rows = [{**row, **code} for row in rows]
    return rows if isinstance(job, list) else rows[0]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m bench.core.worker JOB.json ROW.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    for row in measure(job if isinstance(job, list) else [job], Path(argv[1])):
        print(json.dumps({k: row.get(k) for k in ("scenario", "recipes", "status", "ms_median", "message")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
