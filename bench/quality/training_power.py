"""What a training verdict's pass can see: the validation-loss difference it fails, and what more FP32 seeds would buy.

The validation loss fails beyond the band's prediction edge, m ± t(1 - a/2, k - 1) s sqrt(1 + 1/k)
(:func:`bench.quality.training_verdict.check`, a = its share of the family-wise level), so a pass says only that the
trained stack moved the loss by less than that edge, here as a percentage of m. The edge narrows with more draws k:
taking the band's s as the spread of retraining (it is the only estimate the rows hold), :func:`draws_for` is the
smallest k that puts it under :data:`TARGET_PCT`; each more seed costs one strict-FP32 run (its ``total_s`` in
``training.json`` over the runs sharing its GPU) and one gate (the gated rows' median ``wall_s``). More steps cannot be
priced this way: the rows hold no run of another length, so how s and m move with the steps is unmeasured.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from bench.core.records import RESULTS_FILE, read_rows
from bench.quality.training_verdict import ALPHA, VAL_SHARE

TARGET_PCT = 10.0  # the edge a pass should reach: fast_train's stack sits at +10.4 % on the H100
BUDGET_S = 600.0  # the GPU time it may cost: one device call
MAX_DRAWS = 200


def edge_pct(mean: float, sd: float, k: int) -> float:
    """The validation loss's fail edge as a percentage of the band's mean, at k draws."""
    from scipy import stats

    quantile = float(stats.t.ppf(1 - ALPHA * VAL_SHARE / 2, k - 1))
    return 100 * quantile * sd * math.sqrt(1 + 1 / k) / mean


def draws_for(mean: float, sd: float, target_pct: float = TARGET_PCT) -> int | None:
    """The fewest draws whose edge is under ``target_pct``; None when no number up to :data:`MAX_DRAWS` is."""
    return next((k for k in range(3, MAX_DRAWS + 1) if edge_pct(mean, sd, k) < target_pct), None)


def seconds_per_seed(folder: Path) -> float | None:
    """One more FP32 seed's GPU seconds, from the run's own records; None without them."""
    arms, rows = folder / "training.json", folder / RESULTS_FILE
    if not arms.exists() or not rows.exists():
        return None
    runs = [a["timings"]["total_s"] / max(1, int((a.get("starts") or [{}])[-1].get("runs_per_gpu") or 1))
            for name, a in json.loads(arms.read_text())["arms"].items()
            if name.startswith("fp32") and (a.get("timings") or {}).get("total_s")]
    gates = [float(r["wall_s"]) for r in read_rows(rows) if r.get("status") == "ok" and r.get("wall_s")]
    return statistics.median(runs) + statistics.median(gates) if runs and gates else None


def val_loss_power(verdict: dict[str, Any], folder: Path) -> dict[str, Any] | None:
    """The validation loss's difference, its fail edge and what would bring the edge under :data:`TARGET_PCT`
    (draws, more seeds, seconds, whether within :data:`BUDGET_S`); None without a usable band."""
    check = (verdict.get("checks") or {}).get("val_loss") or {}
    band = check.get("band") or {}
    k = int(band.get("k") or len(band.get("draws") or {}))
    if not isinstance(check.get("value"), int | float) or "mean" not in band or k < 3:
        return None
    mean, sd = float(band["mean"]), float(band["sd"])
    out = {"difference_pct": 100 * (check["value"] - mean) / mean, "edge_pct": edge_pct(mean, sd, k), "k": k,
           "target_pct": TARGET_PCT, "draws": draws_for(mean, sd)}
    per_seed = seconds_per_seed(folder)
    if out["draws"] is not None and per_seed is not None:
        out["seconds"] = max(0, out["draws"] - k) * per_seed
        out["within_budget"] = out["seconds"] <= BUDGET_S
    return out


def power_text(power: dict[str, Any]) -> str:
    """``+10.5 %, fails beyond ±14.7 % (5 draws); under 10 %: 23 draws, about 14 min of this GPU, over 10 min``."""
    text = f"{power['difference_pct']:+.1f} %, fails beyond ±{power['edge_pct']:.1f} % ({power['k']} draws)"
    if power["draws"] is None:
        return f"{text}; no number of seeds up to {MAX_DRAWS} puts it under {power['target_pct']:g} %"
    more = f"under {power['target_pct']:g} %: {power['draws']} draws"
    if "seconds" in power:
        fits = "within" if power["within_budget"] else "over"
        more += f", about {power['seconds'] / 60:.0f} min of this GPU, {fits} {BUDGET_S / 60:.0f} min"
    return f"{text}; {more}"
