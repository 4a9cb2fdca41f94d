"""Turn a sweep's results.jsonl into report.md, report.csv and PNGs.

Example:
    python -m bench.report dir=results/bench/2026-01-01_12-00-00
    python -m bench.report dir=results/h200 wandb=true     # also each row not yet logged as an offline W&B run
    python -m bench.report publish=true                    # the evidence pages: docs/results/*.md, README table
    python -m bench.report dir=bench/results/h200 publish=true   # docs/results/h200.md alone

``publish=true`` renders the evidence pages of :mod:`bench.reporting` (one run per GPU folder) instead of the
report below.

A results file may hold many runs (a sweep directory reused, a ladder resumed, rows from
several machines). Every row carries the ``run_id`` of the launch that wrote it and its commit
(:mod:`bench.core.records`). Speed-up and memory are against the strict-FP32 row (``recipes == []``)
of the same workload (scenario, model, size, batch, sampler, steps) in the *same run*; a row
whose run has no such baseline gets no speed-up rather than one across runs.

report.md shows, per workload, the latest row of each stack (job) with its commit: the
headline tables. A row of unknown provenance (no run id, as in results files written before
run ids existed, or no known commit) is never a headline: it is listed apart, labelled, with
its own numbers unchanged and no speed-up unless its run has a baseline. report.csv has every
row. Failed jobs (oom, nan, unsupported, error) stay in the tables with their status and message. A recipe inert on
the row's device (``tf32`` on a CPU) is named in the message; a row whose recipes are all inert timed the baseline's
computation again and gets no speed-up. The quality
column reads ``not gated``, or the gate's verdict with its N and ``random weights`` when it had no checkpoint. A
workload's heading names its world size (bench.ddp rows, with their scaling efficiency) and gradient accumulation.
A line of results.jsonl cut short (a run killed while writing it) is left out, named on stderr and in a note at the
top of report.md; any other line that is no JSON row is refused in one line naming it.
quality.md (when the gate ran): for the latest gated row of each job, every check of the gate with its
status, value, p-value, null quantiles (distribution checks) or limits, and the gate's minimum detectable
eps bias, so a verdict can be read back to the check that decided it.
e2e.md (a ``preset=e2e`` folder: the real commands' rows, :mod:`bench.core.e2e`; report.md then points to it).
training.md (a ``preset=quality_training`` folder): the arms, the training verdict and its checks
(:mod:`bench.quality.training_report`).
PNGs (headline rows; no speed-up plots for strict-FP32 rows alone): speed-up per stack, speed-up vs the
quality gate's number with the Pareto front marked (when the gate ran), model calls vs the gate's worst
distribution p-value of the gated sampling rows, and throughput vs batch size (when there are several).
"""

from __future__ import annotations

import csv
import io
import math
import re
import sys
import textwrap
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from bench.core.e2e import write_page as write_e2e_page
from bench.core.records import (
    UNKNOWN,
    baseline_key,
    code_label,
    is_baseline,
    job_key,
    read_results,
    recipe_label,
)
from bench.core.wandb_runs import publish_unlogged
from bench.quality.training_report import write_training_report
from bench.reporting.evidence import env_summary
from bench.reporting.pages import from_config as publish_from_config
from bench.reporting.verdicts import gate_notes
from med_ddpm import cli
from med_ddpm.config_checks import ConfigError
from med_ddpm.tracking import LOGGED_FILE, check_logger
from med_ddpm.utils import atomic_write_text, save_figure

COLUMNS = ("scenario", "model", "batch_size", "grad_accum", "world_size", "sampler", "steps", "recipes", "status", "ms_median", "ms_p10",
           "ms_p90", "iqr_pct", "speedup", "peak_mem_gib", "mem_vs_baseline", "volumes_per_s",
           "scaling_efficiency", "tflops", "peak_fraction", "precision", "compile_s", "quality", "quality_value", "code", "run_id", "message")
