"""``training.md``: a training-stack folder's verdict as tables, rendered from its files, nothing retyped.

``bench.ladder preset=quality_training`` (:mod:`bench.quality.training`) writes ``training.json`` (each arm's
command, timings and starts), ``loss_curves.json`` and ``training_verdict.json`` into its ``out``. This renders
them as one page, each part with the commit of the code that wrote it:

* the arms: steady ms per step, steps timed, the first step and its compile cache, the data-wait share, the loss
  over the last quarter (and the stack's paired difference), and the commits that trained each arm;
* the verdict, and per distribution check the stack's value and p-value beside the training noise's;
* the paired and ε checks between the trained models, reported, not deciding.

The preset writes it after the verdict; ``python -m bench.report dir=DIR`` writes it for any folder that holds
``training_verdict.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.core.records import code_label
from med_ddpm.utils import atomic_write_text

TRAINING_MD = "training.md"
VERDICT_FILE = "training_verdict.json"
REFERENCE = "fp32"
RESEED = "fp32_reseed"  # strict FP32 with the next seed: what retraining alone changes
NOISE = "training_noise"  # the row that gates RESEED against REFERENCE
PAIRS = {"stack": "stack vs FP32", NOISE: "FP32 reseeded vs FP32"}  # the verdict's row names, as the tables say them


def arm_label(arm: str) -> str:
    return {REFERENCE: "strict FP32 (recipe=[])", RESEED: "strict FP32, next seed (unpaired)"}.get(
        arm, f"experiment={arm}'s stack")


def _num(value: Any, spec: str = ".3g") -> str:
    """A number in ``spec`` ('' when absent; JSON keeps a NaN as the string 'NaN')."""
    if value is None:
        return ""
    try:
        return format(float(value), spec)
    except (TypeError, ValueError):
        return str(value)


def _code(record: dict[str, Any] | None) -> str:
    """The writer's commit (:func:`bench.core.records.code_label`), or says it was not recorded."""
    return f"`{code_label(record)}`" if (record or {}).get("git_sha") else "not recorded"


def _read(folder: Path, name: str) -> dict[str, Any] | None:
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def arms_table(training: dict[str, Any], losses: dict[str, Any]) -> list[str]:
    """One line per arm: its timings (``timings.json``) and loss tail (``loss_curves.json``)."""
    lines = ["| arm | ms per step | steps timed | first step s (compile cache) | data wait % | loss, last quarter | "
             "paired difference | trained by code |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm, record in training["arms"].items():
        t, loss = record.get("timings") or {}, losses.get(arm) or {}
        commits = sorted({_code(s) for s in record.get("starts") or []}) or ["not recorded"]
        first = f"{_num(t.get('first_step_s'), '.1f')} ({t.get('compile_cache', '')})" if t else ""
        lines.append(f"| {arm_label(arm)} | {_num(t.get('ms_per_step'), '.1f')} | {t.get('steady_steps', '')} | {first} | "
                     f"{_num(t.get('data_wait_pct'), '.2f')} | {_num(loss.get('tail_mean_loss'), '.4f')} | "
                     f"{_num(loss.get('tail_mean_difference'), '.4f')} | {', '.join(commits)} |")
    return lines


def checks_table(verdict: dict[str, Any]) -> list[str]:
    """Per distribution check: the stack's and the training noise's statistic and p-value, and which is further."""
    lines = [f"| check | {PAIRS['stack']} | p | {PAIRS[NOISE]} | p | stack |", "| --- | --- | --- | --- | --- | --- |"]
    for name, check in (verdict.get("checks") or {}).items():
        stack, noise = check["stack"], check[NOISE]
        lines.append(f"| {name} | {_num(stack['value'])} | {_num(stack['p_value'], '.2g')} | {_num(noise['value'])} | "
                     f"{_num(noise['p_value'], '.2g')} | {check['verdict']} |")
    return lines


def differences_table(verdict: dict[str, Any]) -> list[str]:
    lines = [f"| check | {PAIRS['stack']} | {PAIRS[NOISE]} |", "| --- | --- | --- |"]
    for name, values in (verdict.get("weight_differences") or {}).items():
        lines.append(f"| {name} | {_num(values.get('stack'))} | {_num(values.get(NOISE))} |")
    return lines


def training_markdown(folder: Path) -> str | None:
    """The page for ``folder``, or None when it holds no training verdict."""
    verdict = _read(folder, VERDICT_FILE)
    if verdict is None:
        return None
    training, curves = _read(folder, "training.json"), _read(folder, "loss_curves.json") or {}
    lines = ["# Training stacks: the trained models against strict FP32 and against training noise", "",
             f"Written from this folder's files: `training.json` (code {_code(training)}), `loss_curves.json` "
             f"(code {_code(curves)}), `{VERDICT_FILE}` (code {_code(verdict)}); every gated row's commit and run "
             "are in `results.jsonl` and quality.md. The arms' step times come from separate processes, possibly "
             "separate calls: their ratio is not a same-run one.", ""]
    if training:
        lines += ["## Arms", "", *arms_table(training, curves.get("summary") or {}), ""]
    gate = verdict.get("gate") or {}
    alone = "; ".join(f"{PAIRS.get(name, name)}: {status}" for name, status in gate.items())
    lines += ["## Verdict", "", f"**{verdict['verdict']}**: {verdict['why']}." + (f" The gate alone: {alone}."
                                                                                 if alone else ""), ""]
    if verdict.get("checks"):
        lines += ["Distribution checks (these decide):", "", *checks_table(verdict), ""]
    if verdict.get("weight_differences"):
        lines += ["Paired and ε checks (how far apart the weights are; reported, not deciding):", "",
                  *differences_table(verdict), ""]
    return "\n".join([*lines, f"Note: {verdict['note']}", ""])


def write_training_report(folder: Path) -> Path | None:
    """Write ``training.md`` into ``folder`` when it holds a training verdict; its path, else None."""
    page = training_markdown(folder)
    return None if page is None else atomic_write_text(folder / TRAINING_MD, page)
