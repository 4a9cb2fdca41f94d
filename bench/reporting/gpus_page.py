"""``docs/results/gpus.md``: the GPUs side by side, one run each, and where their generations differ.

Per workload and stack, each GPU's time, its speed-ups over strict FP32 and over torch's defaults (both within
that GPU's own run) and its quality verdict; the real commands beside the step figures; BraTS; the counters
factors of each GPU under the study's A100 claims. Above them, one sentence per workload generated from the same
numbers: which GPU runs each stack faster and by how much, and how the shipped stack's speed-up differs. A ratio
within :data:`SAME` of 1 is said to be the same, since repeated runs of one job differ by a few percent.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.counter_claims import STUDY
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
    fmt_ms,
    fmt_x,
    sig,
)
from bench.reporting.gpu_page import (
    COUNTER_COLUMNS,
    READING,
    counter_cells,
    e2e_cell,
    link,
    study_line,
    verdict,
)
from bench.reporting.verdicts import Gates

SAME = 0.05  # ratios within 5 % of 1 read as "the same"


def captions(runs: Sequence[Run]) -> str:
    """Which run each GPU's columns come from: ``H100: run `X` at commit `c`; H200: ...``."""
    return "; ".join(f"{r.gpu}: {r.caption()}" for r in runs) + "."


def header(first: str, per_gpu: Sequence[str], runs: Sequence[Run]) -> list[str]:
    cells = [first, *(f"{r.gpu} {c}".rstrip() for r in runs for c in per_gpu)]
    return ["| " + " | ".join(cells) + " |", "|" + " --- |" * len(cells)]


def stack_cells(run: Run, gates: Gates, job: str) -> list[str]:
    """One GPU's time, speed-ups over both baselines and verdict word for ``job``; its status when it has no time."""
    ms = run.ms(job)
    if ms is None:
        return [run.status_note(job), "", "", ""]
    once = " once" if (run.ok(job) or {}).get("iters") == 1 else ""
    return [fmt_ms(ms) + once + run.variant(job), *(fmt_x(run.speedup(job, b)) for b in BASELINES), verdict(run, gates, job).word]


def differs(values: dict[str, float]) -> tuple[str, str, float] | None:
    """(GPU of the largest value, GPU of the smallest, their ratio) over the GPUs that have one; None for fewer
    than two."""
    if len(values) < 2:
        return None
    high, low = max(values, key=values.get), min(values, key=values.get)
    return high, low, values[high] / values[low]


def speed_clause(stack: str, times: dict[str, float]) -> str | None:
    """How one stack's time differs between the GPUs: ``shipped` runs 1.08× as fast on the H200 as on the H100``."""
    spread = differs(times)
    if spread is None:
        return None
    slow, fast, ratio = spread
    figures = ", ".join(f"{fmt_ms(t)} on the {g}" for g, t in times.items())
    if ratio < 1 + SAME:
        return f"`{stack}` takes the same time within 5 % ({figures})"
    return f"`{stack}` runs {sig(ratio, 3)}× as fast on the {fast} as on the {slow} ({figures})"


def gain_clause(baseline: str, gains: dict[str, float]) -> str | None:
    """How the shipped stack's speed-up over ``baseline`` differs between the GPUs."""
    spread = differs(gains)
    if spread is None:
        return None
    figures = ", ".join(f"{fmt_x(x)} on the {g}" for g, x in gains.items())
    high, low, ratio = spread
    if ratio < 1 + SAME:
        return f"the shipped stack's speed-up over `{baseline}` is the same within 5 % ({figures})"
    return f"the shipped stack gains more over `{baseline}` on the {high} than on the {low} ({figures})"


def workload_sentence(workload: str, runs: Sequence[Run]) -> str:
    """One sentence on where the GPUs differ in ``workload``, from the rows' numbers only."""
    measured = [r.gpu for r in runs if any(r.ms(f"{workload}.{s}") for s in STACKS)]
    if len(measured) < 2:
        return f"`{workload}`: measured on {' and '.join(f'the {g}' for g in measured) or 'no GPU'} only."
    clauses = [speed_clause(s, {r.gpu: r.ms(f"{workload}.{s}") for r in runs if r.ms(f"{workload}.{s}")})
               for s in STACKS]
    clauses += [gain_clause(b, {r.gpu: x for r in runs if (x := r.speedup(f"{workload}.shipped", b))})
                for b in BASELINES]
    return f"`{workload}`: " + "; ".join(c for c in clauses if c) + "."


