"""bench.quality.training_verdict: a trained model judged against the band of strict-FP32 retraining. A control far outside
the band fails, a fresh seed inside it passes, a negative MMD counts by its size, and a run whose control does not
fail (or whose fresh seed does) cannot decide the stack."""

import math

import pytest
from scipy import stats

from bench.quality.training_verdict import ALPHA, check, distance, judge, training_verdict

SEEDS = ["fp32_seed1", "fp32_seed2", "fp32_seed3", "fp32_seed4"]
NAMES = ("histogram_w1_vs_ref", "kid_vs_ref", "mmd_vs_ref", "diversity_gap")
BAND = {"fp32_seed1": (0.10, 2.0e-4, 0.015, 0.030), "fp32_seed2": (0.14, 3.0e-4, -0.020, -0.020),
        "fp32_seed3": (0.12, 1.0e-4, 0.010, 0.040), "fp32_seed4": (0.11, 2.5e-4, 0.017, 0.025)}
VAL = {"fp32": 0.0820, "fp32_seed1": 0.0815, "fp32_seed2": 0.0830, "fp32_seed3": 0.0808, "fp32_seed4": 0.0822}
WITHIN = (0.12, 2.0e-4, 0.012, -0.03)


def row(values, verdict="fail"):
    """A gated row of one trained model against FP32's: the four distribution checks set to ``values``."""
    checks = {name: {"kind": "distribution", "value": value} for name, value in zip(NAMES, values)}
    checks["eps_noise"] = {"kind": "limit", "value": 0.2}
    return {"status": "ok", "quality": {"verdict": verdict, "checks": checks}}


def verdict(stack=WITHIN, control=WITHIN, stack_val=0.0819, control_val=0.0650, fresh=BAND["fp32_seed4"]):
    rows = {**{arm: row(v) for arm, v in BAND.items()}, "fp32_seed4": row(fresh), "fast_train": row(stack),
            "control": row(control)}
    return training_verdict(rows, {**VAL, "fast_train": stack_val, "control": control_val}, "fp32", "fast_train",
                            "control", SEEDS)


def test_the_control_fails_the_fresh_seed_passes_and_a_stack_inside_the_band_passes():
    judged = verdict()
    assert judged["controls"]["control"]["outcome"] == "fail" and judged["controls"]["fresh_seed"]["outcome"] == "pass"
    assert judged["controls_ok"] and judged["verdict"] == "pass" == judged["stack_outcome"]
    val = judged["controls"]["control"]["checks"]["val_loss"]
    assert val["status"] == "beyond" and val["effect_size"] < -20 and val["p_adjusted"] < ALPHA
    assert val["band"]["draws"] == VAL and val["band"]["k"] == 5  # the reference and the four seeds
    assert judged["controls"]["fresh_seed"]["checks"]["kid_vs_ref"]["band"]["k"] == 3  # the other three seeds
    assert judged["weight_differences"]["eps_noise"]["control"] == 0.2  # reported, not deciding


def test_a_stack_beyond_the_band_on_one_check_fails_and_says_which():
    judged = verdict(stack=(0.5, 2.0e-4, 0.012, -0.03))
    assert judged["verdict"] == "fail" and judged["why"].startswith("beyond the band of FP32 retraining: "
                                                                   "histogram_w1_vs_ref 0.5 (beyond")
    assert [n for n, c in judged["checks"].items() if c["status"] == "beyond"] == ["histogram_w1_vs_ref"]


def test_a_negative_mmd_counts_by_its_size_not_as_closeness():
    """MMD² estimates go negative when two sets are alike; one far below zero is as far as one far above."""
    assert distance(-0.2) == distance(0.2) == 0.2
    judged = verdict(stack=(0.12, 2.0e-4, -0.2, -0.03))
    assert judged["checks"]["mmd_vs_ref"]["status"] == "beyond" and judged["verdict"] == "fail"


def test_a_stack_that_trains_faster_than_fp32_differs_from_it():
    """The validation loss is two-sided: a recipe that changes what training reaches in its steps fails either way."""
    assert verdict(stack_val=0.0650)["verdict"] == "fail" and verdict(stack_val=0.0990)["verdict"] == "fail"


def test_the_fail_edge_a_check_reports_is_where_it_fails():
    """One of five checks, four draws: the edge is the mean plus t(3, 1 - 0.05/5) sd sqrt(1 + 1/4); just above it
    fails, just below passes."""
    draws = {arm: BAND[arm][0] for arm in SEEDS}
    edge = check(0.0, draws, 5)["band"]["fail_edge"]
    mean, sd = sum(draws.values()) / 4, stats.tstd(list(draws.values()))
    assert edge == pytest.approx(mean + stats.t.ppf(1 - ALPHA / 5, 3) * sd * math.sqrt(1.25))
    for factor, outcome in ((1.001, "fail"), (0.999, "pass")):
        stack = (edge * factor, *WITHIN[1:])
        assert verdict(stack=stack)["stack_outcome"] == outcome


def test_a_run_whose_control_does_not_fail_cannot_pass_a_stack():
    judged = verdict(control_val=0.0819)
    assert judged["controls"]["control"]["outcome"] == "pass" and not judged["controls_ok"]
    assert judged["stack_outcome"] == "pass" and judged["verdict"] == "inconclusive"
    assert judged["why"].endswith("but the control (control) was not failed: this run cannot show a difference")


def test_a_run_whose_fresh_seed_fails_cannot_fail_a_stack():
    judged = verdict(stack=(0.12, 2.0e-4, 0.9, -0.03), fresh=(0.5, 2.0e-4, 0.015, 0.030))
    assert judged["controls"]["fresh_seed"]["outcome"] == "fail" and judged["stack_outcome"] == "fail"
    assert judged["verdict"] == "inconclusive" and judged["why"].endswith("the band misses retraining")


def test_a_statistic_that_is_not_finite_fails_and_an_unusable_band_is_inconclusive():
    nan = judge(row((0.12, "NaN", 0.012, -0.03)), 0.0819, {a: row(BAND[a]) for a in SEEDS}, VAL)
    assert nan["outcome"] == "fail" and nan["checks"]["kid_vs_ref"]["status"] == "not finite"
    two = judge(row(WITHIN), 0.0819, {a: row(BAND[a]) for a in SEEDS[:2]}, VAL)
    assert two["outcome"] == "inconclusive" and "histogram_w1_vs_ref: 2 draws" in two["why"]
    flat = judge(row(WITHIN), 0.0819, {a: row(BAND[a]) for a in SEEDS}, dict.fromkeys(VAL, 0.08))
    assert flat["outcome"] == "inconclusive" and "val_loss: no spread between the draws" in flat["why"]
