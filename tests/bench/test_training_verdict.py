"""bench.quality.training_verdict: a trained model judged against the band of strict-FP32 retraining. On the tiny
model's numbers, a control whose validation loss lies beyond the band fails and a fresh FP32 seed passes; the fail
edge a check reports is where it fails; a negative MMD counts by its size; a run whose control does not fail (or whose
fresh seed does) cannot decide the stack."""

import math

import pytest
from scipy import stats

from bench.quality.training_verdict import ALPHA, VAL_SHARE, distance, judge, training_verdict

SEEDS = ["fp32_seed1", "fp32_seed2", "fp32_seed3", "fp32_seed4"]
NAMES = ("histogram_w1_vs_ref", "kid_vs_ref", "mmd_vs_ref", "diversity_gap")
# What the tiny model gave through the whole preset on the CPU (tests/bench/test_quality_training.py, 100 steps,
# N = 10): each run's distribution statistics against the reference's samples and its validation loss.
BAND = {"fp32_seed1": (0.12, 2.13e-4, 0.03, 0.0807), "fp32_seed2": (0.166, 4.31e-4, 0.0837, -0.331),
        "fp32_seed3": (0.0346, 1.68e-5, 0.0193, -0.0833), "fp32_seed4": (0.102, 1.18e-4, 0.0173, -0.0157)}
STACK, CONTROL = (0.176, 4.53e-4, 0.0473, 0.0673), (0.0302, 5.86e-6, 0.0104, -0.00465)
VAL = {"fp32": 0.08765, "fp32_seed1": 0.08500, "fp32_seed2": 0.08032, "fp32_seed3": 0.08715, "fp32_seed4": 0.07957}
STACK_VAL, CONTROL_VAL = 0.08036, 0.06838


def row(values, verdict="fail"):
    """A gated row of one trained model against FP32's: the four distribution checks set to ``values``."""
    checks = {name: {"kind": "distribution", "value": value} for name, value in zip(NAMES, values)}
    checks["eps_noise"] = {"kind": "limit", "value": 0.2}
    return {"status": "ok", "quality": {"verdict": verdict, "checks": checks}}


def verdict(stack=STACK, stack_val=STACK_VAL, control_val=CONTROL_VAL, fresh=BAND["fp32_seed4"]):
    rows = {**{arm: row(v) for arm, v in BAND.items()}, "fp32_seed4": row(fresh), "fast_train": row(stack),
            "control": row(CONTROL)}
    return training_verdict(rows, {**VAL, "fast_train": stack_val, "control": control_val}, "fp32", "fast_train",
                            "control", SEEDS)


def test_a_control_beyond_the_band_fails_a_fresh_seed_and_the_stack_pass():
    judged = verdict()
    control, fresh = judged["controls"]["control"], judged["controls"]["fresh_seed"]
    assert control["outcome"] == "fail" and fresh["outcome"] == "pass" and judged["controls_ok"]
    assert judged["verdict"] == "pass" == judged["stack_outcome"]
    val = control["checks"]["val_loss"]
    assert val["status"] == "beyond" and -4.2 < val["effect_size"] < -4.0 and val["p_adjusted"] < ALPHA
    assert val["band"]["draws"] == VAL and val["band"]["k"] == 5  # the reference and the four seeds
    assert control["why"].startswith("beyond the band of FP32 retraining: val_loss 0.06838 (beyond; band 0.08394")
    assert fresh["checks"]["kid_vs_ref"]["band"]["k"] == 3  # the other three seeds
    assert judged["weight_differences"]["eps_noise"]["control"] == 0.2  # reported, not deciding


def test_a_stack_far_beyond_the_band_on_a_distribution_check_fails_and_says_which():
    judged = verdict(stack=(1.5, *STACK[1:]))
    assert judged["verdict"] == "fail" and judged["why"].startswith("beyond the band of FP32 retraining: "
                                                                   "histogram_w1_vs_ref 1.5 (beyond")
    assert [n for n, c in judged["checks"].items() if c["status"] == "beyond"] == ["histogram_w1_vs_ref"]


