"""The evidence pages, each from one run of one GPU folder, and ``python -m bench.report publish=true`` writing them.

* ``docs/results/<gpu>.md`` (:func:`gpu_page`): every job of the run with its time, spread, calls timed, time per
  volume, speed-ups over strict FP32 and over torch's default numerics (the original Med-DDPM's), peak memory and
  quality verdict (:mod:`bench.reporting.verdicts`); the real commands' figures from process start beside the shipped
  stacks' step times; BraTS; the counters against the study's claims.
* the README's results table (:func:`readme_table`): one line per workload, its three stacks' times with their
  verdicts, the shipped stack's two speed-ups and the real commands.
* ``docs/results/gpus.md`` (:func:`gpus_page`): the GPUs side by side, and above them one sentence per workload
  generated from the same numbers: which GPU runs each stack faster and by how much, and how the shipped stack's
  speed-up differs. The sentences name ratios only; the times stand in the table below them. A ratio within :data:`SAME` of 1 is
  said to be the same, since repeated runs of one job differ by a few percent.

Every figure is read from a row of the run the page names (:class:`bench.reporting.evidence.Run`), every speed-up
divides two times of that run, and each page names its runs and commits once, at its top (the side-by-side page
above its step table). A job without an ``ok`` row shows its status (an ``unsupported`` row its reason) and no ratio. :func:`publish` chooses each folder's run and renders every
page before the first is written, so a refusal leaves every page as it was.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from bench.core.records import RESULTS_FILE
from bench.reporting.evidence import (
    BASELINES,
    BRATS,
    COUNTER_COLUMNS,
    COUNTERS,
    COUNTERS_BASE,
    E2E,
    SAMPLE_PHASES,
    STACKS,
    STUDY,
    TRAIN_PHASES,
    WORKLOADS,
    Run,
    choose_run,
    counter_cells,
    env_summary,
    fmt_ms,
    fmt_x,
    runs_note,
    sig,
    study_line,
)
from bench.reporting.plan128 import plan_lines
from bench.reporting.verdicts import NOT_GATED, QUALITY_DIR, Gates, Verdict
from med_ddpm.config_checks import ConfigError, DataError
from med_ddpm.utils import atomic_write_text

README_COLUMNS = ("workload", *STACKS, *(f"vs {b}" for b in BASELINES), "real command")
SHIPPED = ("`shipped` is `experiment=fast_sample` for the forward and the samples, `experiment=fast_train` for the "
           "train step")
READING = ("Times are medians per call over the row's timed calls; each speed-up divides two times of the same run, "
           "against `strict_fp32` (`recipe=[]`, TF32 off) and against `torch_defaults` (torch's out-of-the-box "
           f"numerics, the original Med-DDPM's). {SHIPPED}.")


def link(target: Path, page_dir: Path, text: str | None = None) -> str:
    """A markdown link from a page in ``page_dir`` to ``target``."""
    return f"[{text or target.name}]({Path(os.path.relpath(target, page_dir)).as_posix()})"


def verdict(run: Run, gates: Gates, job: str) -> Verdict:
    """The verdict beside ``job``'s time: its own gate's; a forward with none takes the verdict of its stack on
    ``fast_sample``'s sampler in the same run (the gate's ε probes run that stack's forward), and says so."""
    found = gates.verdict(run.row(job))
    workload, stack = job.split(".", 1)
    if found.word == NOT_GATED.word and workload == "forward":
        sample = gates.verdict(run.row(f"fast_sampler.{stack}"))
        if sample.word != NOT_GATED.word:
            return replace(sample, detail=", ".join(d for d in (f"as `fast_sampler.{stack}`", sample.detail) if d))
    return found


def time_cell(run: Run, gates: Gates, job: str) -> str:
    """A README cell: ``job``'s time (``once`` when a single call was timed), its time per volume when a call has
    several, and its verdict's word (a training verdict's with its band); its status when it has no ``ok`` row."""
    row = run.ok(job)
    if row is None:
        return run.status(job)
    parts = [fmt_ms(run.ms(job)) + (" once" if row.get("iters") == 1 else "") + run.variant(job)]
    if int(row.get("batch_size") or 1) > 1:
        parts.append(f"{fmt_ms(run.ms_per_volume(job))} a volume")
    return ", ".join([*parts, verdict(run, gates, job).brief])