LEGACY_RUN = "legacy (no run id)"
DIR_FIX = "pass dir=<a sweep folder holding results.jsonl>"
QUALITY_METRIC = "x0_nrmse"  # gate number on the x-axis of the Pareto plot (lower is better)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def quality_label(row: dict[str, Any]) -> str:
    """The ``quality`` cell: ``not gated``, else the gate's verdict with its notes (:func:`gate_notes`)."""
    gate = row.get("quality")
    if not gate:
        return "not gated"
    notes = gate_notes(row)
    return f"{gate.get('verdict')} ({', '.join(notes)})" if notes else str(gate.get("verdict"))


def _quality_value(row: dict[str, Any], metric: str) -> float | None:
    value = ((row.get("quality") or {}).get("metrics") or {}).get(metric)
    return float(value) if value is not None else None


def worst_distribution_p(row: dict[str, Any]) -> float | None:
    """The smallest permutation p-value of the row's distribution checks (the one that decides a sampler's verdict:
    small means its samples are told apart from DDPM-250's), or None when the gate ran none. The gate writes each
    check's kind and p-value under ``quality.checks``."""
    checks = (row.get("quality") or {}).get("checks") or {}
    p = [c["p_value"] for c in checks.values() if c.get("kind") == "distribution" and c.get("p_value") is not None]
    return min(p) if p else None


def short_sampler(label: str | None) -> str:
    """A row's sampler label with an explicit grid cut to its ends (``timesteps=[249, 246, …, 1]``), for titles and
    plot labels; the row keeps the whole grid."""
    def cut(match: re.Match) -> str:
        points = match.group(1).split(", ")
        return f"timesteps=[{', '.join(points[:2])}, …, {points[-1]}]" if len(points) > 4 else match.group(0)
    return re.sub(r"timesteps=\[([^\]]*)\]", cut, label or "")


def known_provenance(row: dict[str, Any]) -> bool:
    """A row may be a headline: it has a run id and a known commit."""
    return bool(row.get("run_id")) and row.get("git_sha") not in (None, UNKNOWN)


def same_run_baselines(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(run id, workload) -> that run's successful strict-FP32 row (its latest, if it has several).
    Rows without a run id have no run to match, so no baseline."""
    return {(row["run_id"], baseline_key(row)): row for row in rows
            if row.get("run_id") and is_baseline(row) and row.get("status") == "ok"}


def inert_note(row: dict[str, Any]) -> str:
    """Names the row's recipes that change nothing on its device (their ``acts_on`` leaves it out), or ``""``."""
    inert = row.get("inert_recipes") or []
    if not inert:
        return ""
    where = str((row.get("env") or {}).get("device") or "this device").split(":")[0]
    return f"inert on {where}: {', '.join(inert)}"


def all_inert(row: dict[str, Any]) -> bool:
    """Every recipe of the row is inert on its device: it timed the baseline's computation again, so its
    ratio is noise and is not shown."""
    return bool(row.get("inert_recipes")) and len(row["inert_recipes"]) == len(row.get("recipes") or [])


def report_rows(rows: list[dict[str, Any]], metric: str = QUALITY_METRIC) -> list[dict[str, Any]]:
    """Rows of the report table: each job with its speed-up and memory vs its own run's baseline."""
    baselines = same_run_baselines(rows)
    latest = {job_key(row): n for n, row in enumerate(rows) if known_provenance(row)}
    out = []
    for n, row in enumerate(rows):
        base = baselines.get((row.get("run_id"), baseline_key(row)))
        ok = row.get("status") == "ok"
        timed = base and ok and not all_inert(row)
        out.append({
            **{k: row.get(k) for k in COLUMNS},
            "recipes": recipe_label(row),
            "speedup": _ratio(base["ms_median"], row.get("ms_median")) if timed else None,
            "mem_vs_baseline": _ratio(row.get("peak_mem_gib"), base.get("peak_mem_gib")) if base and ok else None,
            "quality": quality_label(row),
            "verdict": (row.get("quality") or {}).get("verdict"),
            "quality_value": _quality_value(row, metric),
            "code": code_label(row),
            "run_id": row.get("run_id") or LEGACY_RUN,
            "message": inert_note(row) if ok else (row.get("message") or "").splitlines()[0][:120] if row.get("message") else "",
            "has_baseline": base is not None,
            "baseline": is_baseline(row),
            "headline": latest.get(job_key(row)) == n,
        })
    return out


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value).replace("|", "\\|")