def test_a_negative_mmd_counts_by_its_size_not_as_closeness():
    """MMD² estimates go negative when two sets are alike; one far below zero is as far as one far above."""
    assert distance(-0.9) == distance(0.9) == 0.9
    judged = verdict(stack=(0.176, 4.53e-4, -0.9, 0.0673))
    assert judged["checks"]["mmd_vs_ref"]["status"] == "beyond" and judged["verdict"] == "fail"


def test_a_stack_that_trains_slower_than_fp32_fails_too():
    """The validation loss is two-sided: a recipe that changes what training reaches fails either way."""
    assert verdict(stack_val=0.0990)["verdict"] == "fail" and verdict(stack_val=0.0700)["verdict"] == "fail"


@pytest.mark.parametrize("name, alpha, two_sided", [("val_loss", ALPHA * VAL_SHARE, True),
                                                    ("histogram_w1_vs_ref", ALPHA * (1 - VAL_SHARE) / 4, False)])
def test_the_fail_edge_a_check_reports_is_where_it_fails(name, alpha, two_sided):
    """4 % of the family to the validation loss (two-sided, five draws), 1 % Holm over the four distribution checks
    (one-sided, four draws): the edge the stack's verdict reports is the mean plus the t quantile's sd sqrt(1 + 1/k);
    just beyond it the stack fails, just inside it passes."""
    index = NAMES.index(name) if name in NAMES else None
    draws = VAL if index is None else {arm: v[index] for arm, v in BAND.items()}
    band = verdict()["checks"][name]["band"]
    assert band["draws"] == draws
    k, values = len(draws), list(draws.values())
    quantile = stats.t.ppf(1 - alpha / (2 if two_sided else 1), k - 1)
    edge = band["fail_edge"][1] if two_sided else band["fail_edge"]
    assert edge == pytest.approx(sum(values) / k + quantile * stats.tstd(values) * math.sqrt(1 + 1 / k))
    for factor, outcome in ((1.001, "fail"), (0.999, "pass")):
        if index is None:
            assert verdict(stack_val=edge * factor)["stack_outcome"] == outcome
        else:
            assert verdict(stack=(edge * factor, *STACK[1:]))["stack_outcome"] == outcome


def test_a_run_whose_control_does_not_fail_cannot_pass_a_stack():
    judged = verdict(control_val=0.0840)
    assert judged["controls"]["control"]["outcome"] == "pass" and not judged["controls_ok"]
    assert judged["stack_outcome"] == "pass" and judged["verdict"] == "inconclusive"
    assert judged["why"].endswith("but the control (control) was not failed: this run cannot show a difference")


def test_a_run_whose_fresh_seed_fails_cannot_fail_a_stack():
    judged = verdict(stack=(0.176, 4.53e-4, 0.9, 0.0673), fresh=(1.5, 1.18e-4, 0.0173, -0.0157))
    assert judged["controls"]["fresh_seed"]["outcome"] == "fail" and judged["stack_outcome"] == "fail"
    assert judged["verdict"] == "inconclusive" and judged["why"].endswith("the band misses retraining")


def test_a_statistic_that_is_not_finite_fails_and_an_unusable_band_is_inconclusive():
    nan = judge(row((0.12, "NaN", 0.012, -0.03)), STACK_VAL, {a: row(BAND[a]) for a in SEEDS}, VAL)
    assert nan["outcome"] == "fail" and nan["checks"]["kid_vs_ref"]["status"] == "not finite"
    two = judge(row(STACK), STACK_VAL, {a: row(BAND[a]) for a in SEEDS[:2]}, VAL)
    assert two["outcome"] == "inconclusive" and "histogram_w1_vs_ref: 2 draws" in two["why"]
    flat = judge(row(STACK), STACK_VAL, {a: row(BAND[a]) for a in SEEDS}, dict.fromkeys(VAL, 0.08))
    assert flat["outcome"] == "inconclusive" and "val_loss: no spread between the draws" in flat["why"]
