"""A tuning's result files: ``report.md``, ``calls_vs_quality.png`` and the sealed ``sampler.yaml``
(:mod:`med_ddpm.samplers.tuned`) that ``med_ddpm.sample`` reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure
from omegaconf import DictConfig

from med_ddpm.samplers.search import describe_data
from med_ddpm.samplers.tuned import write_tuned
from med_ddpm.tuning.state import RESULT, Tuning
from med_ddpm.utils import atomic_write_text, save_figure


# ----------------------------------------------------------------------------------------------------- results
def failing_checks(report: dict[str, Any]) -> list[str]:
    return [name for name, check in report["checks"].items() if check["status"] != "pass"]


def record_of(t: Tuning, results: list[dict[str, Any]], held_out: dict[str, Any]) -> dict[str, Any]:
    """What ``sampler.yaml`` holds: the last budget gated (the passing one, or the largest tried)."""
    cfg, chosen = t.cfg, results[-1]
    report = chosen["report"]
    failing = failing_checks(report)
    statistics = {"verdict": report["verdict"], "n_samples": report["n_samples"],
                  "reasons": [r for r in report["reasons"] if r.split("=", 1)[0] in failing],
                  "n_masks": report["n_masks"], "extractor": report["extractor"],
                  "checks": {name: {k: c[k] for k in ("value", "status", "p_value") if k in c}
                             for name, c in report["checks"].items()}}
    return {"sampler": chosen["sampler"], "calls": chosen["calls"], "verdict": chosen["verdict"],
            "checkpoint": {"path": str(cfg.checkpoint), "sha256": t.sha256, "weights": cfg.weights},
            "recipe": t.recipe, "torch": str(torch.__version__),
            "gate": {"reference": f"strict-FP32 DDPM over all {t.T} steps, same masks and noise",
                     "image_size": t.size, "held_out": held_out, "statistics": statistics},
            "search": {"data": describe_data(cfg.data), "n": cfg.search.n, "kl_bound": chosen["bound"],
                       "trailing_kl_bound": chosen["trailing_bound"]},
            "budgets": [{"calls": r["calls"], "verdict": r["verdict"], "worst_p": r["worst_p"]} for r in results]}


def headline(record: dict[str, Any]) -> str:
    grid = f"`{record['sampler']['name']}` on the grid searched for this checkpoint, `{record['sampler']['timesteps']}`"
    if record["verdict"] == "pass":
        return f"**{record['calls']} model calls pass** the gate: {grid}."
    return (f"**No budget passed** up to {record['calls']} model calls ({grid}): `sampler.yaml` records the "
            f"{record['verdict']}, which `med_ddpm.sample` refuses; try larger `budgets=[...]`.")


def report_page(t: Tuning, results: list[dict[str, Any]], record: dict[str, Any]) -> str:
    cfg, n, n_masks = t.cfg, t.cfg.quality.n_samples, t.cfg.quality.n_masks
    held = record["gate"]["held_out"]
    rows = "\n".join(f"| {r['calls']} | {r['verdict']} | {float(r['worst_p']):.3g} | "
                     f"{', '.join(failing_checks(r['report'])) or '-'} | {r['bound']:.4g} | {r['trailing_bound']:.4g} | "
                     f"{r['sampling_s']} | {r['gate_s']} |" for r in results)
    left_out = (f"; {len(held['left_out'])} mask(s) of `masks` were the masks of search volumes and were left out "
                f"({', '.join(held['left_out'])})" if held["left_out"] else "")
    reference = (f"{t.state['reference_s']} s" if t.state.get("reference_s") is not None else "read from the cache")
    return f"""# Tuned sampler for `{cfg.checkpoint}`

{headline(record)}

| model calls | verdict | worst p | checks not passing | KL bound, searched grid | KL bound, trailing | sampling s | gate s |
| --- | --- | --- | --- | --- | --- | --- | --- |
{rows}

"Worst p": the smallest permutation p-value of the distribution checks (KID, MMD, histogram W1, diversity gap);
below {cfg.quality.alpha.fail} fails, below {cfg.quality.alpha.warn} warns. The KL bound (Align Your Steps) ranks
grids of one size; lower is better.

**Held out.** The gate's N = {n} volumes are {n_masks} masks x {n // n_masks} noise draws: masks
{', '.join(held['masks'])}, noise seed {held['noise_seed']}. The search estimated its bound on
{cfg.search.n} {describe_data(cfg.data)} with noise seed {held['search_noise_seed']}{left_out}: no mask or noise of
the gate was seen by the search.

**Reference.** The checkpoint's strict-FP32 DDPM over all {t.T} steps on the same masks and noise
({reference}). **Candidates**: each grid sampled with recipes {sorted(t.recipe) or '[] (strict FP32)'} on
{t.device.type}, torch {torch.__version__}, {t.size} voxels, batches of {cfg.gate.batch}.

Checkpoint sha256 `{t.sha256}` ({cfg.weights} weights). Search: {t.state['search']['seconds']} s.

![model calls against the worst distribution p-value](calls_vs_quality.png)
"""


def plot(results: list[dict[str, Any]], alpha: DictConfig, path: Path) -> Path:
    """Model calls against the worst distribution p-value, coloured by verdict, with the gate's limits."""
    fig = Figure(figsize=(5.5, 3.5))
    ax = fig.subplots()
    for verdict, colour in (("pass", "tab:green"), ("warn", "tab:orange"), ("fail", "tab:red")):
        points = [(r["calls"], float(r["worst_p"])) for r in results if r["verdict"] == verdict]
        if points:
            ax.scatter(*zip(*points), color=colour, label=verdict, zorder=3)
    ax.axhline(alpha.fail, color="tab:red", ls="--", lw=0.8, label=f"fail below {alpha.fail}")
    ax.axhline(alpha.warn, color="tab:orange", ls=":", lw=0.8, label=f"warn below {alpha.warn}")
    ax.set(xlabel="model calls per sample", ylabel="worst distribution p-value", yscale="log")
    ax.legend(fontsize=7)
    fig.subplots_adjust(left=0.16, bottom=0.15, right=0.97, top=0.95)
    return save_figure(fig, path, dpi=120)


SAMPLE_HINT = "python -m med_ddpm.sample experiment=fast_sample checkpoint={checkpoint} masks=MASKS tuned={tuned}"


def write_results(t: Tuning, results: list[dict[str, Any]], held_out: dict[str, Any]) -> dict[str, Any]:
    """``report.md`` and ``calls_vs_quality.png``, then ``sampler.yaml`` (last: a run that ends before it wrote
    no result)."""
    record = record_of(t, results, held_out)
    plot(results, t.cfg.quality.alpha, t.out_dir / "calls_vs_quality.png")
    atomic_write_text(t.out_dir / "report.md", report_page(t, results, record))
    header = ("# Written by med_ddpm.tune (report.md beside it). An edit fails the content_sha256 line: tune again.\n"
              f"# {SAMPLE_HINT.format(checkpoint=t.cfg.checkpoint, tuned=t.out_dir / RESULT)}\n")
    write_tuned(t.out_dir / RESULT, record, header)
    return record
