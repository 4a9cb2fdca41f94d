"""The results.jsonl row: its schema, its identity keys, its provenance, and crash-safe append/read.

One row per benchmark job, appended as a single JSON line with flush + fsync, so a sweep
killed mid-way (OOM killer, the 10-minute device limit) keeps every finished row and can
resume by skipping rows already present (:func:`job_key`). A line holds its row whole or as
what differs from an earlier row of the file (:mod:`bench.core.row_lines`: configs, describes
and environments repeat from row to row); :func:`read_results` gives every row whole.

Provenance is stamped on every row by :func:`append_row`, never typed by hand:

- ``run_id``: one per launch (a ``bench.sweep`` multirun, a ``bench.ladder`` call, a
  ``bench.ddp`` run), shared by every row that launch writes. A results file may hold many
  runs; the report compares a row only with the baseline of its own run. A launcher that
  spreads one run over processes passes the id on in ``$MED_DDPM_RUN_ID`` (set on first use); a
  command started with it set keeps it, so a shell script of several commands (one device call)
  is one run: ``export MED_DDPM_RUN_ID=$(date -u +%Y%m%dT%H%M%SZ)-mine``.
- ``git_sha`` (full) and ``dirty`` (code or configs differ from that commit): from the stamp file
  ``.provenance.json`` while no stamped file changed, else from git where the tree has a ``.git``.
  ``python -m bench.stamp`` (``make stamp``) writes the stamp from git before the tree is
  copied to another machine (carry it along: it is git-ignored); a copy may hold no ``.git`` or a
  stale one. The stamp lists a hash of every code and config file, so a file edited after
  stamping marks the row dirty. With neither, ``git_sha`` is ``unknown`` and the report leaves
  the row out of its headline tables.

Row schema (``None`` where a field does not apply or the job failed):

=================  =====================================================================
scenario           ``train_step`` | ``denoise_step`` | ``full_sample``
model              model config name (``medddpm_whole_head``, ``tiny``, ...)
image_size         [D, H, W]
batch_size         volumes per call
sampler, steps     sampler label and model calls per sample (full_sample; null otherwise)
recipes            recipe names in selection order; ``[]`` is the strict-FP32 baseline
status             ``ok`` | ``oom`` | ``nan`` | ``unsupported`` | ``error``
message            why a job failed (empty when ok)
ms_median/p10/p90  per-call wall time (ms) over ``iters`` timed calls after ``warmup``
iqr_pct, ms_mean, ms_std, iters, warmup
first_call_s       wall seconds of the first call (lazy init, autotune, compilation)
compile_s          first_call_s less the median call when the stack compiles (else null)
peak_mem_gib       ``torch.cuda.max_memory_allocated`` over the job (null on CPU)
volumes_per_s, voxels_per_s
flops              model FLOPs per call (``torch.utils.flop_counter`` on the meta device)
tflops             flops / median time
precision          ``fp32`` | ``tf32`` | ``bf16`` | ``fp16``, read from the live switches
peak_fraction      tflops / datasheet dense peak for that precision
quality            the quality gate's report (null unless ``bench.quality``)
describe           the recipe stack's ``describe()``
env                ``med_ddpm.utils.env_info()``: GPU, CC, driver, CUDA, cuDNN, torch, monai, host (old rows: git sha)
run_id             the launch that wrote the row (rows written before run ids existed have none)
git_sha, dirty     the code's commit and whether the tree differed from it (``unknown``, null: not known)
config             the resolved job config (reruns and the auto-added baseline use it)
wall_s             seconds the job's subprocess took, end to end
=================  =====================================================================
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

from bench.core.row_lines import line_for, numbered_rows
from med_ddpm.config_checks import DataError
from med_ddpm.utils import append_line, atomic_write_text

STATUSES = ("ok", "oom", "nan", "unsupported", "error")
RESULTS_FILE = "results.jsonl"
ROOT = Path(__file__).resolve().parents[2]
STAMP_FILE = ROOT / ".provenance.json"
RUN_ID_ENV = "MED_DDPM_RUN_ID"
INHERITED_RUN_ID = os.environ.get(RUN_ID_ENV)  # given by whoever started this process: the run it belongs to
CODE_SUFFIXES = (".py", ".yaml", ".toml", ".cfg")  # what decides a measurement; results and docs do not
UNKNOWN = "unknown"
IDENTITY_FIELDS = ("scenario", "model", "image_size", "batch_size", "grad_accum", "world_size", "sampler", "steps")
# Filled by a successful measurement; present as null in every other row, so all rows share keys.
MEASURED_FIELDS = ("ms_median", "ms_p10", "ms_p90", "iqr_pct", "ms_mean", "ms_std", "iters", "warmup",
                   "first_call_s", "compile_s", "peak_mem_gib", "volumes_per_s", "voxels_per_s", "flops",
                   "tflops", "precision", "peak_fraction", "describe", "inert_recipes")


def baseline_key(row: dict[str, Any]) -> str:
    """The workload a row measures, without its recipes: rows sharing it are comparable."""
    return json.dumps([row.get(k) for k in IDENTITY_FIELDS])


def candidate_checkpoint(row: dict[str, Any]) -> str | None:
    """The weights a gated row's candidate arm ran (``quality.candidate_checkpoint``); None: the reference's."""
    return ((row.get("config") or {}).get("quality") or {}).get("candidate_checkpoint")


def reference_sampler(row: dict[str, Any]) -> str | None:
    """The gate's reference sampler (``quality.reference_sampler``): ``same`` judges a stack on the candidate's own
    sampler; None: against strict-FP32 DDPM over every step."""
    return ((row.get("config") or {}).get("quality") or {}).get("reference_sampler")


def job_key(row: dict[str, Any]) -> str:
    """Workload plus recipe stack, its non-default options, the candidate's weights when the gate compared two
    checkpoints and the gate's reference sampler when it is not DDPM: one job of a sweep (resumable runs skip known
    keys). Rows without these keep the key they had before they were recorded."""
    options = list(row.get("recipe_options") or [])
    candidate, reference = candidate_checkpoint(row), reference_sampler(row)
    return json.dumps([baseline_key(row), list(row.get("recipes") or []), *([options] if options else []),
                       *([{"candidate_checkpoint": candidate}] if candidate else []),
                       *([{"reference_sampler": reference}] if reference else [])])


def recipe_label(row: dict[str, Any], baseline: str = "[] (fp32)") -> str:
    """How tables name a row's stack: ``amp_bf16+compile``, options in brackets, ``baseline`` for none, and the
    candidate's weights when the gate compared two checkpoints."""
    label = "+".join(row.get("recipes") or []) or baseline
    options = row.get("recipe_options") or []
    label = f"{label} [{', '.join(options)}]" if options else label
    candidate = candidate_checkpoint(row)  # its last three path parts: the run, checkpoints/, the file
    return f"{label}, candidate weights {'/'.join(Path(candidate).parts[-3:])}" if candidate else label