def to_csv(table: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=[*COLUMNS, "verdict", "has_baseline", "baseline", "headline"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(table)
    return buf.getvalue()


SHOWN = ("recipes", "status", "ms_median", "ms_p10", "ms_p90", "iqr_pct", "speedup", "peak_mem_gib",
         "mem_vs_baseline", "volumes_per_s", "tflops", "peak_fraction", "compile_s", "quality", "code", "run_id",
         "message")


def workload_title(head: dict[str, Any]) -> str:
    """A workload's heading: the identity fields that tell two workloads of one model apart."""
    what = f"{head['scenario']} · {head['model']} · batch {head['batch_size']}"
    if head.get("grad_accum") not in (None, 1):
        what += f" · grad accum {head['grad_accum']}"
    if head.get("world_size") is not None:
        what += f" · world {head['world_size']}"
    if head.get("sampler"):
        what += f" · {head['sampler']} {head['steps']} steps"
    return what


def shown_columns(rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """SHOWN, with ``scaling_efficiency`` after ``volumes_per_s`` when a row has one (bench.ddp)."""
    if all(r["scaling_efficiency"] is None for r in rows):
        return SHOWN
    at = SHOWN.index("volumes_per_s") + 1
    return (*SHOWN[:at], "scaling_efficiency", *SHOWN[at:])


def _workload_tables(table: list[dict[str, Any]], level: str) -> list[str]:
    """One markdown table per workload, baseline first, then by speed-up."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in table:
        groups[baseline_key(r)].append(r)
    lines = []
    for rs in groups.values():
        lines += [f"{level} {workload_title(rs[0])}", ""]
        if not any(r["has_baseline"] for r in rs):
            lines += ["_No successful strict-FP32 row of the same run: no speed-ups._", ""]
        rs = sorted(rs, key=lambda r: (r["recipes"] != "[] (fp32)", -(r["speedup"] or 0)))
        columns = shown_columns(rs)
        lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_fmt(r[c]) for c in columns) + " |" for r in rs]
        lines.append("")
    return lines


def skipped_note(skipped: Sequence[str]) -> list[str]:
    """The lines of results.jsonl cut short, named where nobody misses them (none: no note)."""
    if not skipped:
        return []
    return [f"**{len(skipped)} line(s) of results.jsonl cut short** (a run killed while writing a row): their rows "
            "are in no table below and not in report.csv; rerun their jobs.", "",
            *(f"- `{line}`" for line in skipped), ""]


def to_markdown(table: list[dict[str, Any]], rows: list[dict[str, Any]], skipped: Sequence[str] = (),
                e2e_page: Path | None = None) -> str:
    """The note of ``skipped`` lines, the headline tables (latest row per stack, known provenance), then the rows of
    unknown provenance; a folder of end-to-end rows points to their page instead of empty tables."""
    if e2e_page is not None and not rows:
        return "\n".join(["# Benchmark report", "", *skipped_note(skipped),
                          f"This folder holds end-to-end rows of the real commands: every row is in [{e2e_page.name}]"
                          f"({e2e_page.name}).", ""])
    headline = [r for r in table if r["headline"]]
    unknown = [r for r, row in zip(table, rows) if not known_provenance(row)]
    shown_rows = [row for r, row in zip(table, rows) if r["headline"]] or rows
    lines = ["# Benchmark report", "", *skipped_note(skipped), f"Environment: {env_summary(shown_rows)}.", "",
             "The latest row of each stack per workload, with its commit (`code`) and run. Speed-up and memory "
             "are relative to the strict-FP32 row (`[] (fp32)`) of the same workload in the same run; times are "
             "per call in ms (median, p10, p90; IQR as % of the median). Older rows are in report.csv.", ""]
    lines += _workload_tables(headline, "##") if headline else ["_No rows of known provenance._", ""]
    if unknown:
        lines += ["## Rows of unknown provenance (not in the tables above)", "",
                  "These rows have no run id (written before run ids existed) or no known commit: their numbers "
                  "are as measured, but they cannot be tied to a commit, and a speed-up is shown only against a "
                  "baseline of the same run.", ""]
        lines += _workload_tables(unknown, "###")
    return "\n".join(lines)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of points (quality distance: lower better, speed-up: higher better) nobody dominates."""
    front = []
    for i, (q, s) in enumerate(points):
        dominated = any(q2 <= q and s2 >= s and (q2 < q or s2 > s) for j, (q2, s2) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return front


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def timed_stacks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with a speed-up, or none when no recipe stack is among them: rows of strict FP32 alone (two
    trained models gated against each other) have no speed-up to show."""
    rows = [r for r in rows if r["speedup"] is not None]
    return rows if any(not r["baseline"] for r in rows) else []


def plot_speedups(table: list[dict[str, Any]], path: Path) -> Path | None:
    """Horizontal bars: speed-up of every successful stack, one colour per workload."""
    rows = timed_stacks(table)
    if not rows:
        return None
    plt = _figure()
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(rows) + 1.5))
    labels = [f"{r['scenario']} b{r['batch_size']} {r['recipes']}" for r in rows]
    ax.barh(range(len(rows)), [r["speedup"] for r in rows], color="tab:blue")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("speed-up vs strict FP32 (same workload)")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return path


def plot_pareto(table: list[dict[str, Any]], path: Path, metric: str = QUALITY_METRIC) -> Path | None:
    """Speed-up vs the gate's quality distance; the Pareto front is joined and ringed."""
    rows = [r for r in timed_stacks(table) if r["quality_value"] is not None and math.isfinite(r["quality_value"])]
    if not rows:
        return None
    points = [(max(r["quality_value"], 1e-12), r["speedup"]) for r in rows]
    return _front_plot(points, rows, [r["recipes"] for r in rows], path,
                       (f"{metric} vs strict-FP32 reference (lower is better)", "speed-up vs strict FP32"))


def plot_calls(rows: list[dict[str, Any]], table: list[dict[str, Any]], path: Path) -> Path | None:
    """Model calls (sampler steps) vs the worst distribution p-value of each gated sampling row (headline rows);
    the front of fewest calls at the highest p is joined and ringed."""
    pairs = [(r, t) for r, t in zip(rows, table) if t["headline"] and r.get("scenario") == "full_sample"
             and r.get("steps") and worst_distribution_p(r) is not None]
    if not pairs:
        return None
    points = [(float(r["steps"]), max(worst_distribution_p(r), 1e-6)) for r, _ in pairs]
    shown = [t for _, t in pairs]
    return _front_plot(points, shown, [short_sampler(t["sampler"]) for t in shown], path,
                       ("model calls per sample",
                        "worst distribution-check p-value vs DDPM-250 (higher: closer)"), log_y=True)


def _front_plot(points: list[tuple[float, float]], rows: list[dict[str, Any]], labels: list[str], path: Path,
                axis_labels: tuple[str, str], log_y: bool = False) -> Path:
    """Points (x lower better, y higher better) coloured by verdict; the Pareto front joined, ringed. Each point is
    numbered and its label listed beside the axes, so points that coincide (p-values at the permutation floor)
    stay readable."""
    plt = _figure()
    front = sorted(pareto_front(points), key=lambda i: points[i][0])
    colours = {"pass": "tab:green", "warn": "tab:orange", "fail": "tab:red"}
    fig, (ax, key) = plt.subplots(1, 2, figsize=(12, 5), gridspec_kw={"width_ratios": [3, 2]})
    stacked: dict[tuple[float, float], int] = defaultdict(int)  # points already numbered at a position
    for n, ((x, y), r) in enumerate(zip(points, rows), 1):
        ax.scatter(x, y, color=colours.get(r["verdict"], "tab:gray"))
        ax.annotate(str(n), (x, y), fontsize=7, xytext=(4, 3 + 8 * stacked[(x, y)]), textcoords="offset points")
        stacked[(x, y)] += 1
    ax.plot([points[i][0] for i in front], [points[i][1] for i in front], "k--", lw=0.8, label="Pareto front")
    ax.scatter([points[i][0] for i in front], [points[i][1] for i in front], s=120, facecolors="none",
               edgecolors="k")
    ax.set_xscale("log")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(axis_labels[0])
    ax.set_ylabel(axis_labels[1])
    ax.legend()
    key.axis("off")
    key.text(0, 1, "\n".join(f"{n}. {textwrap.shorten(label, 70)} ({r['verdict'] or 'no verdict'})"
                              for n, (label, r) in enumerate(zip(labels, rows), 1)),
             fontsize=7, va="top", family="monospace", transform=key.transAxes)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return path


def plot_throughput(table: list[dict[str, Any]], path: Path) -> Path | None:
    """Volumes/s vs batch size per (scenario, stack), where a sweep has several batch sizes."""
    series: dict[tuple[str, str, str], dict[int, float]] = defaultdict(dict)
    for r in table:
        if r["status"] == "ok" and r["volumes_per_s"]:
            series[(r["scenario"], r["model"], r["recipes"])][int(r["batch_size"])] = r["volumes_per_s"]
    series = {k: v for k, v in series.items() if len(v) > 1}
    if not series:
        return None
    plt = _figure()
    fig, ax = plt.subplots(figsize=(9, 5 + 0.35 * len(series)))
    for (scenario, model, recipes), points in sorted(series.items()):
        batches = sorted(points)
        label = textwrap.fill(f"{scenario} {model} {recipes}", 110, subsequent_indent="    ", break_long_words=False)
        ax.plot(batches, [points[b] for b in batches], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("volumes / s")
    ax.set_ylim(bottom=0)
    # below the axes: long stack names would otherwise squeeze the plot and hide lines
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
    return path


QUALITY_HEADER = ("| check | kind | status | value | p-value | null q05 / q50 / q95 | pass / warn or fail limit |\n"
                  "| --- | --- | --- | --- | --- | --- | --- |")


def _check_line(name: str, check: dict[str, Any]) -> str:
    null = check.get("null_quantiles") or {}
    quantiles = " / ".join(_fmt(null.get(q)) for q in ("q05", "q50", "q95")) if null else ""
    limits = " / ".join(_fmt(check.get(k)) for k in ("pass_limit", "warn_limit", "fail_limit") if k in check)
    return (f"| {name} | {check.get('kind', '')} | {check.get('status', '')} | {_fmt(check.get('value'))} | "
            f"{_fmt(check.get('p_value'))} | {quantiles} | {limits} |")


def smallest_failed(q: dict[str, Any]) -> str:
    """The smallest ε bias and noise the gate's controls failed, each where the row has it (a row of older code may
    carry no noise control), as ``"smallest eps bias failed 0.015, ...; "``."""
    found = [f"smallest eps {kind} failed {_fmt(q[key])}" for kind, key in
             (("bias", "min_detectable_eps_bias"), ("noise", "min_detectable_eps_noise")) if q.get(key) is not None]
    text = ", ".join(found)
    return f"{text}; " if text else ""


def quality_markdown(rows: list[dict[str, Any]]) -> str | None:
    """Every check of the latest gated row of each job (None when no row was gated)."""
    latest = {job_key(r): r for r in rows if known_provenance(r) and ((r.get("quality") or {}).get("checks"))}
    if not latest:
        return None
    lines = ["# Quality gate: every check of each gated row", "",
             "The latest gated row of each job. Bias checks: sign-flip p-value; distribution checks: permutation "
             "p-value against the null of the reference against itself at the same N (docs/quality.md).", ""]
    for row in latest.values():
        q = row["quality"]
        candidate = q.get("candidate_sampler") or {}
        sampler = (f" · {short_sampler(row['sampler'])}, {candidate.get('calls')} model calls" if row.get("sampler")
                   else f" · {candidate['name']}" if candidate.get("name") else "")  # e.g. probes only
        lines += [f"## {row.get('scenario')} · {recipe_label(row)}{sampler}: "
                  f"**{q.get('verdict')}**", "",
                  f"N = {q.get('n_samples')} ({q.get('n_masks')} masks), paired: {q.get('paired')}, "
                  f"{smallest_failed(q)}code {code_label(row)}, run {row.get('run_id')}.", "", QUALITY_HEADER]
        lines += [_check_line(name, check) for name, check in q["checks"].items()]
        lines.append("")
    return "\n".join(lines)


def write_report(sweep_dir: Path, metric: str = QUALITY_METRIC, wandb: bool = False,
                 wandb_mode: str = "offline") -> Path:
    """report.md, report.csv and the PNGs for ``sweep_dir``; returns the markdown path. A line cut short is named on
    stderr, one line each. ``wandb``: also log each row not logged yet as its own W&B run
    (:mod:`bench.core.wandb_runs`)."""
    rows, skipped = read_results(sweep_dir)
    for line in skipped:
        print(f"warning: {sweep_dir / line}: cut short (a run killed while writing it), left out; the report holds "
              f"the {len(rows)} complete rows", file=sys.stderr)
    e2e_page = write_e2e_page(sweep_dir, rows)  # the real commands' rows have their own columns
    measured, rows = rows, [row for row in rows if not row.get("e2e")]
    table = report_rows(rows, metric)
    headline = [r for r in table if r["headline"]]
    images = [p for p in (plot_speedups(headline, sweep_dir / "speedup.png"),
                          plot_pareto(headline, sweep_dir / "speedup_vs_quality.png", metric),
                          plot_calls(rows, table, sweep_dir / "calls_vs_quality.png"),
                          plot_throughput(headline, sweep_dir / "throughput_vs_batch.png")) if p]
    markdown = to_markdown(table, rows, skipped, e2e_page) + "".join(f"\n![{p.stem}]({p.name})\n" for p in images)
    atomic_write_text(sweep_dir / "report.csv", to_csv(table))
    quality = quality_markdown(rows)
    if quality:
        atomic_write_text(sweep_dir / "quality.md", quality)
    write_training_report(sweep_dir)
    md = atomic_write_text(sweep_dir / "report.md", markdown)
    if wandb:
        published = publish_unlogged(sweep_dir, measured, wandb_mode)
        print(f"W&B: {len(published)} row(s) logged as runs ({wandb_mode}) in {sweep_dir / 'wandb'}; rows logged "
              f"before are listed in {sweep_dir / LOGGED_FILE}")
    return md


def results_folder(cfg: DictConfig) -> Path:
    """``dir=``, refused unset or a file before anything is written (Hydra's run dir is the working directory,
    left untouched; a folder without results.jsonl is refused by :func:`bench.core.records.read_results`)."""
    if OmegaConf.is_missing(cfg, "dir"):
        raise ConfigError(f"dir: has no value; {DIR_FIX}")
    folder = Path(cfg.dir)
    if folder.is_file():
        raise ConfigError(f"dir={folder}: is a file, not a folder; {DIR_FIX}")
    return folder


@hydra.main(config_path=cli.CONFIG_PATH, config_name="report", version_base="1.3")
@cli.entry
def main(cfg: DictConfig) -> None:
    if cfg.publish:
        print("\n".join(publish_from_config(cfg)))
        return
    folder = results_folder(cfg)
    if cfg.wandb:
        check_logger({"name": "wandb", "mode": cfg.wandb_mode, "dir": str(folder)})
    print(write_report(folder, cfg.metric, cfg.wandb, cfg.wandb_mode))


console = cli.console(main)  # the med-ddpm-report command


if __name__ == "__main__":
    console()
