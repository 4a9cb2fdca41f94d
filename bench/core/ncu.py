"""Nsight Compute (``ncu``) as a subprocess: run it, read its CSV pages, and say why it could not.

The profiling run exports a report (``-o``); two imports of that report print the pages read here,
so the rule results cost no second replay:

* ``--page raw --csv``: a header row (``"ID"``, ``"Kernel Name"``, ..., one column per metric), a units
  row (empty ``ID``: ``"cycle"``, ``"inst"``, ``"%"``, ``"ns"`` or ``"nsecond"``), then one row per profiled kernel
  launch. Numbers may carry thousands separators (``"1,234,567"``); a metric the kernel has no value
  for reads ``"n/a"``.
* ``--page details --csv``: one row per (launch, section, metric), and one per rule result, whose
  ``"Rule Name"``, ``"Rule Type"``, ``"Estimated Speedup Type"`` and ``"Estimated Speedup"`` (percent
  of the kernel's duration) columns are filled. A run without sections has no rule results.

Where the machine cannot read counters, ncu exits early with an ``==ERROR==`` line: under gVisor
"Failed to initialize the profiler", without permission ``ERR_NVGPUCTRPERM``.
:func:`unavailable_reason` turns those into one sentence for the results row.

Example:
    >>> text = Path("report_raw.csv").read_text()
    >>> launches, units = parse_raw(text)
    >>> launches[0]["Kernel Name"], launches[0]["gpu__time_duration.sum"]
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.core import subprocesses

DEFAULT_NCU = "/usr/local/cuda/bin/ncu"
REPLAY_MODES = ("kernel", "application")  # ncu --replay-mode values profile_command accepts
TEXT_COLUMNS = frozenset({"ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
                          "Block Size", "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit",
                          "Rule Name", "Rule Type", "Rule Description", "Estimated Speedup Type"})
# Units the raw page may print; time becomes ns, an SI prefix on a count (Kinst, Mcycle, Gbyte) is applied.
TIME_NS = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9, "s": 1e9}
PREFIX = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
# ncu's own words when the driver or the sandbox keeps the counters away
UNAVAILABLE = re.compile(r"Failed to initialize the profiler|ERR_NVGPUCTRPERM|profiling is not supported|"
                         r"not supported on this (device|platform)|could not be loaded|No supported devices",
                         re.IGNORECASE)
PASSES = re.compile(r"(\d+) pass(?:es)?\b")


@dataclass
class Run:
    """One finished (or killed) ncu run: its combined output, exit code (None: killed), wall time."""

    log: str
    returncode: int | None
    wall_s: float


def find_ncu(configured: str | None = None) -> str | None:
    """The ncu executable: ``configured`` when it is one, else ``ncu`` on PATH, else the CUDA default."""
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    return shutil.which("ncu") or (DEFAULT_NCU if os.access(DEFAULT_NCU, os.X_OK) else None)


def run(cmd: Sequence[str], timeout_s: float, log_path: Path | None = None) -> Run:
    """Run ``cmd`` in its own process group (ncu and the program it launched are killed together on
    timeout, or when bench is stopped: :mod:`bench.core.subprocesses`), stdout and stderr together, optionally
    saved to ``log_path``."""
    start = time.perf_counter()
    code, out = subprocesses.run(cmd, timeout_s, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  errors="replace")
    if log_path is not None:
        log_path.write_text(out, encoding="utf-8")
    return Run(out, code, time.perf_counter() - start)


def profile_command(ncu: str, metrics: Sequence[str], report: Path, program: Sequence[str], *, nvtx_range: str,
                    sections: Sequence[str] = (), kernel_filter: str | None = None,
                    max_kernels: int | None = None, replay: str = "kernel") -> list[str]:
    """The profiling run: counters of every kernel launched inside the NVTX start/end range
    ``nvtx_range`` (a process range, so kernels launched by autograd's device thread count too),
    clocks left as they are, exported to ``report`` (``.ncu-rep``).

    ``replay`` is ncu's ``--replay-mode`` (:data:`REPLAY_MODES`): ``kernel`` replays each launch once per
    metric pass, saving and restoring the memory it writes, so its cost grows with the launches;
    ``application`` runs ``program`` once per pass instead, and needs the same launches in every run."""
    cmd = [ncu, "--clock-control", "none", "--target-processes", "application-only", "--replay-mode", replay,
           "--nvtx", "--nvtx-include", nvtx_range, "--metrics", ",".join(metrics)]
    for section in sections:
        cmd += ["--section", section]
    if kernel_filter:
        cmd += ["--kernel-name", f"regex:{kernel_filter}"]
    if max_kernels:
        cmd += ["--launch-count", str(int(max_kernels))]
    return [*cmd, "--force-overwrite", "--export", str(report), *program]


def import_command(ncu: str, report: Path, page: str) -> list[str]:
    """Print one page of an exported report as CSV, values in base units, kernels by their full
    demangled names (template arguments say what an ``elementwise_kernel`` does); no replay."""
    return [ncu, "--import", str(report), "--csv", "--page", page, "--print-units", "base",
            "--print-kernel-base", "demangled"]


def error_lines(log: str, tag: str = "ERROR") -> list[str]:
    """ncu's ``==ERROR==`` (or ``==WARNING==``, ...) lines, its reasons, without the prefix."""
    mark = f"=={tag}=="
    return [line.split(mark, 1)[1].strip() for line in log.splitlines() if mark in line]


def unavailable_reason(log: str) -> str | None:
    """Why this machine cannot read counters, in ncu's words, or None when the log gives no such reason."""
    for line in log.splitlines():
        if UNAVAILABLE.search(line):
            return line.replace("==ERROR==", "").strip()
    return None


def replay_passes(log: str) -> list[int]:
    """Passes ncu needed per profiled launch (``==PROF== Profiling "k" - 0: 0%....100% - 9 passes``)."""
    return [int(m.group(1)) for line in log.splitlines() if "==PROF==" in line for m in [PASSES.search(line)] if m]


def number(text: str | None) -> float | None:
    """A metric value as a float: thousands separators dropped; ``n/a``, empty or text -> None."""
    if text is None:
        return None
    text = text.strip().replace(",", "")
    try:
        return float(text)
    except ValueError:
        return None


def unit_scale(unit: str) -> float:
    """Factor that brings a value in ``unit`` to ns (time) or to the plain count (SI-prefixed counts)."""
    unit = unit.strip()
    if unit in TIME_NS:
        return TIME_NS[unit]
    if len(unit) > 1 and unit[0] in PREFIX and unit[1:] in ("inst", "cycle", "byte", "sector", "request", "warp"):
        return PREFIX[unit[0]]
    return 1.0


def _table(text: str) -> list[dict[str, str]]:
    """The CSV table in ncu's output, from its ``"ID"`` header on (``==PROF==`` lines before it skipped)."""
    start = text.find('"ID"')
    if start < 0:
        reasons = error_lines(text)
        raise ValueError(f"ncu printed no CSV table{': ' + reasons[0] if reasons else ''}")
    return list(csv.DictReader(io.StringIO(text[start:])))


def parse_raw(text: str) -> tuple[list[dict[str, str | float | None]], dict[str, str]]:
    """(launches, units) of a ``--page raw --csv`` page: per launch the text columns as text and every
    metric as a float in ns / plain counts (None for ``n/a``); ``units`` maps metric -> printed unit."""
    rows = _table(text)
    units = {k: v for k, v in rows[0].items() if k not in TEXT_COLUMNS} if rows and not rows[0]["ID"].strip() else {}
    launches = []
    for row in rows:
        if not row.get("ID", "").strip().isdigit():
            continue
        parsed: dict[str, str | float | None] = {}
        for key, value in row.items():
            if key is None:
                continue
            if key in TEXT_COLUMNS or not key.count("__"):
                parsed[key] = value
            else:
                v = number(value)
                parsed[key] = None if v is None else v * unit_scale(units.get(key, ""))
        launches.append(parsed)
    return launches, units


def parse_rules(text: str) -> list[dict[str, str | float | None]]:
    """Rule results of a ``--page details --csv`` page: launch ID, kernel, section, rule, type,
    speedup type and estimated speedup (percent, None when the rule gives none)."""
    rules = []
    for row in _table(text):
        if not (row.get("Rule Name") or "").strip():
            continue
        rules.append({"id": row.get("ID", ""), "kernel": row.get("Kernel Name", ""),
                      "section": row.get("Section Name", ""), "rule": row["Rule Name"].strip(),
                      "type": row.get("Rule Type", ""), "speedup_type": row.get("Estimated Speedup Type", ""),
                      "speedup_pct": number(row.get("Estimated Speedup"))})
    return rules


def version(ncu: str) -> str | None:
    """``ncu --version``'s last line (``Version 2025.3.0.0 (build ...)``), or None when it does not answer."""
    try:
        out = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return lines[-1] if lines else None
