"""The quality verdict beside each speed figure, read from the gate's files committed in the same GPU folder.

``bench/results/<gpu>/quality/`` holds the gate's rows (every ``results.jsonl`` under it, from ``bench.ladder
preset=quality`` or ``preset=samplers``: a gated row carries ``quality.verdict``) and training verdicts
(``training_verdict.json`` beside the ``training.json`` of ``preset=quality_training``). A verdict judges a recipe
stack's numerics, measured on the quality model rather than on the timed network, so a timed row takes the verdict
of a gate that ran the same stack:

* a sample: a gated sample with the same recipes, recipe options (but :data:`SAME_NUMERICS`), sampler and model
  calls;
* a denoiser forward: a gated ``denoise_step`` with its recipes and options (:func:`bench.reporting.pages.verdict`
  falls back to the same stack's sample on ``fast_sample``'s sampler, and says so);
* a train step: a training verdict whose trained arm ran its recipes and options;
* strict FP32 on a step or on DDPM-250 is what the gate compares against: ``reference``.

A gate between two checkpoints (``quality.candidate_checkpoint``) judges weights, not a stack, and is left out. Of
several matching gates the last run's counts. No match: ``not gated``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.core.records import RESULTS_FILE, candidate_checkpoint, read_rows
from bench.quality.training_power import power_text, val_loss_power
from bench.quality.training_report import VERDICT_FILE

QUALITY_DIR = "quality"
GATE_DOC = '"The gate at 128³"'  # docs/quality.md's section on the 128³ gate: its plan and why a cell is not gated
TRAINING_FILE = "training.json"  # beside training_verdict.json: each arm's command, so its recipes
REFERENCE_SAMPLER = ("ddpm", 250)  # the gate's reference sampler: Med-DDPM's own
# Options that change when a compiled forward is built (ahead of time, kept in a file), not what it computes: a
# verdict on the stack without them holds for the stack with them.
SAME_NUMERICS = ("compile.aot", "compile_cudagraphs.aot")

Stack = tuple[tuple[str, ...], frozenset[str]]  # recipes in order, options


@dataclass(frozen=True)
class Verdict:
    """A verdict's word (``pass``, ``warn``, ``fail``, ``reference``, ``not gated``), what it rests on, the file
    it was read from and, for a training verdict, its deciding number against its band (short enough for a cell)."""

    word: str
    detail: str = ""
    source: Path | None = None
    band: str = ""

    @property
    def brief(self) -> str:
        """The word with its band: what a README cell shows."""
        return f"{self.word} ({self.band})" if self.band else self.word

    def text(self, page_dir: Path) -> str:
        """The word, its detail and a link to its file relative to a page in ``page_dir``."""
        notes = [self.detail] if self.detail else []
        if self.source is not None:
            notes.append(f"[{self.source.name}]({os.path.relpath(self.source, page_dir)})")
        return f"{self.word} ({', '.join(notes)})" if notes else self.word


VERDICTS = ("pass", "warn", "fail")  # the gate's words, worst last
REFERENCE = Verdict("reference")  # strict FP32: what the gate compares against
NOT_GATED = Verdict("not gated")


def options(items: Iterable[str] | None) -> frozenset[str]:
    """Recipe options as ``name.key=value``, without quotes or a ``recipe.`` prefix: a row's
    ``gather_upsample.forward="gather"`` and a command's ``recipe.gather_upsample.forward=gather`` are one option.
    Options of :data:`SAME_NUMERICS` are left out."""
    out = set()
    for item in items or ():
        key, _, value = str(item).removeprefix("recipe.").partition("=")
        if key not in SAME_NUMERICS:
            out.add(f"{key}={value.strip(chr(34) + chr(39))}")
    return frozenset(out)


def row_stack(row: dict[str, Any]) -> Stack:
    return tuple(row.get("recipes") or ()), options(row.get("recipe_options"))


def arm_stack(argv: Sequence[str]) -> Stack:
    """The stack of a training arm's command (``recipe=[a,b]`` and its ``recipe.a.key=value`` options)."""
    listed = next((a.removeprefix("recipe=") for a in argv if a.startswith("recipe=")), "[]")
    recipes = tuple(r.strip() for r in listed.strip("[]").split(",") if r.strip())
    return recipes, options(a for a in argv if a.startswith("recipe."))


def is_reference(row: dict[str, Any]) -> bool:
    """Strict FP32 on a step, or on DDPM-250: the gate's own reference."""
    if row.get("recipes"):
        return False
    return row.get("scenario") != "full_sample" or (row.get("sampler"), row.get("steps")) == REFERENCE_SAMPLER


def gate_notes(row: dict[str, Any]) -> list[str]:
    """A gated row's N, and ``random weights`` when the gate had no checkpoint (``bench.checkpoint``): a pass on a
    seeded random net at N=8 is not a trained model's at N=32."""
    gate = row.get("quality") or {}
    notes = [f"N={gate['n_samples']}"] if gate.get("n_samples") else []
    if not ((row.get("config") or {}).get("bench") or {}).get("checkpoint"):
        notes.append("random weights")
    return notes


def val_loss_band(verdict: dict[str, Any]) -> str:
    """The trained stack's validation loss against the band of strict-FP32 retraining (mean ± sd), or ""."""
    check = (verdict.get("checks") or {}).get("val_loss") or {}
    band = check.get("band") or {}
    if not isinstance(check.get("value"), (int, float)) or "mean" not in band:
        return ""
    return f"val. loss {check['value']:.3g}, band {band['mean']:.3g} ± {band['sd']:.2g}"


