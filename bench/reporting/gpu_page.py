"""One GPU's evidence page (``docs/results/<gpu>.md``) and the README's results table, from one run's rows.

Every figure is read from a row of the run the page names (:class:`bench.reporting.evidence.Run`); each speed-up
divides two times of that run, against strict FP32 and against torch's default numerics (the original Med-DDPM's);
each time stands beside its quality verdict (:mod:`bench.reporting.verdicts`), and the shipped stacks' step times
beside the real commands' figures from process start. A job without an ``ok`` row shows its status (an
``unsupported`` row its reason) and no ratio.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.counter_claims import STUDY, compare
from bench.records import RESULTS_FILE
from bench.reporting.evidence import (
    BASELINES,
    BRATS,
    COUNTERS,
    COUNTERS_BASE,
    E2E,
    STACKS,
    WORKLOADS,
    Run,
    env_summary,
    fmt_ms,
    fmt_x,
    runs_note,
    sig,
)
from bench.reporting.verdicts import NOT_GATED, QUALITY_DIR, Gates, Verdict

README_COLUMNS = ("workload", *STACKS, *(f"vs {b}" for b in BASELINES), "real command")
SHIPPED = ("`shipped` is `experiment=fast_sample` for the forward and the samples, `experiment=fast_train` for the "
           "train step")
READING = ("Times are medians per call over the row's timed calls; each speed-up divides two times of the same run, "
           "against `strict_fp32` (`recipe=[]`, TF32 off) and against `torch_defaults` (torch's out-of-the-box "
           f"numerics, the original Med-DDPM's). {SHIPPED}.")
COUNTER_COLUMNS = ("kernel time reduction", "SM cycles reduction", "instruction reduction", "tensor-pipe use",
                   "IPC change")


def link(target: Path, page_dir: Path, text: str | None = None) -> str:
    """A markdown link from a page in ``page_dir`` to ``target``."""
    return f"[{text or target.name}]({Path(os.path.relpath(target, page_dir)).as_posix()})"


def verdict(run: Run, gates: Gates, job: str) -> Verdict:
    """The verdict beside ``job``'s time: its own gate's; a forward with none takes the verdict of its stack on
    ``fast_sample``'s sampler in the same run (the gate's ε probes run that stack's forward), and says so."""
    found = gates.verdict(run.row(job))
    workload, stack = job.split(".", 1)
    if found == NOT_GATED and workload == "forward":
        sample = gates.verdict(run.row(f"fast_sampler.{stack}"))
        if sample != NOT_GATED:
            return replace(sample, detail=", ".join(d for d in (f"as `fast_sampler.{stack}`", sample.detail) if d))
    return found


def time_cell(run: Run, gates: Gates, job: str) -> str:
    """A README cell: ``job``'s time (``once`` when a single call was timed), its time per volume when a call has
    several, and its verdict's word; its status when it has no ``ok`` row."""
    row = run.ok(job)
    if row is None:
        return run.status(job)
    parts = [fmt_ms(run.ms(job)) + (" once" if row.get("iters") == 1 else "") + run.variant(job)]
    if int(row.get("batch_size") or 1) > 1:
        parts.append(f"{fmt_ms(run.ms_per_volume(job))} a volume")
    return ", ".join([*parts, verdict(run, gates, job).word])


def e2e_cell(run: Run, job: str) -> str:
    """An end-to-end figure (``ms_per_volume`` with ``a volume``), or the job's status."""
    ms = run.e2e_ms(job)
    if ms is None:
        return run.status(job)
    return f"{fmt_ms(ms)} a volume" if E2E[job][0] == "ms_per_volume" else fmt_ms(ms)


