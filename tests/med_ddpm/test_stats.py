"""Two-sample permutation tests and the sign-flip bias test: power against a known shift at N = 32 and the
nominal false-rejection rate under the null."""

import numpy as np
import pytest
import torch
from monai.metrics.mmd import compute_mmd
from scipy.stats import binom

from med_ddpm.quality import stats

N = 32
IS_B = np.r_[np.zeros(N, bool), np.ones(N, bool)]
STRATA = np.tile(np.repeat(np.arange(8), 4), 2)  # 8 masks x 4 seeds per arm


def _features(shift: float, seed: int, dim: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(N, dim, generator=g), torch.randn(N, dim, generator=g) + shift
    return torch.cat([a, b])


def _kid_p(feats: torch.Tensor, n_perm: int, seed: int = 0) -> float:
    kernel = stats.polynomial_kernel(feats)
    return stats.permutation_test(lambda b: stats.mmd2_unbiased(kernel, b), IS_B, STRATA, n_perm=n_perm, seed=seed).p_value


def test_stratified_permutations_keep_each_stratum_balanced():
    perms = stats.stratified_permutations(STRATA, IS_B, 50, seed=0)
    for s in range(8):
        assert (perms[:, STRATA == s].sum(1) == 4).all()
    assert len({p.tobytes() for p in perms}) == 50


def test_a_known_shift_is_detected_at_n32():
    assert _kid_p(_features(0.5, seed=0), n_perm=500) < 0.01
    kernel = stats.linear_kernel(_features(0.5, seed=1).view(2 * N, 1, 4, 2, 2))
    assert stats.permutation_test(lambda b: stats.mmd2_unbiased(kernel, b), IS_B, STRATA, n_perm=500).p_value < 0.01


def test_the_null_rejects_at_the_nominal_rate():
    """200 independent null experiments at alpha = 0.05: the rejection count lies in Binomial(200, 0.05)'s
    99.9 % interval (an exact permutation test is at or below its level)."""
    reps, alpha = 200, 0.05
    rejections = sum(_kid_p(_features(0.0, seed=s), n_perm=99, seed=s) <= alpha for s in range(reps))
    lo, hi = binom.interval(0.999, reps, alpha)
    assert lo <= rejections <= hi, rejections


def test_unbiased_mmd_goes_negative_but_the_p_value_does_not_fail_it():
    feats = _features(0.0, seed=3)
    kernel = stats.polynomial_kernel(feats)
    result = stats.permutation_test(lambda b: stats.mmd2_unbiased(kernel, b), IS_B, STRATA, n_perm=200)
    values = [stats.mmd2_unbiased(kernel, p) for p in stats.stratified_permutations(STRATA, IS_B, 50, seed=1)]
    assert min(values) < 0 < max(values)
    assert result.null_quantiles["q05"] < result.null_quantiles["q50"] < result.null_quantiles["q95"]
    assert result.p_value > 0.01


def test_identical_arms_give_p_one():
    feats = torch.cat([torch.randn(N, 8)] * 2)
    kernel = stats.polynomial_kernel(feats)
    assert stats.permutation_test(lambda b: stats.mmd2_unbiased(kernel, b), IS_B, STRATA, n_perm=100).p_value == 1.0


def test_kid_is_near_zero_for_one_distribution_and_positive_for_two():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(300, 8, generator=g), torch.randn(300, 8, generator=g)
    arms = np.r_[np.zeros(300, bool), np.ones(300, bool)]
    same = stats.mmd2_unbiased(stats.polynomial_kernel(torch.cat([a, b])), arms)
    different = stats.mmd2_unbiased(stats.polynomial_kernel(torch.cat([a, b + 1.0])), arms)
    assert abs(same) < 0.02 and different > 1.0


def test_linear_mmd_is_monais_mmd_per_voxel():
    g = torch.Generator().manual_seed(5)
    real, generated = torch.rand(3, 1, 4, 4, 4, generator=g), torch.rand(3, 1, 4, 4, 4, generator=g) + 0.5
    expected = float(compute_mmd(y=real.flatten(1).double(), y_pred=generated.flatten(1).double(), y_mapping=None))
    kernel = stats.linear_kernel(torch.cat([real, generated]))
    assert stats.mmd2_unbiased(kernel, np.r_[np.zeros(3, bool), np.ones(3, bool)]) * 64 == pytest.approx(expected, rel=1e-9)


def test_histogram_w1_of_a_shift_is_the_shift():
    a = torch.full((N, 1, 4, 4, 4), -0.5)
    hists = stats.intensity_histograms(torch.cat([a, a + 0.25]), bins=200)
    assert stats.histogram_w1(hists, IS_B, 2.0 / 200) == pytest.approx(0.25, abs=0.011)
    g = torch.Generator().manual_seed(4)
    x = torch.rand(1, 1, 32, 32, 32, generator=g) - 0.5  # a spread of intensities, not one bin
    hists = stats.intensity_histograms(torch.cat([x, x + 0.25]), bins=400)
    assert stats.histogram_w1(hists, np.array([False, True]), 2.0 / 400) == pytest.approx(0.25, abs=0.01)


def test_pair_mean_gap_reads_within_arm_within_stratum_pairs():
    sim = np.full((2 * N, 2 * N), 0.5)
    sim[np.ix_(IS_B, IS_B)] = 0.9  # the candidate's samples are more alike: less diverse
    assert stats.pair_mean_gap(sim, IS_B, STRATA) == pytest.approx(0.4)


def test_bias_test_separates_a_scale_from_noise():
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 0.01, N)
    biased = stats.bias_test(noise + 0.02, n_perm=999)
    assert biased.p_value == pytest.approx(1 / 1000) and biased.value == pytest.approx(0.02, abs=0.005)
    assert biased.detectable < 0.01  # the noise's scatter of the mean, not the bias
    assert stats.bias_test(noise, n_perm=999).p_value > 0.01


def test_bias_test_is_exact_for_small_n_and_its_floor_is_known():
    """Up to 12 samples the sign-flip null is all 2^N patterns: 8 deviations of one sign give p = 2/256 exactly,
    the floor smallest_bias_p names; above 12, random flips' floor is 1 / (1 + n_perm)."""
    result = stats.bias_test(np.full(8, 0.02) + np.arange(8) * 1e-4, n_perm=999)
    assert result.p_value == 2 / 256 == stats.smallest_bias_p(8, 999) and result.n_perm == 256
    assert stats.smallest_bias_p(13, 999) == 1 / 1000


def test_holm_adjusts_in_steps_and_keeps_the_order():
    assert stats.holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    assert stats.holm([0.3, 0.001]) == pytest.approx([0.3, 0.002])


def test_per_sample_fit_splits_scale_offset_and_noise():
    r = torch.randn(4, 1000, dtype=torch.float64)
    slope, mean, residual = stats.per_sample_fit(1.05 * r, r)
    assert torch.allclose(slope, torch.full((4,), 1.05, dtype=torch.float64)) and residual.max() < 1e-12
    slope, mean, residual = stats.per_sample_fit(r + 0.1, r)
    assert torch.allclose(mean, torch.full((4,), 0.1, dtype=torch.float64))