def trained_detail(verdict: dict[str, Any], folder: Path) -> str:
    """A training verdict's reason and, on a pass, the difference it fails and what more seeds would buy
    (:mod:`bench.quality.training_power`): what the page shows beside the word."""
    power = val_loss_power(verdict, folder) if verdict.get("verdict") == "pass" else None
    return ", ".join(part for part in (f"trained: {verdict.get('why', '')}".rstrip(": "),
                                       f"val. loss {power_text(power)}" if power else "") if part)


def worst_p(gate: dict[str, Any]) -> float | None:
    """The smallest p-value of a gate's distribution checks (of its bias checks for a probe-only gate): the check
    nearest to deciding."""
    checks = (gate.get("checks") or {}).values()
    for kinds in (("distribution",), ("bias",)):
        found = [float(c["p_value"]) for c in checks if c.get("kind") in kinds and c.get("p_value") is not None]
        if found:
            return min(found)
    return None


def power(gate: dict[str, Any]) -> str:
    """``p 0.17, bias 0.015``: a gate's worst p-value and the smallest ε scale error it fails."""
    p, bias = worst_p(gate), gate.get("min_detectable_eps_bias")
    return ", ".join(part for part in (f"p {p:.2g}" if p is not None else "",
                                       f"bias {float(bias):.2g}" if bias is not None else "") if part)


def against(gate: dict[str, Any]) -> str:
    """What a gate compared with: the candidate's own sampler in strict FP32, or strict-FP32 DDPM over every step."""
    ref, cand = gate.get("reference_sampler") or {}, gate.get("candidate_sampler") or {}
    return "vs strict FP32, same sampler" if ref and ref == cand else "vs strict-FP32 DDPM-250"


def gate_verdict(found: list[tuple[dict[str, Any], Path]]) -> Verdict:
    """The verdict of a timed row's gates (the last run's of each reference: the stack's and the sampler's): the worst
    word, the worst p-value and the detectable bias of the worst gate, each gate's notes (:func:`gate_notes`), its run
    and the file of the worst."""
    latest = {against(r["quality"]): (r, p) for r, p in found}
    worst, where = max(latest.values(), key=lambda rp: VERDICTS.index(rp[0]["quality"]["verdict"]))
    each = [f"{name}: {r['quality']['verdict']} ({power(r['quality'])})" for name, (r, _) in latest.items()] \
        if len(latest) > 1 else []
    notes = [*each, *gate_notes(worst), f"gate run {worst.get('run_id')}"]
    return Verdict(str(worst["quality"]["verdict"]), ", ".join([power(worst["quality"]), *notes]), where)


def size_label(size: Sequence[int] | None) -> str:
    """``128³`` for a cube, ``192x192x144`` otherwise."""
    size = list(size or [])
    return f"{size[0]}³" if size and len(set(size)) == 1 else "x".join(map(str, size))


def row_size(row: dict[str, Any]) -> list[int] | None:
    return row.get("image_size") or (((row.get("config") or {}).get("model") or {}).get("image_size"))


class Gates:
    """The gate's verdicts of one GPU folder, looked up by a timed row's stack."""

    def __init__(self, rows: list[tuple[dict[str, Any], Path]], trained: list[tuple[Stack, Verdict]]):
        self.rows = sorted(rows, key=lambda rp: str(rp[0].get("run_id") or ""))  # the last run's gate counts
        self.trained = trained

    @classmethod
    def read(cls, folder: Path) -> Gates:
        """Every gated row and training verdict under ``folder/quality`` (none when it has no such folder)."""
        quality = folder / QUALITY_DIR
        rows = [(row, path) for path in sorted(quality.rglob(RESULTS_FILE)) for row in read_rows(path)
                if (row.get("quality") or {}).get("verdict") and row.get("status") == "ok"
                and not candidate_checkpoint(row)]
        trained = []
        for path in sorted(quality.rglob(VERDICT_FILE)):
            verdict, arms = json.loads(path.read_text()), path.parent / TRAINING_FILE
            arms = json.loads(arms.read_text())["arms"] if arms.exists() else {}
            found = Verdict(str(verdict["verdict"]), trained_detail(verdict, path.parent), path, val_loss_band(verdict))
            trained += [(arm_stack(arm.get("argv") or []), found) for arm in arms.values()]
        return cls(rows, [(stack, v) for stack, v in trained if stack[0]])

    def verdict(self, row: dict[str, Any] | None) -> Verdict:
        """The verdict beside ``row``'s time (:mod:`this module <bench.reporting.verdicts>` says which gate)."""
        if row is None:
            return NOT_GATED
        if is_reference(row):
            return REFERENCE
        stack = row_stack(row)
        if row.get("scenario") == "train_step":
            return next((v for s, v in reversed(self.trained) if s == stack), Verdict(
                NOT_GATED.word, "no training verdict of this stack in quality/; bench.ladder preset=quality_training "
                                "judges one stack a run"))
        same = [(r, p) for r, p in self.rows if row_stack(r) == stack and r.get("scenario") == row.get("scenario")
                and (r.get("sampler"), r.get("steps")) == (row.get("sampler"), row.get("steps"))]
        sized = [(r, p) for r, p in same if row_size(r) == row_size(row)]
        return gate_verdict(sized) if sized else self.not_gated(row, same)

    def not_gated(self, row: dict[str, Any], other_sizes: list[tuple[dict[str, Any], Path]]) -> Verdict:
        """``not gated`` and why: no gate of this stack and sampler at the row's size (a precision effect depends on
        the network and its weights, so another size's verdict does not stand for it; it is named)."""
        size = size_label(row_size(row))
        why = f"no {size} gate of this stack and sampler in quality/; see docs/quality.md, {GATE_DOC}"
        if other_sizes:
            other, _ = other_sizes[-1]
            why += f"; the {size_label(row_size(other))} quality model's: {other['quality']['verdict']}"
        return Verdict(NOT_GATED.word, why)