def readme_table(run: Run, gates: Gates, readme_dir: Path, page: Path) -> str:
    """The README's results block: one line naming the GPU, run, commit and rows, then one line per workload."""
    batch = (run.ok("train_step.shipped") or {}).get("batch_size")
    lines = [f"{run.device}, {run.caption()} ({link(run.folder / RESULTS_FILE, readme_dir, 'rows')}, "
             f"{link(page, readme_dir, 'every table')}): medians"
             + (f", the train step at a batch of {batch}" if batch else "")
             + "; `shipped` is `experiment=fast_sample` (`fast_train` to train); its speed-ups are within this run.",
             "", "| " + " | ".join(README_COLUMNS) + " |", "|" + " --- |" * len(README_COLUMNS)]
    for workload in WORKLOADS:
        shipped = f"{workload}.shipped"
        real = [f"`{job}` {e2e_cell(run, job)}" for job, (_, _, step) in E2E.items() if step == shipped]
        cells = [f"`{workload}`", *(time_cell(run, gates, f"{workload}.{s}") for s in STACKS),
                 *(fmt_x(run.speedup(shipped, b)) for b in BASELINES), "; ".join(real)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def step_table(run: Run, gates: Gates, page_dir: Path) -> list[str]:
    """Every step job of the contract: time, spread, calls timed, per volume, both speed-ups, memory, verdict."""
    lines = [f"{run.caption()}.", "", "| job | time | p10 – p90 | calls timed | a volume | vs strict_fp32 | "
             "vs torch_defaults | peak GiB | quality |", "|" + " --- |" * 9]
    for workload, what in WORKLOADS.items():
        for stack in STACKS:
            job = f"{workload}.{stack}"
            row = run.ok(job)
            name = f"`{job}` ({what}{', batch ' + str(row['batch_size']) if row else ''}){run.variant(job)}"
            if row is None:
                lines.append(f"| {name} | {run.status_note(job)} |" + " |" * 7)
                continue
            spread = f"{fmt_ms(row.get('ms_p10'))} – {fmt_ms(row.get('ms_p90'))}" if row.get("ms_p10") else ""
            mem = sig(row["peak_mem_gib"], 3) if row.get("peak_mem_gib") is not None else ""
            lines.append(f"| {name} | {fmt_ms(run.ms(job))} | {spread} | {row.get('iters') or ''} | "
                         f"{fmt_ms(run.ms_per_volume(job))} | {fmt_x(run.speedup(job, BASELINES[0]))} | "
                         f"{fmt_x(run.speedup(job, BASELINES[1]))} | {mem} | {verdict(run, gates, job).text(page_dir)} |")
    return lines + [""]


def e2e_table(run: Run) -> list[str]:
    """The real commands' figures, each beside the step benchmark of the same stack in the same run."""
    lines = [f"{run.caption()}.", "", "| job | what | figure | the step benchmark beside it |", "|" + " --- |" * 4]
    for job, (_, what, step) in E2E.items():
        beside = run.ms_per_volume(step)
        shown = f"`{step}` {fmt_ms(beside)} a volume" if beside else ""
        figure = e2e_cell(run, job) if run.ok(job) else run.status_note(job)
        lines.append(f"| `{job}` | {what} | {figure} | {shown} |")
    return lines + [""]


def brats_table(run: Run) -> list[str]:
    row = run.ok(BRATS)
    lines = [f"{run.caption()}.", "", "| job | recipes | a volume | peak GiB |", "| --- | --- | --- | --- |"]
    if row is None:
        return lines + [f"| `{BRATS}` | {run.status_note(BRATS)} | | |", ""]
    mem = sig(row["peak_mem_gib"], 3) if row.get("peak_mem_gib") is not None else ""
    return lines + [f"| `{BRATS}` | {'+'.join(row.get('recipes') or [])} | {fmt_ms(run.ms_per_volume(BRATS))} | "
                    f"{mem} |", ""]


def counter_cells(base: dict[str, Any] | None, row: dict[str, Any] | None) -> list[str]:
    """A counters row's factors against the strict-FP32 row (:func:`bench.counter_claims.compare`), as cells."""
    if base is None or row is None:
        return [""] * len(COUNTER_COLUMNS)
    c = compare(row, base)
    pct = "" if c["tensor_pct"] is None else f"{c['tensor_pct']:.2f} %"
    tensor = f"{fmt_x(c['tensor'])} ({pct})" if c["tensor"] is not None else pct
    ipc = "" if c["ipc"] is None else f"{c['ipc']:+.1%}"
    return [fmt_x(c["time"]), fmt_x(c["sm_cycles"]), fmt_x(c["inst"]), tensor, ipc]


def study_line() -> str:
    return f"| {STUDY['label']} | | {STUDY['sm_cycles']} | {STUDY['inst']} | {STUDY['tensor']} | {STUDY['ipc']} |"


def counters_table(run: Run) -> list[str]:
    """The counters factors of each stack against the run's strict FP32, under the study's A100 claims."""
    base = run.ok(COUNTERS_BASE)
    lines = [f"{run.caption()}.", "", "| stack | " + " | ".join(COUNTER_COLUMNS) + " |", "|" + " --- |" * 6,
             study_line()]
    for job in (COUNTERS_BASE, *COUNTERS):
        if run.ok(job) is None or base is None:
            lines.append(f"| `{job}` | {run.status_note(job) if run.ok(job) is None else 'no strict-FP32 row'} |"
                         + " |" * 4)
        else:
            lines.append(f"| `{job}` | " + " | ".join(counter_cells(base, run.ok(job))) + " |")
    return lines + [""]


def gate_files(run: Run, page_dir: Path) -> str:
    """Where the page's verdicts come from: the folder's gate files, or that it has none."""
    quality = run.folder / QUALITY_DIR
    if not quality.is_dir():
        return f"Quality verdicts: this folder has no gate files (no `{QUALITY_DIR}/`)"
    return f"Quality verdicts are read from the gate's files in {link(quality, page_dir, QUALITY_DIR + '/')}"


def gpu_page(run: Run, gates: Gates, page_dir: Path) -> str:
    """The whole page of one GPU folder's run."""
    named = set(run.jobs) - {f"{w}.{s}" for w in WORKLOADS for s in STACKS} - set(E2E) - {BRATS, COUNTERS_BASE,
                                                                                             *COUNTERS}
    lines = [f"# Results: {run.device} ({run.folder.as_posix()})", "",
             f"Generated by `python -m bench.report publish=true` from the rows of "
             f"{link(run.folder / RESULTS_FILE, page_dir, 'results.jsonl')}; nothing here is typed. "
             f"The tables use {runs_note(run)}. Environment: {env_summary(list(run.jobs.values()))}.", "",
             f"{READING} {gate_files(run, page_dir)} (`not gated`: no gate ran that stack on this GPU; `reference`: "
             "strict FP32, what the gate compares against).", ""]
    if run.skipped:
        lines += [f"{len(run.skipped)} unreadable line(s) of results.jsonl skipped: "
                  + ", ".join(f"`{s}`" for s in run.skipped), ""]
    lines += ["## Step benchmarks", "", *step_table(run, gates, page_dir),
              "## The real commands, from process start", "", *e2e_table(run),
              "## BraTS, the memory stack", "", *brats_table(run),
              "## Hardware counters against the study's claims", "",
              "Nsight Compute on the 128³ sampler step, library kernels; factors against `counters.strict_fp32`.", "",
              *counters_table(run)]
    if named:
        lines += [f"The run also holds rows of jobs outside these tables: {', '.join(sorted(named))}.", ""]
    return "\n".join(lines)
