"""Two-sample tests and bias tests for the quality gate, with their nulls built by permutation.

A gate must not decide from a raw value: KID and MMD are *unbiased* estimates that scatter around 0
for two equal distributions (and go negative), FID is biased upwards at small N, and how far any of
them moves between two seed sets depends on the model, the resolution, N and the extractor. So
every check here returns where its statistic falls in a null distribution built at the same N:

* :func:`permutation_test`: the arm labels (reference / candidate) are shuffled within strata
  (the conditioning mask of each sample), the statistic recomputed each time, and the p-value is
  ``(1 + #{T_perm >= T_obs}) / (1 + n_perm)`` (Phipson & Smyth 2010: never 0, exact level).
  Under H0 "both arms are draws of one sampler" the labels are exchangeable, so this null is the
  reference sampler against itself at the same N, without another N samples to pay for.
* :func:`bias_test`: a systematic error (a scale or an offset of the candidate against the
  reference) as the mean of per-sample deviations, its null by sign flips (H0: the deviation of
  each sample is symmetric around 0, as rounding noise is): all 2^N of them up to
  :data:`EXACT_SIGN_FLIPS_N` samples, ``n_perm`` random ones above. :func:`smallest_bias_p` is the
  smallest p-value that test can give, :func:`holm` corrects p-values for the number tested.

The statistics (:func:`mmd2_unbiased`, :func:`histogram_w1`, :func:`pair_mean_gap`) take a
precomputed pooled matrix and a boolean arm mask, so a permutation costs an index, not a network
pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

NULL_QUANTILES = (0.05, 0.5, 0.95)


@dataclass
class TestResult:
    """A statistic, the quantiles of its null at the same N, and its p-value."""

    value: float
    p_value: float
    null_quantiles: dict[str, float]
    n_perm: int

    def to_dict(self) -> dict[str, float | dict[str, float]]:
        return asdict(self)


def _null_summary(null: np.ndarray) -> dict[str, float]:
    return {f"q{round(q * 100):02d}": float(np.quantile(null, q)) for q in NULL_QUANTILES}


def stratified_permutations(strata: Sequence[int], is_b: np.ndarray, n_perm: int, seed: int) -> np.ndarray:
    """``n_perm`` boolean arm masks, each a shuffle of ``is_b`` inside every stratum."""
    rng = np.random.default_rng(seed)
    strata = np.asarray(strata)
    out = np.empty((n_perm, len(is_b)), dtype=bool)
    for s in np.unique(strata):
        idx = np.flatnonzero(strata == s)
        keys = rng.random((n_perm, len(idx)))
        out[:, idx] = is_b[idx][np.argsort(keys, axis=1)]
    return out


def permutation_test(statistic: Callable[[np.ndarray], float], is_b: np.ndarray, strata: Sequence[int] | None = None,
                     *, n_perm: int = 1000, seed: int = 0, two_sided: bool = False) -> TestResult:
    """p-value of ``statistic(is_b)`` against its values under label shuffles within ``strata``.

    ``is_b`` marks the candidate arm in the pooled sample; ``strata`` (default: one) keeps each
    mask's share of both arms fixed, so a shuffle never mixes conditions. ``two_sided`` compares
    absolute values (a gap that may go either way).
    """
    is_b = np.asarray(is_b, dtype=bool)
    strata = np.zeros(len(is_b), dtype=int) if strata is None else strata
    observed = float(statistic(is_b))
    null = np.array([statistic(p) for p in stratified_permutations(strata, is_b, n_perm, seed)], dtype=np.float64)
    if not math.isfinite(observed):
        return TestResult(observed, 0.0, _null_summary(null), n_perm)
    ref = np.abs(null) if two_sided else null
    obs = abs(observed) if two_sided else observed
    # a relative tolerance so that round-off ties (identical arms) count as "as extreme"
    extreme = int(np.sum(ref >= obs - 1e-12 * max(1.0, abs(obs))))
    return TestResult(observed, (1 + extreme) / (1 + n_perm), _null_summary(null), n_perm)


# ----------------------------------------------------------------------------- statistics
def polynomial_kernel(features: torch.Tensor) -> np.ndarray:
    """KID's kernel k(x, y) = (x·y / d + 1)³ over all pooled feature vectors (Bińkowski et al. 2018)."""
    f = features.double().numpy()
    return (f @ f.T / f.shape[1] + 1) ** 3


def linear_kernel(volumes: torch.Tensor) -> np.ndarray:
    """k(x, y) = x·y / n_voxels over flattened volumes (MONAI ``MMDMetric``'s kernel, scaled)."""
    v = volumes.flatten(1).double().numpy()
    return v @ v.T / v.shape[1]


def mmd2_unbiased(kernel: np.ndarray, is_b: np.ndarray) -> float:
    """Unbiased MMD² between the arms of a pooled kernel matrix (Gretton et al. 2012, eq. 3)."""
    b = is_b.astype(np.float64)
    a = 1.0 - b
    m, n, diag = a.sum(), b.sum(), np.diagonal(kernel)
    within = lambda w, size: (w @ kernel @ w - diag @ w) / (size * (size - 1))  # noqa: E731
    return float(within(a, m) + within(b, n) - 2 * (a @ kernel @ b) / (m * n))