def code_label(row: dict[str, Any]) -> str:
    """The row's commit (12 hex digits, ``-dirty`` when the tree differed), or ``unknown``.

    Rows written before provenance was stamped carry only ``env.git_sha``; they are labelled with it
    but stay of unknown provenance (:func:`known_provenance`)."""
    sha = row.get("git_sha") or (row.get("env") or {}).get("git_sha") or UNKNOWN
    return sha if sha == UNKNOWN or "git_sha" not in row else sha[:12] + ("-dirty" if row.get("dirty") else "")


def is_baseline(row: dict[str, Any]) -> bool:
    """True for the strict-FP32 reference row (no recipe)."""
    return not row.get("recipes")


def run_id() -> str:
    """This launch's id (``$MED_DDPM_RUN_ID``; a new ``<UTC time>-<random>`` on first use)."""
    if not os.environ.get(RUN_ID_ENV):
        new_run()
    return os.environ[RUN_ID_ENV]


def new_run() -> str:
    """Start a new run id for this process and the processes it starts (one per sweep launch), unless this
    process was started inside a run (``$MED_DDPM_RUN_ID`` set by its launcher): it keeps that one."""
    os.environ[RUN_ID_ENV] = INHERITED_RUN_ID or f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(3)}"
    return os.environ[RUN_ID_ENV]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10,
                          check=True).stdout.strip()


def code_files() -> list[str]:
    """The tree's code and config files (tracked or not ignored), repository-relative."""
    names = _git("ls-files", "--cached", "--others", "--exclude-standard").splitlines()
    return sorted(n for n in set(names) if n.endswith(CODE_SUFFIXES) or n == "Makefile")


def tree_digest(files: list[str]) -> str:
    """sha256 over the names and bytes of ``files`` (a missing file counts as empty)."""
    h = hashlib.sha256()
    for name in files:
        path = ROOT / name
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    return h.hexdigest()


