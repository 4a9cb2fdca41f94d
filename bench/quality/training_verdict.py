"""The training-stack verdict: does a trained model differ from strict FP32's by more than retraining does?

``preset=quality_training`` (:mod:`bench.quality.training`) trains the quality model with strict FP32 on the
reference seed and on k more seeds (the band), and with the stack and the control on seeds of their own, so under
"the recipe changes nothing" the stack's run is one more draw of retraining, as each band run is. Checks:

* ``val_loss``: the EMA model's ε-MSE on held-out phantoms with fixed t and ε (the same for every model), two-sided:
  a stack that trains faster or slower than FP32 changes it. Its band is the k + 1 FP32 runs' values.
* the gate's distribution checks (intensity-histogram W1, KID, MMD, diversity gap), each gated row comparing the
  model's DDPM samples with the reference FP32 model's (the same masks and noise): the statistic's magnitude is the
  distance, one-sided. KID and MMD are unbiased MMD² estimates that go negative when two sets are alike, so a
  closeness claim may use their size, not their sign: a large negative value is as far as a large positive one.
  Their band is the k reseeded runs' distances.

Per check, with the band's mean m and standard deviation s over its k draws, a candidate's value x gets the
prediction p-value of t = (x - m) / (s sqrt(1 + 1/k)) under Student's t with k - 1 degrees of freedom (upper tail,
both tails for ``val_loss``): where x falls among the values one more FP32 retraining would give, the draws taken as
normal. The family-wise :data:`ALPHA` (5 %: a harmless stack fails at most that often) is split by weight: 4 % to
``val_loss``, whose band is narrow, and 1 % to the distribution checks, Holm among themselves, whose bands span an
order of magnitude between seeds at N = 32 and so only see gross damage. Each p-value is reported adjusted to the
5 % scale (``p_adjusted``: the weighted Holm p, below :data:`ALPHA` when the check fails), with the edge a value must
cross to fail and the candidate's effect size (x - m) / s. The outcome is ``fail`` (a check beyond its band, or a
statistic that is not finite), ``pass``, or ``inconclusive`` when a band cannot be used (under :data:`MIN_DRAWS`
draws, one not a number, no spread).

A run judges three candidates: the stack against every band; the control (a training a user could get wrong,
``quality_training.control``), which must fail; and the last reseeded run against the others (a seed its band never
saw), which must pass. A run whose control does not fail cannot show a difference, so its stack's pass is
inconclusive; a run whose fresh seed fails has a band that misses retraining, so its stack's fail is inconclusive.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from med_ddpm.quality.stats import holm

ALPHA = 0.05  # family-wise over a candidate's checks
VAL_SHARE = 0.8  # of ALPHA to val_loss; the rest to the distribution checks
MIN_DRAWS = 3  # below this the band's spread rests on one difference: no usable prediction interval
VAL_LOSS = "val_loss"
EXPECTED = {"control": "fail", "fresh_seed": "pass"}
NOTE = ("A check's band is what k strict-FP32 retrainings on other seeds give; a candidate fails when one of its "
        "checks lies beyond its band (prediction p-values; family-wise 5 %: 4 % to the validation loss, 1 % Holm over "
        "the distribution checks). The edges say how far "
        "a model must move to fail: a pass is not shown equivalence, only no difference this run can see. The paired "
        "and eps checks between two trained models measure how far apart their weights are: reported, not deciding.")


def distance(value: Any) -> float:
    """How far a distribution check's statistic puts the candidate from the reference: its magnitude. JSON keeps a
    NaN as a string; float() reads it."""
    return abs(float(value))


def check(value: float, draws: Mapping[str, float], alpha: float, two_sided: bool = False) -> dict[str, Any]:
    """``value`` against the band of ``draws`` (arm -> value) at level ``alpha``: the band (k, mean, sd, the fail edge
    or edges), the effect size and the prediction p-value; ``problem`` when the band cannot be used."""
    values = np.asarray(list(draws.values()), dtype=np.float64)
    k, finite = len(values), bool(np.isfinite(values).all())
    out: dict[str, Any] = {"value": value, "band": {"draws": dict(draws), "k": k}}
    if not math.isfinite(value):
        return {**out, "p_value": 0.0, "status": "not finite"}
    if k < MIN_DRAWS or not finite:
        return {**out, "problem": f"{k} draws" + ("" if finite else ", one not a number")}
    if values.std(ddof=1) == 0:
        return {**out, "problem": "no spread between the draws"}
    # imported here: scipy.stats takes a second to import, and every bench.ladder run imports this module
    from scipy import stats

    mean, sd = float(values.mean()), float(values.std(ddof=1))
    scale = sd * math.sqrt(1 + 1 / k)
    quantile = float(stats.t.ppf(1 - alpha / (2 if two_sided else 1), k - 1))
    t_stat = (value - mean) / scale
    p = float(2 * stats.t.sf(abs(t_stat), k - 1) if two_sided else stats.t.sf(t_stat, k - 1))
    edges = [mean - quantile * scale, mean + quantile * scale] if two_sided else mean + quantile * scale
    out["band"].update(mean=mean, sd=sd, fail_edge=edges)
    return {**out, "effect_size": (value - mean) / sd, "p_value": p}


def judge(candidate: Mapping[str, Any], val_loss: float, draws: Mapping[str, Mapping[str, Any]],
          val_losses: Mapping[str, float]) -> dict[str, Any]:
    """One candidate: its validation loss against ``val_losses`` (arm -> value, the FP32 runs) and its gated row's
    distribution checks against the ``draws`` rows (arm -> row): per check the band, effect size, p-value and
    Holm-adjusted p, and the outcome with the reason."""
    rows = {"candidate": candidate, **draws}
    names = [n for n, c in candidate["quality"]["checks"].items() if c.get("kind") == "distribution"]
    share = ALPHA * (1 - VAL_SHARE)
    checks = {VAL_LOSS: check(val_loss, val_losses, ALPHA * VAL_SHARE, two_sided=True)}
    for name in names:
        values = {arm: distance(row["quality"]["checks"][name]["value"]) for arm, row in rows.items()}
        checks[name] = check(values.pop("candidate"), values, share / len(names))
    scale = {VAL_LOSS: 1 / VAL_SHARE, **{n: 1 / (1 - VAL_SHARE) for n in names}}  # each group's level -> ALPHA
    usable = [n for n in names if "p_value" in checks[n]]
    grouped = dict(zip(usable, holm([*(checks[n]["p_value"] for n in usable), *[1.0] * (len(names) - len(usable))])))
    if "p_value" in checks[VAL_LOSS]:
        grouped[VAL_LOSS] = checks[VAL_LOSS]["p_value"]  # an unusable check above still counts as tested
    for name, p in grouped.items():
        checks[name]["p_adjusted"] = min(1.0, p * scale[name])
        checks[name].setdefault("status", "beyond" if checks[name]["p_adjusted"] < ALPHA else "within")
    return {**outcome(checks), "checks": checks}


def outcome(checks: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """fail when a check is beyond its band or not finite; inconclusive when a band cannot be used; else pass."""
    def listed(*states: str) -> str:
        return "; ".join(f"{n} {c['value']:.4g} ({c['status']}; band {c['band']['mean']:.4g} ± {c['band']['sd']:.3g}"
                         f", adjusted p {c['p_adjusted']:.2g})" if c["status"] != "not finite" else f"{n} not finite"
                         for n, c in checks.items() if c.get("status") in states)

    if failed := listed("beyond", "not finite"):
        return {"outcome": "fail", "why": f"beyond the band of FP32 retraining: {failed}"}
    if unusable := [f"{n}: {c['problem']}" for n, c in checks.items() if "problem" in c]:
        return {"outcome": "inconclusive", "why": f"a band that cannot be used: {'; '.join(unusable)}"}
    return {"outcome": "pass", "why": "within the band of FP32 retraining on every check"}


def weight_differences(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The paired and ε checks of each row: how far apart two trained networks are, reported, not deciding."""
    first = next(iter(rows.values()))["quality"]["checks"]
    names = [n for n, c in first.items() if c.get("kind") != "distribution"]
    return {n: {arm: row["quality"]["checks"].get(n, {}).get("value") for arm, row in rows.items()} for n in names}


