"""The results.jsonl row: its schema, its identity keys, and crash-safe append/read.

One row per benchmark job, appended as a single JSON line with flush + fsync, so a sweep
killed mid-way (OOM killer, the 10-minute device limit) keeps every finished row and can
resume by skipping rows already present (:func:`job_key`).

Row schema (``None`` where a field does not apply or the job failed):

=================  =====================================================================
scenario           ``train_step`` | ``denoise_step`` | ``full_sample``
model              model config name (``medddpm_whole_head``, ``tiny``, ...)
image_size         [D, H, W]
batch_size         volumes per call
sampler, steps     sampler name and reverse steps (full_sample; null otherwise)
recipes            recipe names in selection order; ``[]`` is the strict-FP32 baseline
status             ``ok`` | ``oom`` | ``nan`` | ``unsupported`` | ``error``
message            why a job failed (empty when ok)
ms_median/p10/p90  per-call wall time (ms) over ``iters`` timed calls after ``warmup``
iqr_pct, ms_mean, ms_std, iters, warmup
first_call_s       wall seconds of the first call (lazy init, autotune, compilation)
compile_s          = first_call_s when the stack compiles (else null)
peak_mem_gib       ``torch.cuda.max_memory_allocated`` over the job (null on CPU)
volumes_per_s, voxels_per_s
flops              model FLOPs per call (``torch.utils.flop_counter`` on the meta device)
tflops             flops / median time
precision          ``fp32`` | ``tf32`` | ``bf16`` | ``fp16``, read from the live switches
peak_fraction      tflops / datasheet dense peak for that precision
quality            the quality gate's report (null unless ``bench.quality``)
describe           the recipe stack's ``describe()``
env                ``med_ddpm.utils.env_info()``: GPU, CC, driver, CUDA, cuDNN, torch, monai, git sha, host
config             the resolved job config (reruns and the auto-added baseline use it)
wall_s             seconds the job's subprocess took, end to end
=================  =====================================================================
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from med_ddpm.utils import append_line

STATUSES = ("ok", "oom", "nan", "unsupported", "error")
RESULTS_FILE = "results.jsonl"
IDENTITY_FIELDS = ("scenario", "model", "image_size", "batch_size", "sampler", "steps")
# Filled by a successful measurement; present as null in every other row, so all rows share keys.
MEASURED_FIELDS = ("ms_median", "ms_p10", "ms_p90", "iqr_pct", "ms_mean", "ms_std", "iters", "warmup",
                   "first_call_s", "compile_s", "peak_mem_gib", "volumes_per_s", "voxels_per_s", "flops",
                   "tflops", "precision", "peak_fraction", "describe")


def baseline_key(row: dict[str, Any]) -> str:
    """The workload a row measures, without its recipes: rows sharing it are comparable."""
    return json.dumps([row.get(k) for k in IDENTITY_FIELDS])


def job_key(row: dict[str, Any]) -> str:
    """Workload plus recipe stack and its non-default options: one job of a sweep (resumable runs
    skip known keys). Rows without options keep the key they had before options were recorded."""
    options = list(row.get("recipe_options") or [])
    return json.dumps([baseline_key(row), list(row.get("recipes") or []), *([options] if options else [])])


def recipe_label(row: dict[str, Any], baseline: str = "[] (fp32)") -> str:
    """How tables name a row's stack: ``amp_bf16+compile``, options in brackets, ``baseline`` for none."""
    label = "+".join(row.get("recipes") or []) or baseline
    options = row.get("recipe_options") or []
    return f"{label} [{', '.join(options)}]" if options else label


def is_baseline(row: dict[str, Any]) -> bool:
    """True for the strict-FP32 reference row (no recipe)."""
    return not row.get("recipes")


def append_row(path: str | Path, row: dict[str, Any]) -> None:
    """Append ``row`` as one JSON line (flush + fsync)."""
    if row.get("status") not in STATUSES:
        raise ValueError(f"results row has status {row.get('status')!r}; expected one of {STATUSES}")
    append_line(path, json.dumps(row, sort_keys=True, default=str))


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a results.jsonl; a torn last line (killed writer) is skipped with a warning."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no results file (did the sweep run? expected {RESULTS_FILE})")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            warnings.warn(f"{path}:{n}: skipping unreadable row ({err})", RuntimeWarning, stacklevel=2)
    return rows


def missing_baselines(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One representative row for every workload that has no strict-FP32 row yet."""
    have = {baseline_key(r) for r in rows if is_baseline(r)}
    need: dict[str, dict[str, Any]] = {}
    for row in rows:
        key = baseline_key(row)
        if key not in have and key not in need and row.get("config") is not None:
            need[key] = row
    return list(need.values())