def git_provenance() -> dict[str, Any]:
    """``{git_sha, dirty}`` from git; ``dirty``: a code or config file differs from HEAD, or is new."""
    sha = _git("rev-parse", "HEAD")
    changed = _git("status", "--porcelain", "--", *(f"*{s}" for s in CODE_SUFFIXES), "Makefile")
    return {"git_sha": sha, "dirty": bool(changed)}


def write_stamp(path: Path = STAMP_FILE) -> dict[str, Any]:
    """Write the stamp a copy of this tree without ``.git`` reads its provenance from."""
    files = code_files()
    stamp = {**git_provenance(), "files": files, "digest": tree_digest(files),
             "stamped_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    atomic_write_text(path, json.dumps(stamp, indent=1) + "\n")
    return stamp


def stamp_provenance(path: Path | None = None) -> dict[str, Any] | None:
    """``{git_sha, dirty}`` from the stamp file (``STAMP_FILE``); dirty also when a stamped file changed since."""
    path = STAMP_FILE if path is None else path
    if not path.is_file():
        return None
    stamp = json.loads(path.read_text(encoding="utf-8"))
    edited = tree_digest(stamp["files"]) != stamp["digest"]
    return {"git_sha": stamp["git_sha"], "dirty": bool(stamp["dirty"] or edited)}


def provenance() -> dict[str, Any]:
    """The commit of the code measuring now: the stamp while every stamped file is unchanged, else git where
    there is a ``.git``, else the edited stamp (dirty), else unknown.

    An unchanged stamp comes first because a copied tree can carry a ``.git`` whose HEAD is not the code it
    holds. Asked afresh for every row (one
    ``git`` call, milliseconds next to a benchmark job): a cached answer would outlive an edit or a commit
    made while a long-lived process (a Hydra multirun) keeps writing rows."""
    stamped = stamp_provenance()
    if stamped is not None and not stamped["dirty"]:
        return stamped
    if (ROOT / ".git").exists():
        try:
            return git_provenance()
        except (OSError, subprocess.SubprocessError):
            pass
    return stamped or {"git_sha": UNKNOWN, "dirty": None}


def append_row(path: str | Path, row: dict[str, Any]) -> dict[str, Any]:
    """Append ``row`` as one line (flush + fsync), stamped with this run's id and provenance; returns the row as the
    file holds it. The line is the row whole or its difference from an earlier row of the file
    (:mod:`bench.core.row_lines`); a file that does not read back whole gets the row whole."""
    if row.get("status") not in STATUSES:
        raise ValueError(f"results row has status {row.get('status')!r}; expected one of {STATUSES}")
    stamped = json.loads(json.dumps({"run_id": run_id(), **provenance(), **row}, sort_keys=True, default=str))
    append_line(path, line_for(stamped, earlier_rows(Path(path))))
    return stamped


def earlier_rows(path: Path) -> list[dict[str, Any]]:
    """The rows a new line of ``path`` may be stored against: none when the file is missing or does not read."""
    try:
        return [row for _, row in numbered_rows(path)[0]] if path.exists() else []
    except DataError:
        return []


def read_results(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of a results.jsonl (``path``, or ``path/results.jsonl`` for a folder) and ``<file name>:<line>`` of
    each line cut short, skipped: a run killed while writing a row leaves it, as the last line or, once a later run
    appended after it, in the middle. Any other line that is no JSON row is refused in one line naming it."""
    path = Path(path)
    if path.is_dir() or path.suffix != ".jsonl":
        path = path / RESULTS_FILE
    if not path.exists():
        raise DataError(f"{path.parent}: no results file ({path.name}); pass the folder a sweep or ladder wrote")
    rows, cut = numbered_rows(path)
    return [row for _, row in rows], cut


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a results.jsonl (:func:`read_results`); each line cut short is skipped with a warning."""
    rows, cut = read_results(path)
    for line in cut:
        warnings.warn(f"{path}: skipping {line}, cut short (a run killed while writing it)", RuntimeWarning,
                      stacklevel=2)
    return rows


def missing_baselines(rows: list[dict[str, Any]], run: str | None = None) -> list[dict[str, Any]]:
    """One representative row for every workload of run ``run`` (default: this launch's) that has no
    strict-FP32 row in that run: a speed-up is only ever against a baseline of the same run."""
    run = run or run_id()
    rows = [r for r in rows if r.get("run_id") == run]
    have = {baseline_key(r) for r in rows if is_baseline(r)}
    need: dict[str, dict[str, Any]] = {}
    for row in rows:
        key = baseline_key(row)
        if key not in have and key not in need and row.get("config") is not None:
            need[key] = row
    return list(need.values())