def intensity_histograms(volumes: torch.Tensor, bins: int = 256, value_range: tuple[float, float] = (-1.0, 1.0)) -> np.ndarray:
    """(N, bins) voxel-count histograms, values clamped into ``value_range``, non-finite voxels left out."""
    lo, hi = value_range
    out = np.empty((len(volumes), bins))
    for i, v in enumerate(volumes):
        v = v[torch.isfinite(v)].double().clamp(lo, hi)
        out[i] = torch.histc(v, bins=bins, min=lo, max=hi).numpy()
    return out


def histogram_w1(histograms: np.ndarray, is_b: np.ndarray, bin_width: float) -> float:
    """Wasserstein-1 between the pooled intensity histograms of the two arms: ∫|CDF_a − CDF_b|."""
    cdf = lambda h: np.cumsum(h) / max(h.sum(), 1.0)  # noqa: E731
    return float(np.abs(cdf(histograms[~is_b].sum(0)) - cdf(histograms[is_b].sum(0))).sum() * bin_width)


def pair_mean_gap(similarity: np.ndarray, is_b: np.ndarray, strata: Sequence[int]) -> float:
    """Mean within-arm, within-stratum pair similarity of arm b minus that of arm a (diversity gap).

    ``similarity`` is an (N, N) matrix (MS-SSIM between samples; NaN where not computed, e.g.
    across strata). A sampler that collapses modes has a larger mean pairwise similarity.
    """
    strata = np.asarray(strata)
    same = (strata[:, None] == strata[None, :]) & ~np.eye(len(strata), dtype=bool)
    means = []
    for arm in (~is_b, is_b):
        pairs = same & arm[:, None] & arm[None, :]
        means.append(np.nanmean(similarity[pairs]) if pairs.any() else math.nan)
    return float(means[1] - means[0])


# ----------------------------------------------------------------------------- bias
@dataclass
class BiasResult:
    """Mean per-sample deviation, its sign-flip p-value, and the smallest mean this N can detect."""

    value: float
    p_value: float
    detectable: float
    n_perm: int


EXACT_SIGN_FLIPS_N = 12  # up to this N the sign-flip null is all 2^N patterns (4096), exact


def sign_flips(n: int, n_perm: int, seed: int) -> np.ndarray:
    """(patterns, n) signs: every one of the 2^n patterns up to :data:`EXACT_SIGN_FLIPS_N`, else ``n_perm``
    random ones."""
    if n <= EXACT_SIGN_FLIPS_N:
        return 1.0 - 2.0 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1)
    return np.random.default_rng(seed).choice((-1.0, 1.0), size=(n_perm, n))


def smallest_bias_p(n: int, n_perm: int) -> float:
    """The smallest p-value :func:`bias_test` can return for ``n`` deviations: 2/2^n when the null is exact (the
    observed signs and their mirror image are always as extreme), 1/(1 + n_perm) with random flips."""
    return 2.0 ** (1 - n) if n <= EXACT_SIGN_FLIPS_N else 1.0 / (1 + n_perm)


def bias_test(deviations: torch.Tensor | np.ndarray, *, n_perm: int = 2000, seed: int = 0,
              alpha: float = 0.01) -> BiasResult:
    """Is the mean of per-sample ``deviations`` (e.g. slope − 1) different from 0?

    Null: each deviation's sign is a fair coin (rounding noise has no preferred sign), so the
    mean of sign-flipped deviations is the null distribution (a one-sample permutation test,
    :func:`sign_flips`). ``detectable`` is the (1 − alpha) quantile of |mean| when the centred
    deviations (the noise without the bias) are sign-flipped: a systematic error smaller than
    that cannot be told from noise at this N.
    """
    d = np.asarray(deviations, dtype=np.float64).ravel()
    observed = float(d.mean())
    if not math.isfinite(observed):
        return BiasResult(observed, 0.0, math.nan, n_perm)
    signs = sign_flips(len(d), n_perm, seed)
    null = np.abs(signs @ d / len(d))
    extreme = int(np.sum(null >= abs(observed) * (1 - 1e-12)))
    noise = np.abs(signs @ (d - observed) / len(d))
    exact = len(d) <= EXACT_SIGN_FLIPS_N  # the identity pattern is among the flips: no +1 (Phipson & Smyth)
    p = extreme / len(signs) if exact else (1 + extreme) / (1 + n_perm)
    return BiasResult(observed, p, float(np.quantile(noise, 1 - alpha)), len(signs))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979), in the input's order: the k-th smallest p times
    (m − k + 1), made monotone. Rejecting where the adjusted p < alpha keeps the chance of any false rejection
    among the m tests at most alpha under any dependence between them, and rejects at least what Bonferroni does."""
    m, order, running, out = len(p_values), np.argsort(p_values, kind="stable"), 0.0, [1.0] * len(p_values)
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(p_values[i])))
        out[i] = running
    return out


def per_sample_fit(candidate: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample i: the least-squares slope b_i of candidate on reference (through 0), the mean
    error m_i, and the RMS of the residual c − b_i·r (the random part), all float64.

    A scale error c = (1+δ)·r shows as b = 1+δ with a zero residual; rounding noise leaves b ≈ 1
    and shows in the residual; an offset c = r + μ shows in m.
    """
    c, r = candidate.flatten(1).double(), reference.flatten(1).double()
    slope = (c * r).sum(1) / (r * r).sum(1).clamp_min(1e-300)
    mean = (c - r).mean(1)
    residual = (c - slope[:, None] * r).square().mean(1).sqrt()
    return slope, mean, residual
