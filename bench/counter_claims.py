"""The study's counter claims against this GPU's counters: ``counters.md`` and ``counters_claims.png``.

The seed study's claims about TF32 plus a channels-last 3-D layout on the A100 are in
:mod:`bench.reporting.evidence`, with the factors that set a stack against them (reductions of kernel time, SM
cycles and instructions, tensor-pipe ratio, IPC change). For every workload (scenario, size, batch) in a
``counters.jsonl``, each stack is set against the strict-FP32 row of the same file, so of the same run (a page
built from several folders, one device call each, marks a stack measured in another run than its baseline: that
factor is not a same-run ratio; a stack profiled with another ``counters.kernel_filter`` than its baseline is
marked too: its factors compare other kernels).

Then, per stack, where its kernel time goes by category with each category's counters, and ncu's
rule-estimated savings when they were collected.

Example:
    python -m bench.counter_claims results/counters/2026-12-04_10-00-00
    python -m bench.counter_claims bench/results/h200/counters denoise128 train64_same_call   # one page, several calls
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.core.records import baseline_key, code_label, is_baseline, read_rows, recipe_label
from bench.reporting.evidence import CLAIM_FACTOR, STUDY, compare
from med_ddpm.utils import atomic_write_text, save_figure

ROWS_FILE = "counters.jsonl"
MARKDOWN, PLOT = "counters.md", "counters_claims.png"


def stack_label(row: dict[str, Any]) -> str:
    """The recipe label (``fp32`` for none), after the experiment that chose it (``fast_train: amp_bf16+...``)."""
    label = recipe_label(row, baseline="fp32")
    return f"{row['experiment']}: {label}" if row.get("experiment") else label


def workload_title(row: dict[str, Any]) -> str:
    size = "x".join(str(s) for s in row["image_size"])
    sampler = f", {row['sampler']} {row['steps']} steps" if row.get("sampler") else ""
    return f"{row['scenario']} {size}, batch {row['batch_size']}{sampler}"


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3g}x"


def _pct(v: float | None, signed: bool = False) -> str:
    return "n/a" if v is None else f"{v:+.1%}" if signed else f"{v:.2f} %"


def _m(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 1e6:,.1f}"


def workloads(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Ok rows grouped by workload, in file order; the last row of a stack wins."""
    groups: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        if row.get("status") == "ok" and row.get("counters"):
            groups[baseline_key(row)][stack_label(row)] = row
    return {key: list(stacks.values()) for key, stacks in groups.items()}