def counters_sentence(runs: Sequence[Run]) -> str:
    """The TF32 + channels-last factors of each GPU against the study's A100 claims, in one sentence."""
    job = COUNTERS[0]
    cells = {r.gpu: counter_cells(r.ok(COUNTERS_BASE), r.ok(job)) for r in runs}
    cells = {g: c for g, c in cells.items() if c[1]}
    if not cells:
        return f"Counters: no GPU has `{job}` against `{COUNTERS_BASE}`."
    per = "; ".join(f"the {g}: {c[1]} fewer SM cycles, {c[2]} fewer instructions, IPC {c[4]}" for g, c in cells.items())
    return (f"Counters, `{job}` against strict FP32 on the 128³ sampler step: {per}; the study reports "
            f"{STUDY['sm_cycles']} fewer SM cycles, {STUDY['inst']} fewer instructions and IPC {STUDY['ipc']} on the "
            "A100.")


def workload_table(workload: str, runs: Sequence[Run], gates: dict[str, Gates]) -> list[str]:
    lines = [f"## `{workload}`: {WORKLOADS[workload]}", "", captions(runs), "",
             *header("stack", ("time", "vs strict_fp32", "vs torch_defaults", "quality"), runs)]
    for stack in STACKS:
        job = f"{workload}.{stack}"
        cells = [f"`{stack}`", *(c for r in runs for c in stack_cells(r, gates[r.gpu], job))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def e2e_table(runs: Sequence[Run]) -> list[str]:
    lines = ["## The real commands, from process start", "", captions(runs), "",
             *header("job", ("", "step beside it, a volume"), runs)]
    for job, (_, what, step) in E2E.items():
        cells = [f"`{job}` ({what})"]
        for r in runs:
            cells += [e2e_cell(r, job) if r.ok(job) else r.status_note(job),
                      f"`{step}` {fmt_ms(r.ms_per_volume(step))}" if r.ms(step) else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def brats_table(runs: Sequence[Run]) -> list[str]:
    lines = ["## BraTS, the memory stack", "", captions(runs), "", f"| GPU | `{BRATS}`, a volume | peak GiB |",
             "| --- | --- | --- |"]
    for r in runs:
        row = r.ok(BRATS)
        mem = sig(row["peak_mem_gib"], 3) if row and row.get("peak_mem_gib") is not None else ""
        lines.append(f"| {r.gpu} | {fmt_ms(r.ms_per_volume(BRATS)) if row else r.status_note(BRATS)} | {mem} |")
    return lines + [""]


def counters_table(runs: Sequence[Run]) -> list[str]:
    lines = ["## Hardware counters against the study's A100 claims", "", captions(runs), "",
             "Nsight Compute on the 128³ sampler step, library kernels; factors against each GPU's own "
             f"`{COUNTERS_BASE}`.", "", "| GPU · stack | " + " | ".join(COUNTER_COLUMNS) + " |", "|" + " --- |" * 6,
             study_line()]
    for r in runs:
        for job in COUNTERS:
            base, row = r.ok(COUNTERS_BASE), r.ok(job)
            cells = counter_cells(base, row) if base and row else [r.status_note(job if base else COUNTERS_BASE)]
            lines.append(f"| {r.gpu} · `{job}` | " + " | ".join(cells) + " |")
    return lines + [""]


def gpus_page(runs: Sequence[Run], gates: dict[str, Gates], page_dir: Path) -> str:
    """The whole side-by-side page; ``gates`` by GPU label (:attr:`Run.gpu`)."""
    sources = "; ".join(f"{r.gpu} ({r.device}): {r.caption()}, {link(r.folder / RESULTS_FILE, page_dir, 'rows')}, "
                        f"{link(page_dir / (r.folder.name + '.md'), page_dir, 'its page')}" for r in runs)
    lines = ["# Results per GPU", "",
             "Generated by `python -m bench.report publish=true`, one run per GPU folder; nothing here is typed. "
             f"{sources}.", "",
             f"{READING} Quality verdicts are each GPU's own gate files (`not gated`: none ran that stack there); the pages "
             "per GPU say which file each comes from.", "",
             "## Where the generations differ", "",
             *(f"- {workload_sentence(w, runs)}" for w in WORKLOADS), f"- {counters_sentence(runs)}", ""]
    for workload in WORKLOADS:
        lines += workload_table(workload, runs, gates)
    return "\n".join(lines + e2e_table(runs) + brats_table(runs) + counters_table(runs))
