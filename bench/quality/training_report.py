"""``training.md``: a training-stack folder's verdict as tables, rendered from its files, nothing retyped.

``bench.ladder preset=quality_training`` (:mod:`bench.quality.training`) writes ``training.json`` (each arm's
command, timings and starts), ``loss_curves.json`` and ``training_verdict.json`` into its ``out``. This renders
them as one page, each part with the commit of the code that wrote it:

* the arms: steady ms per step, steps timed, the first step and its compile cache, the data-wait share, the loss
  over the last quarter, the validation loss, and the commits that trained each arm;
* the verdict and the controls' outcomes, and per check the band of FP32 retraining (draws, mean ± sd, the fail
  edge) beside the stack's value, effect size and adjusted p-value (:mod:`bench.quality.training_verdict`);
* the paired and ε checks between the trained models, reported, not deciding.

The preset writes it after the verdict; ``python -m bench.report dir=DIR`` writes it for any folder that holds
``training_verdict.json``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from bench.core.records import code_label
from med_ddpm.utils import atomic_write_text

log = logging.getLogger("bench.quality.training_report")

TRAINING_MD = "training.md"
VERDICT_FILE = "training_verdict.json"
REFERENCE = "fp32"  # strict FP32 on the quality model's seed: every other model is gated against it
CONTROL = "control"  # the training a user could get wrong: the verdict must fail it


def arm_label(arm: str) -> str:
    if arm == REFERENCE:
        return "strict FP32 (recipe=[]), the reference"
    if arm.startswith(f"{REFERENCE}_seed"):
        return f"strict FP32, seed + {arm.removeprefix(f'{REFERENCE}_seed')}"
    return "the control: strict FP32 with quality_training.control" if arm == CONTROL else f"experiment={arm}'s stack"


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
    """One line per arm: its timings (``timings.json``), loss tail and validation loss (``loss_curves.json``)."""
    lines = ["| arm | ms per step | steps timed | first step s (compile cache) | data wait % | loss, last quarter | "
             "validation loss | trained by code |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm, record in training["arms"].items():
        t, loss = record.get("timings") or {}, losses.get(arm) or {}
        commits = sorted({_code(s) for s in record.get("starts") or []}) or ["not recorded"]
        first = f"{_num(t.get('first_step_s'), '.1f')} ({t.get('compile_cache', '')})" if t else ""
        sharing = max((s.get("runs_per_gpu") or 1 for s in record.get("starts") or []), default=1)
        shared = f" ({sharing} runs per GPU)" if sharing > 1 else ""
        lines.append(f"| {arm_label(arm)} | {_num(t.get('ms_per_step'), '.1f')}{shared} | {t.get('steady_steps', '')} | {first} | "
                     f"{_num(t.get('data_wait_pct'), '.2f')} | {_num(loss.get('tail_mean_loss'), '.4f')} | "
                     f"{_num(loss.get('val_loss'), '.5f')} | {', '.join(commits)} |")
    return lines


def _edge(band: dict[str, Any]) -> str:
    edge = band.get("fail_edge")
    return " or ".join(f"{'<' if i == 0 else '>'} {_num(e, '.4g')}" for i, e in enumerate(edge)) \
        if isinstance(edge, list) else f"> {_num(edge, '.4g')}" if edge is not None else band.get("problem", "")


def checks_table(checks: dict[str, Any]) -> list[str]:
    """Per check: the band of FP32 retraining (draws, mean ± sd, the value that fails), the candidate's value, effect
    size, adjusted p-value and status."""
    lines = ["| check | band draws | band mean ± sd | fails at | value | effect size (sd) | adjusted p | status |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, c in checks.items():
        band = c["band"]
        draws = ", ".join(_num(v, ".4g") for v in band["draws"].values())
        spread = f"{_num(band.get('mean'), '.4g')} ± {_num(band.get('sd'), '.3g')}" if "mean" in band else ""
        lines.append(f"| {name} | {draws} | {spread} | {_edge(band)} | {_num(c['value'], '.4g')} | "
                     f"{_num(c.get('effect_size'), '.2f')} | {_num(c.get('p_adjusted'), '.2g')} | "
                     f"{c.get('status', 'band unusable')} |")
    return lines


def controls_table(controls: dict[str, Any]) -> list[str]:
    lines = ["| control | arm | expected | outcome | why |", "| --- | --- | --- | --- | --- |"]
    for name, c in controls.items():
        lines.append(f"| {name} | {arm_label(c['arm'])} | {c['expected']} | {c['outcome']} | {c['why']} |")
    return lines


def differences_table(verdict: dict[str, Any]) -> list[str]:
    differences = verdict.get("weight_differences") or {}
    arms = list(next(iter(differences.values()), {}))
    lines = [f"| check | {' | '.join(arms)} |", f"| --- |{' --- |' * len(arms)}"]
    for name, values in differences.items():
        lines.append(f"| {name} | {' | '.join(_num(values.get(arm)) for arm in arms)} |")
    return lines


def training_markdown(folder: Path) -> str | None:
    """The page for ``folder``, or None when it holds no training verdict, or one of older code this page cannot
    show (said in one warning line)."""
    verdict = _read(folder, VERDICT_FILE)
    if verdict is None:
        return None
    if any("band" not in check for check in (verdict.get("checks") or {}).values()):
        log.warning("%s: a verdict of older code (its checks carry no band of FP32 retraining): %s left as it was; "
                    "rerun preset=quality_training to judge again", folder / VERDICT_FILE, TRAINING_MD)
        return None
    training, curves = _read(folder, "training.json"), _read(folder, "loss_curves.json") or {}
    lines = ["# Training stacks: the trained models against the band of strict-FP32 retraining", "",
             f"Written from this folder's files: `training.json` (code {_code(training)}), `loss_curves.json` "
             f"(code {_code(curves)}), `{VERDICT_FILE}` (code {_code(verdict)}); every gated row's commit and run "
             "are in `results.jsonl` and quality.md. The arms' step times come from separate processes, possibly "
             "separate calls: their ratio is not a same-run one.", ""]
    if training:
        lines += ["## Arms", "", *arms_table(training, curves.get("summary") or {}), ""]
    gate = "; ".join(f"{arm}: {status}" for arm, status in (verdict.get("gate") or {}).items())
    lines += ["## Verdict", "", f"**{verdict['verdict']}**: {verdict['why']}." + (f" The gate alone, each model "
                                                                                 f"against FP32's: {gate}." if gate else ""), ""]
    if verdict.get("controls"):
        lines += ["Controls (the verdict can fail, and retraining alone passes):", "",
                  *controls_table(verdict["controls"]), ""]
    if verdict.get("checks"):
        lines += [f"The stack's checks (family-wise alpha {verdict.get('alpha')}, Holm over the checks):", "",
                  *checks_table(verdict["checks"]), ""]
        for name, control in (verdict.get("controls") or {}).items():
            lines += [f"The {name}'s checks:", "", *checks_table(control["checks"]), ""]
    if verdict.get("weight_differences"):
        lines += ["Paired and ε checks against FP32's model (how far apart the weights are; reported, not deciding):",
                  "", *differences_table(verdict), ""]
    return "\n".join([*lines, f"Note: {verdict['note']}", ""])


def write_training_report(folder: Path) -> Path | None:
    """Write ``training.md`` into ``folder`` when it holds a training verdict; its path, else None."""
    page = training_markdown(folder)
    return None if page is None else atomic_write_text(folder / TRAINING_MD, page)