def baseline_of(stacks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The strict-FP32 (no recipe) row among one workload's rows, or None."""
    return next((r for r in stacks if is_baseline(r)), None)


def other_run(row: dict[str, Any], base: dict[str, Any]) -> str | None:
    """Where ``row`` was measured when not in ``base``'s run: its folder (one device call each, :func:`read_calls`)
    or its run id; None for the same run."""
    if row.get("call") != base.get("call"):
        return f"another call: {row['call']}"
    if row.get("run_id") and base.get("run_id") and row["run_id"] != base["run_id"]:
        return f"another run: {row['run_id']}"
    return None


def other_kernels(row: dict[str, Any], base: dict[str, Any]) -> str | None:
    """Which kernels ``row`` profiled when ``base`` was filtered otherwise (``counters.kernel_filter``): its factors
    then set two different sets of kernels against each other. None for the same filter."""
    if row.get("kernel_filter") == base.get("kernel_filter"):
        return None
    return f"kernel filter {row.get('kernel_filter') or 'none'}, the baseline's {base.get('kernel_filter') or 'none'}"


def compared_label(row: dict[str, Any], base: dict[str, Any]) -> str:
    caveats = [c for c in (other_run(row, base), other_kernels(row, base)) if c]
    return f"{stack_label(row)} ({'; '.join(caveats)})" if caveats else stack_label(row)


def claims_table(stacks: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: the study's claim, the strict-FP32 baseline's own numbers, then each stack's factors, each
    with its commit (a stack from another run than the baseline says so)."""
    base = baseline_of(stacks)
    lines = [f"### {workload_title(stacks[0])}", ""]
    if base is None:
        return lines + ["No strict-FP32 row for this workload in the file: no factors (run `recipe=[]` too).", ""]
    b = base["counters"]["overall"]
    lines += ["| stack | kernel time reduction | SM cycles reduction | instruction reduction | tensor-pipe use | IPC change "
              "| commit |", "|---|---|---|---|---|---|---|",
              f"| {STUDY['label']} | | {STUDY['sm_cycles']} | {STUDY['inst']} | {STUDY['tensor']} | {STUDY['ipc']} | |",
              f"| fp32 (baseline: {b['duration_ns'] / 1e6:.2f} ms, {_m(b['sm_cycles'])} M cycles, "
              f"{_m(b['inst_executed'])} M inst, IPC {b['ipc'] or 0:.2f}) | 1x | 1x | 1x | {_pct(b['tensor_pipe_pct'])} | 0 "
              f"| {code_label(base)} |"]
    for row in stacks:
        if row is base:
            continue
        c = compare(row, base)
        tensor = f"{_x(c['tensor'])} ({_pct(c['tensor_pct'])})" if c["tensor"] is not None else _pct(c["tensor_pct"])
        lines.append(f"| {compared_label(row, base)} | {_x(c['time'])} | {_x(c['sm_cycles'])} | {_x(c['inst'])} | "
                     f"{tensor} | {_pct(c['ipc'], signed=True)} | {code_label(row)} |")
    return lines + [""]


def category_table(row: dict[str, Any]) -> list[str]:
    """Markdown lines: per kernel category of one stack, longest first, time, counters and top stall reasons
    (per step)."""
    cats = row["counters"]["categories"]
    total = row["counters"]["overall"]["duration_ns"] or 1.0
    lines = [f"#### {stack_label(row)}: {workload_title(row)}", "",
             "| category | launches | ms | share | M SM cycles | M inst | tensor pipe | IPC | DRAM | L2 | occupancy "
             "| top stalls (cycles/inst) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in sorted(cats.items(), key=lambda kv: -(kv[1]["duration_ns"] or 0)):
        if not t["launches"]:
            continue
        stalls = ", ".join(f"{r} {v:.1f}" for r, v in t["top_stalls"])
        lines.append(f"| {name} | {t['launches']:.0f} | {(t['duration_ns'] or 0) / 1e6:.3f} | "
                     f"{(t['duration_ns'] or 0) / total:.1%} | {_m(t['sm_cycles'])} | {_m(t['inst_executed'])} | "
                     f"{_pct(t['tensor_pipe_pct'])} | {t['ipc'] or 0:.2f} | {_pct(t['dram_pct'])} | {_pct(t['l2_pct'])} | "
                     f"{_pct(t['occupancy_pct'])} | {stalls} |")
    for r in row["counters"].get("rules") or []:
        lines.append(f"- ncu rule {r['rule']} ({r['speedup_type']}): {r['saved_ms']:.3f} ms a step ({r['share']:.1%}) "
                     f"estimated saving over {r['launches']:.0f} launches, most in {r['top_category']}")
    return lines + [""]


def markdown(rows: list[dict[str, Any]]) -> str:
    groups = workloads(rows)
    env = next((r for r in rows if r.get("env")), {})
    gpu = (env.get("env") or {}).get("gpu")
    lines = ["# Hardware counters per recipe stack (Nsight Compute)", "",
             f"GPU {gpu or 'none'}, ncu {env.get('ncu_version')}, kernel {env.get('kernel_release')}. Per step, summed over "
             "the profiled kernels; factors against the strict-FP32 row of the same workload, of the same run unless the "
             "stack says otherwise.", "",
             "## Study claim vs this GPU", ""]
    for stacks in groups.values():
        lines += claims_table(stacks)
    if not groups:
        lines += ["No stack has counters in this file yet.", ""]
    lines += ["## Where each stack's kernel time goes", ""]
    for stacks in groups.values():
        for row in stacks:
            lines += category_table(row)
    failed = [r for r in rows if r.get("status") != "ok"]
    if failed:
        lines += ["## Rows without counters", ""]
        lines += [f"- {workload_title(r)}, {stack_label(r)}: {r['status']}: {r['message'].splitlines()[0]}"
                  for r in failed]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Per workload, SM-cycle and instruction reduction of each stack (log scale), the study's 100x drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [g for g in workloads(rows).values() if baseline_of(g)]
    fig, axes = plt.subplots(len(groups) or 1, 1, figsize=(9, 3.6 * max(1, len(groups))), squeeze=False)
    for ax, stacks in zip(axes[:, 0], groups):
        base = baseline_of(stacks)
        others = [r for r in stacks if r is not base]
        factors = [compare(r, base) for r in others]
        xs = range(len(others))
        for offset, key, name in ((-0.2, "sm_cycles", "SM cycles"), (0.2, "inst", "instructions")):
            ax.bar([x + offset for x in xs], [f[key] or 0 for f in factors], width=0.4, label=f"{name} reduction")
        ax.axhline(CLAIM_FACTOR, color="k", ls="--", lw=1, label="study claim on A100 (100x)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_yscale("log")
        ticks = [stack_label(r)[:40] + ("\n(another run)" if other_run(r, base) else "")
                 + ("\n(other kernels)" if other_kernels(r, base) else "") for r in others]
        ax.set_xticks(list(xs), ticks, rotation=20, ha="right", fontsize=7)
        ax.set_ylabel("strict FP32 / stack")
        ax.set_title(workload_title(base), fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def read_calls(folders: list[Path]) -> list[dict[str, Any]]:
    """The rows of each folder's ``counters.jsonl`` in order, each tagged ``call`` with its folder's name."""
    return [{**row, "call": folder.name} for folder in folders for row in read_rows(folder / ROWS_FILE)]


def write(out: Path, sources: list[Path] | None = None) -> Path:
    """Rebuild ``out``'s counters.md and counters_claims.png from the rows of ``sources`` (default: ``out``
    itself); returns the markdown path."""
    rows = read_calls(sources or [Path(out)])
    plot(rows, Path(out) / PLOT)
    return atomic_write_text(Path(out) / MARKDOWN, markdown(rows) + f"\n![claims]({PLOT})\n")


def main(argv: list[str]) -> int:
    """``DIR``: the page of DIR's rows; ``DIR FOLDER...``: one page in DIR of the rows of each FOLDER under DIR."""
    if not argv:
        print("error: no folder given; pass python -m bench.counter_claims DIR [FOLDER ...] (DIR, or each FOLDER "
              "under it, holds counters.jsonl)", file=sys.stderr)
        return 2
    out = Path(argv[0])
    sources = [out / folder for folder in argv[1:]] or [out]
    for rows in (source / ROWS_FILE for source in sources):
        if not rows.exists():
            print(f"error: {rows}: not found; write it with python -m bench.counters counters.out={rows.parent}",
                  file=sys.stderr)
            return 2
    print(write(out, sources))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