def e2e_cell(run: Run, job: str) -> str:
    """An end-to-end figure (``ms_per_volume`` with ``a volume``), or the job's status."""
    ms = run.e2e_ms(job)
    if ms is None:
        return run.status(job)
    return f"{fmt_ms(ms)} a volume" if E2E[job].per_volume else fmt_ms(ms)


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
        real = [f"`{job}` {e2e_cell(run, job)}" for job, spec in E2E.items() if spec.step == shipped]
        cells = [f"`{workload}`", *(time_cell(run, gates, f"{workload}.{s}") for s in STACKS),
                 *(fmt_x(run.speedup(shipped, b)) for b in BASELINES), "; ".join(real)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def step_table(run: Run, gates: Gates, page_dir: Path) -> list[str]:
    """Every step job of the contract: time, spread, calls timed, per volume, both speed-ups, memory, verdict (a
    verdict whose detail an earlier row gave, with no file of its own, says ``as above``)."""
    lines = ["| job | time | p10 – p90 | calls timed | a volume | vs strict_fp32 | "
             "vs torch_defaults | peak GiB | quality |", "|" + " --- |" * 9]
    said: set[str] = set()
    for workload, what in WORKLOADS.items():
        for stack in STACKS:
            job = f"{workload}.{stack}"
            row = run.ok(job)
            name = f"`{job}` ({what}{', batch ' + str(row['batch_size']) if row else ''}){run.variant(job)}"
            if row is None:
                lines.append(f"| {name} | {run.status_note(job)} |" + " |" * 7)
                continue
            several = row.get("ms_p10") and (row.get("iters") or 2) > 1  # one call timed has no spread
            spread = f"{fmt_ms(row.get('ms_p10'))} – {fmt_ms(row.get('ms_p90'))}" if several else ""
            mem = sig(row["peak_mem_gib"], 3) if row.get("peak_mem_gib") is not None else ""
            found = verdict(run, gates, job)
            repeated = bool(found.detail) and found.source is None and found.detail in said
            said.add(found.detail)
            quality = f"{found.word} (as above)" if repeated else found.text(page_dir)
            lines.append(f"| {name} | {fmt_ms(run.ms(job))} | {spread} | {row.get('iters') or ''} | "
                         f"{fmt_ms(run.ms_per_volume(job))} | {fmt_x(run.speedup(job, BASELINES[0]))} | "
                         f"{fmt_x(run.speedup(job, BASELINES[1]))} | {mem} | {quality} |")
    return lines + [""]


def target(job: str) -> str:
    """The project's target for an end-to-end figure: ``≤ 15.00 s``."""
    return f"≤ {fmt_ms(E2E[job].target_ms)}{' a volume' if E2E[job].per_volume else ''}"


def met(run: Run, job: str) -> str:
    """``met`` or ``missed`` (the run's figure against the target), ``""`` without a figure."""
    ms = run.e2e_ms(job)
    return "" if ms is None else ("met" if ms <= E2E[job].target_ms else "missed")


def target_cell(run: Run, job: str) -> str:
    """The target of an end-to-end figure, and whether the run met it."""
    return ": ".join(filter(None, (target(job), met(run, job))))


def e2e_table(run: Run) -> list[str]:
    """The real commands' figures, each beside its target, the plan it took (``compile=auto``) and the step benchmark
    of the same stack in the same run."""
    lines = ["| job | what | figure | target | plan | the step benchmark beside it |", "|" + " --- |" * 6]
    for job, spec in E2E.items():
        beside = run.ms_per_volume(spec.step)
        shown = f"`{spec.step}` {fmt_ms(beside)} a volume" if beside else ""
        figure = e2e_cell(run, job) if run.ok(job) else run.status_note(job)
        lines.append(f"| `{job}` | {spec.what} | {figure} | {target_cell(run, job)} | {run.plan(job)} | {shown} |")
    return lines + [""]


def phase_table(jobs: Sequence[str], rows: Sequence[dict], phases: Sequence[tuple[str, str]],
                tail: Sequence[tuple[str, list[float]]]) -> list[str]:
    """Seconds per phase (a row's split fields, those its code marked, then ``tail``), one column per job."""
    lines = ["| phase | " + " | ".join(f"`{job}` s" for job in jobs) + " |", "|" + " --- |" * (len(jobs) + 1)]
    for key, label in phases:
        if any(row.get(key) is not None for row in rows):
            lines.append(f"| {label} | " + " | ".join("" if r.get(key) is None else f"{r[key]:.2f}" for r in rows) + " |")
    return lines + [f"| {label} | " + " | ".join(f"{v:.2f}" for v in values) + " |" for label, values in tail] + [""]


def sample_tail(row: dict) -> tuple[float, float, float]:
    """A sampling row's first mask (warm-up and wait taken out), later masks and what came after the last: the
    phases that, with the start-up's, add up to its total."""
    first = row["first_volume_s"] - (row.get("warmup_s") or 0.0) - (row.get("mask_wait_s") or 0.0)
    later = (row.get("per_volume_s") or 0.0) * (int(row["masks"]) - 1)
    return first, later, row["total_s"] - row["startup_s"] - row["first_volume_s"] - later


def startup_tables(run: Run) -> list[str]:
    """Where the real commands' seconds go, from each row's split (:mod:`bench.core.e2e`)."""
    lines = []
    sampling = [job for job in E2E if job.startswith("e2e.sample") and "first_volume_s" in (run.ok(job) or {})]
    if sampling:
        rows = [run.ok(job) for job in sampling]
        tails = [sample_tail(row) for row in rows]
        tail = [(label, [t[i] for t in tails]) for i, label in
                enumerate(("the first mask sampled (without a warm-up: the first call too)", "the later masks",
                          "the last files written, exit"))]
        lines += phase_table(sampling, rows, SAMPLE_PHASES, [*tail, ("total", [r["total_s"] for r in rows])])
    if "first_step_s" in (row := run.ok("e2e.train_first_step_warm") or {}):
        lines += phase_table(["e2e.train_first_step_warm"], [row], TRAIN_PHASES,
                             [("to the first step", [row["time_to_first_step_s"]])])
    return lines


def brats_table(run: Run) -> list[str]:
    row = run.ok(BRATS)
    lines = ["| job | recipes | a volume | peak GiB |", "| --- | --- | --- | --- |"]
    if row is None:
        return lines + [f"| `{BRATS}` | {run.status_note(BRATS)} | | |", ""]
    mem = sig(row["peak_mem_gib"], 3) if row.get("peak_mem_gib") is not None else ""
    return lines + [f"| `{BRATS}` | {'+'.join(row.get('recipes') or [])} | {fmt_ms(run.ms_per_volume(BRATS))} | "
                    f"{mem} |", ""]


def counters_table(run: Run) -> list[str]:
    """The counters factors of each stack against the run's strict FP32, under the study's A100 claims."""
    base = run.ok(COUNTERS_BASE)
    lines = ["| stack | " + " | ".join(COUNTER_COLUMNS) + " |", "|" + " --- |" * 6,
             study_line()]
    for job in (COUNTERS_BASE, *COUNTERS):
        if run.ok(job) is None or base is None:
            lines.append(f"| `{job}` | {run.status_note(job) if run.ok(job) is None else 'no strict-FP32 row'} |"
                         + " |" * 4)
        else:
            lines.append(f"| `{job}` | " + " | ".join(counter_cells(base, run.ok(job))) + " |")
    return lines + [""]


def job_list(jobs: Sequence[str]) -> str:
    """``a.s``, ``b.s`` as `` `{a,b}.s` `` where every job has one stack suffix, else each named."""
    stacks = {job.rpartition(".")[2] for job in jobs}
    if len(jobs) > 1 and len(stacks) == 1:
        return f"`{{{','.join(job.rpartition('.')[0] for job in jobs)}}}.{stacks.pop()}`"
    return ", ".join(f"`{job}`" for job in jobs)


def time_table(run: Run) -> list[str]:
    """Each measurement's wall seconds in the order run (a process's rows share one), and their sum: what the run's
    jobs took on this GPU, start-up and compilation included; the ladder's own seconds between jobs are not in rows."""
    spans: dict[float, list[str]] = {}
    for job, row in run.jobs.items():
        wall = row.get("wall_s") if row.get("wall_s") is not None else row.get("ncu_wall_s")
        if wall is not None:
            spans.setdefault(float(wall), []).append(job)
    total = sum(spans)
    lines = ["| rows of one measurement | wall s |", "| --- | --- |"]
    lines += [f"| {job_list(jobs)} | {wall:.1f} |" for wall, jobs in spans.items()]
    lines += [f"| all {len(spans)} | {total:.1f} ({total / 60:.1f} min) |", ""]
    launches: dict[str, float] = {}
    for row in run.jobs.values():
        if row.get("launch") is not None and row.get("launch_s") is not None:
            launches[row["launch"]] = max(launches.get(row["launch"], 0.0), float(row["launch_s"]))
    if launches:
        spans_said = ", ".join(f"`{launch}` {seconds:.1f} s" for launch, seconds in launches.items())
        lines += [f"Launches of `bench.ladder` (start to the last row, its own time between jobs included): "
                  f"{spans_said}.", ""]
    return lines


def gate_files(run: Run, page_dir: Path) -> str:
    """Where the page's verdicts come from: the folder's gate files, or that it has none."""
    quality = run.folder / QUALITY_DIR
    if not quality.is_dir():
        return f"Quality verdicts: this folder has no gate files (no `{QUALITY_DIR}/`)"
    return f"Quality verdicts are read from the gate's files in {link(quality, page_dir, QUALITY_DIR + '/')}"


def gpu_page(run: Run, gates: Gates, page_dir: Path, plan: bool = False) -> str:
    """The whole page of one GPU folder's run; with ``plan``, the 128³ quality model's plan priced from it (on the
    page of the GPU the README shows: one plan, not one per GPU)."""
    named = set(run.jobs) - {f"{w}.{s}" for w in WORKLOADS for s in STACKS} - set(E2E) - {BRATS, COUNTERS_BASE,
                                                                                             *COUNTERS}
    lines = [f"# Results: {run.device} ({run.folder.as_posix()})", "",
             f"Generated by `python -m bench.report publish=true` from the rows of "
             f"{link(run.folder / RESULTS_FILE, page_dir, 'results.jsonl')}; nothing here is typed. "
             f"The tables use {runs_note(run)}. Environment: {env_summary(list(run.jobs.values()))}.", "",
             f"{READING} {gate_files(run, page_dir)} (`not gated`: no gate ran that stack on this GPU; `reference`: "
             "strict FP32, what the gate compares against).", ""]
    if run.skipped:
        lines += [f"{len(run.skipped)} line(s) of results.jsonl cut short (a run killed while writing a row), left "
                  "out: "
                  + ", ".join(f"`{s}`" for s in run.skipped), ""]
    lines += ["## Step benchmarks", "", *step_table(run, gates, page_dir),
              "## The real commands, from process start", "", *e2e_table(run), *startup_tables(run),
              "## BraTS, the memory stack", "", *brats_table(run),
              "## Hardware counters against the study's claims", "",
              "Nsight Compute on the 128³ sampler step, library kernels; factors against `counters.strict_fp32`.", "",
              *counters_table(run),
              *(plan_lines(run) if plan else []),
              "## The run's time", "", *time_table(run)]
    if named:
        lines += [f"The run also holds rows of jobs outside these tables: {', '.join(sorted(named))}.", ""]
    return "\n".join(lines)


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
    """How one stack's time differs between the GPUs (the times are in the table below the sentence):
    ``shipped` 1.08× as fast on the H200 as on the H100``."""
    spread = differs(times)
    if spread is None:
        return None
    slow, fast, ratio = spread
    if ratio < 1 + SAME:
        return f"`{stack}` the same within 5 %"
    return f"`{stack}` {sig(ratio, 3)}× as fast on the {fast} as on the {slow}"


def gain_clause(baseline: str, gains: dict[str, float]) -> str | None:
    """How the shipped stack's speed-up over ``baseline`` differs between the GPUs."""
    spread = differs(gains)
    if spread is None:
        return None
    high, low, ratio = spread
    if ratio < 1 + SAME:
        return f"`shipped` over `{baseline}` the same within 5 %"
    return f"`shipped` gains more over `{baseline}` on the {high}"


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


def step_side_by_side(runs: Sequence[Run], gates: dict[str, Gates]) -> list[str]:
    """Every step job of the contract, one row each, one group of columns per GPU."""
    lines = ["## Step benchmarks", "", captions(runs), "",
             *header("job", ("time", "vs strict_fp32", "vs torch_defaults", "quality"), runs)]
    for workload in WORKLOADS:
        for stack in STACKS:
            job = f"{workload}.{stack}"
            lines.append("| " + " | ".join([f"`{job}`", *(c for r in runs for c in stack_cells(r, gates[r.gpu], job))])
                         + " |")
    return lines + [""]


def code_differs(runs: Sequence[Run]) -> list[str]:
    """A caution when the GPUs' runs are of different code: the commands' start-up changes with it, not only with
    the GPU."""
    if len({tuple(r.commits) for r in runs}) < 2:
        return []
    return ["The runs are of different commits: a difference between these columns may come from the code as well "
            "as from the GPU.", ""]


def e2e_side_by_side(runs: Sequence[Run]) -> list[str]:
    lines = ["## The real commands, from process start", "", *code_differs(runs),
             *header("job", ("", "step beside it, a volume"), runs)]
    for job, spec in E2E.items():
        cells = [f"`{job}` ({spec.what}; target {target(job)})"]
        for r in runs:
            cells += [", ".join(filter(None, (e2e_cell(r, job), met(r, job)))) if r.ok(job) else r.status_note(job),
                      f"`{spec.step}` {fmt_ms(r.ms_per_volume(spec.step))}" if r.ms(spec.step) else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def brats_side_by_side(runs: Sequence[Run]) -> list[str]:
    lines = ["## BraTS, the memory stack", "", f"| GPU | `{BRATS}`, a volume | peak GiB |",
             "| --- | --- | --- |"]
    for r in runs:
        row = r.ok(BRATS)
        mem = sig(row["peak_mem_gib"], 3) if row and row.get("peak_mem_gib") is not None else ""
        lines.append(f"| {r.gpu} | {fmt_ms(r.ms_per_volume(BRATS)) if row else r.status_note(BRATS)} | {mem} |")
    return lines + [""]


def counters_side_by_side(runs: Sequence[Run]) -> list[str]:
    lines = ["## Hardware counters against the study's A100 claims", "",
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
             f"{sources}.", ""]
    if len(runs) < 2:  # nothing to set side by side: the one page holds every table
        return "\n".join(lines + [f"Only the {runs[0].gpu} has an evidence run among the GPU folders (`gpus`): its "
                                  f"tables are on {link(page_dir / (runs[0].folder.name + '.md'), page_dir, 'its page')}.",
                                  "", f"{counters_sentence(runs)}", ""])
    lines += [f"{READING} Quality verdicts are each GPU's own gate files (`not gated`: none ran that stack there); the "
              "pages per GPU say which file each comes from.", ""]
    lines += ["## Where the generations differ", "",
             *(f"- {workload_sentence(w, runs)}" for w in WORKLOADS), f"- {counters_sentence(runs)}", ""]
    return "\n".join(lines + step_side_by_side(runs, gates) + e2e_side_by_side(runs) + brats_side_by_side(runs)
                     + counters_side_by_side(runs))


BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
GPUS_PAGE = "gpus.md"


def replace_block(text: str, block: str, path: Path) -> str:
    """``text`` with what stands between its two markers replaced by ``block``; refused without both, in order."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise DataError(f"{path}: needs one {BEGIN} line, then one {END} line, around its results table; put "
                        "them where the table goes")
    head, rest = text.split(BEGIN)
    return f"{head}{BEGIN}\n{block}{END}{rest.split(END)[1]}"


def choose_runs(folders: Sequence[Path], wanted: Sequence[str]) -> list[Run]:
    """One run per folder (:func:`choose_run`); a ``run=`` id that no folder holds is refused."""
    runs = [choose_run(folder, wanted) for folder in folders]
    unknown = sorted(set(wanted) - {r.run_id for r in runs})
    if unknown:
        raise ConfigError(f"run={','.join(unknown)}: no evidence run of that id in {', '.join(map(str, folders))}; "
                          "pass a run id of their results.jsonl (a row's run_id), or leave run= out for each "
                          "folder's newest complete run")
    return runs


def render(folders: Sequence[Path], docs: Path, readme: Path | None, readme_gpu: str | None,
           wanted: Sequence[str]) -> tuple[list[Run], dict[Path, str]]:
    """The runs and every page's text by path: each folder's page, and with ``readme`` gpus.md and the README."""
    runs = choose_runs(folders, wanted)
    gates = {r.gpu: Gates.read(r.folder) for r in runs}
    pages = {docs / f"{r.folder.name}.md": gpu_page(r, gates[r.gpu], docs, r.folder.name == readme_gpu)
             for r in runs}
    if readme is None:
        return runs, pages
    pages[docs / GPUS_PAGE] = gpus_page(runs, gates, docs)
    shown = next((r for r in runs if r.folder.name == readme_gpu), None)
    if shown is None:
        raise ConfigError(f"readme_gpu={readme_gpu}: not a folder of gpus ({', '.join(f.name for f in folders)}); "
                          "pass the name of the folder whose run the README shows")
    if not readme.is_file():
        raise DataError(f"{readme}: not found; pass readme=<the page holding the {BEGIN} markers>")
    table = readme_table(shown, gates[shown.gpu], readme.parent, docs / f"{shown.folder.name}.md")
    pages[readme] = replace_block(readme.read_text(encoding="utf-8"), table, readme)
    return runs, pages


def publish(folders: Sequence[Path], docs: Path, readme: Path | None = None, readme_gpu: str | None = None,
            wanted: Sequence[str] = ()) -> list[str]:
    """Render every page, then write them; returns the lines to print: each folder's run, each page written."""
    runs, pages = render(folders, docs, readme, readme_gpu, wanted)
    for path, text in pages.items():
        atomic_write_text(path, text if text.endswith("\n") else text + "\n")
    return [f"{r.folder}: {runs_note(r)}" for r in runs] + [f"wrote {path}" for path in pages]


def run_ids(value: object) -> list[str]:
    """``run=`` as a list: one id (``run=ID``), a list (``run=[ID1,ID2]``) or none (``run=[]``, ``run=null``)."""
    if value is None:
        return []
    if isinstance(value, ListConfig | list | tuple):
        return [str(v) for v in value]
    return [str(value)]


def from_config(cfg: DictConfig) -> list[str]:
    """``publish=true``: ``dir=FOLDER`` writes that folder's page; without ``dir``, every folder of ``gpus``, gpus.md
    and the README's table."""
    if not cfg.gpus:
        raise ConfigError("gpus: is empty; pass gpus=[bench/results/h100,...], the GPU folders to publish")
    one = not OmegaConf.is_missing(cfg, "dir") and cfg.dir is not None
    folders = [Path(cfg.dir)] if one else [Path(f) for f in cfg.gpus]
    readme = None if one else Path(cfg.readme)
    return publish(folders, Path(cfg.docs), readme, str(cfg.readme_gpu), run_ids(cfg.run))