def training_verdict(rows: Mapping[str, Mapping[str, Any] | None], val_losses: Mapping[str, float], reference: str,
                     stack: str, control: str, reseeds: Sequence[str]) -> dict[str, Any]:
    """The run's verdict from its gated rows (arm -> row, None where the arm has no gated row yet) and every run's
    validation loss (arm -> value): the stack and the control against the bands of ``reference`` and every
    ``reseeds`` run, the fresh seed (the last reseed) against the bands of the others."""
    out: dict[str, Any] = {"note": NOTE, "alpha": ALPHA, "val_loss": dict(val_losses)}
    if missing := [arm for arm, row in rows.items() if row is None]:
        return {"verdict": "inconclusive", "why": f"no gated row for {', '.join(missing)} in results.jsonl (cut by "
                "the budget or failed): rerun the same command", **out}

    def band(arms: Sequence[str]) -> tuple[dict[str, Any], dict[str, float]]:
        return {a: rows[a] for a in arms}, {a: val_losses[a] for a in (reference, *arms)}

    judged = {"stack": judge(rows[stack], val_losses[stack], *band(reseeds)),
              "control": judge(rows[control], val_losses[control], *band(reseeds)),
              "fresh_seed": judge(rows[reseeds[-1]], val_losses[reseeds[-1]], *band(reseeds[:-1]))}
    arms = {"stack": stack, "control": control, "fresh_seed": reseeds[-1]}
    controls = {name: {"arm": arms[name], "expected": EXPECTED[name], **judged[name]} for name in EXPECTED}
    verdict, why = judged["stack"]["outcome"], judged["stack"]["why"]
    if verdict == "pass" and judged["control"]["outcome"] != "fail":
        verdict, why = "inconclusive", f"{why}, but the control ({control}) was not failed: this run cannot show a " \
                                       "difference"
    elif verdict == "fail" and judged["fresh_seed"]["outcome"] == "fail":
        verdict, why = "inconclusive", f"{why}, but the fresh FP32 seed ({reseeds[-1]}) failed too: the band misses " \
                                       "retraining"
    return {"verdict": verdict, "why": why, "stack_outcome": judged["stack"]["outcome"],
            "checks": judged["stack"]["checks"], "controls": controls,
            "controls_ok": all(c["outcome"] == c["expected"] for c in controls.values()),
            "gate": {arm: row["quality"]["verdict"] for arm, row in rows.items()},
            "weight_differences": weight_differences(rows), **out}
