"""Image-fidelity metrics for synthesised volumes, with one argument order: ``update(pred, target)``.

Example:
    >>> psnr = PSNR(data_range=2.0, region="tumour")
    >>> psnr.update(sample, reference, cond=cond)      # (B, C, D, H, W) each; cond (B, 2, D, H, W)
    >>> psnr.compute()                                 # mean over samples, in dB

Every metric is cumulative (``update`` over batches, ``compute`` once, ``reset``), declares
``name`` and ``higher_is_better``, and takes the candidate first and the reference second:
MONAI mixes ``(y_pred, y)`` (SSIM, PSNR, FID) and ``(y, y_pred)`` (MMD); the wrappers here
hide that. Data are Med-DDPM's [-1, 1] volumes, so ``data_range`` defaults to 2.

Three families:

* paired voxel metrics (PSNR, MAE, max error, non-finite count), optionally restricted to a
  region of the conditioning mask (``region="brain" | "tumour"`` or an explicit ``mask``);
* paired structural metrics (3-D SSIM, 3-D MS-SSIM), whole volume;
* set metrics (MMD, FID, KID, intensity-histogram W1, sample diversity) that compare the
  *distributions* of all samples seen, not sample pairs.

Configs in ``configs/metric/*.yaml`` nest each metric under its own key with a ``_target_``;
:func:`build_metrics` instantiates the selection.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from monai.metrics import MAEMetric, MMDMetric, MultiScaleSSIMMetric, PSNRMetric, SSIMMetric

from med_ddpm.features import FeatureExtractor, RandomConv3dFeatures

DATA_RANGE = 2.0  # Med-DDPM volumes live in [-1, 1]
# Wang, Simoncelli & Bovik 2003, Table 1: the 5-scale MS-SSIM exponents.
MS_SSIM_WEIGHTS = (0.0448, 0.2856, 0.3001, 0.2363, 0.1333)
# Which conditioning channels make up a region (a voxel is in it where any listed channel > 0,
# which works for whole-head masks in {-1, 1} and BraTS masks in {0, 1}).
COND_REGIONS: dict[str, dict[str, tuple[int, ...]]] = {
    # ch0 = label 1 (head/brain area), ch1 = label 2 (tumour); the brain area includes the tumour.
    "whole_head": {"brain": (0, 1), "tumour": (1,)},
    # ch0..2 = necrotic core, oedema, enhancing tumour; ch3 = healthy brain.
    "brats": {"brain": (0, 1, 2, 3), "tumour": (0, 1, 2)},
}


def region_mask(cond: torch.Tensor, region: str, layout: str = "whole_head") -> torch.Tensor:
    """Boolean (B, 1, D, H, W) mask of ``region`` read from the conditioning channels."""
    if layout not in COND_REGIONS or region not in COND_REGIONS[layout]:
        known = {k: sorted(v) for k, v in COND_REGIONS.items()}
        raise ValueError(f"unknown region {region!r} for cond layout {layout!r}; known: {known}")
    channels = COND_REGIONS[layout][region]
    if cond.ndim != 5 or cond.shape[1] <= max(channels):
        raise ValueError(f"region {region!r} ({layout}) needs cond (B, >{max(channels)}, D, H, W), got {tuple(cond.shape)}")
    return (cond[:, list(channels)] > 0).any(dim=1, keepdim=True)


def ms_ssim_weights(spatial_shape: Sequence[int], kernel_size: int = 7, max_scales: int = 5) -> tuple[float, ...]:
    """The most MS-SSIM scales a volume supports, with Wang et al.'s weights renormalised to sum 1.

    MONAI's :func:`~monai.metrics.regression.compute_ms_ssim` requires
    ``size // (n_scales - 1)**2 > kernel_size - 1`` on every axis, so 5 scales need >= 112
    voxels per axis at kernel 7 (128³ and 192x192x144 get all 5; 64³ gets 4, 32³ gets 3,
    16³ gets 2). Truncating the exponent list and renormalising keeps MS-SSIM a weighted
    geometric mean of the per-scale terms, so identical volumes still score exactly 1.
    """
    for n in range(max_scales, 0, -1):
        div = max(1, n - 1) ** 2
        coarsest = min(spatial_shape) // 2 ** (n - 1)
        if all(s // div > kernel_size - 1 for s in spatial_shape) and coarsest >= kernel_size:
            w = MS_SSIM_WEIGHTS[:n]
            return tuple(x / sum(w) for x in w)
    raise ValueError(f"MS-SSIM: volume {tuple(spatial_shape)} is smaller than the kernel size {kernel_size}")


def _as_volumes(name: str, pred: torch.Tensor, target: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Check (B, C, D, H, W) shapes, then cast to float32 (metrics of bf16 samples run in fp32)."""
    if not isinstance(pred, torch.Tensor) or pred.ndim != 5:
        raise ValueError(f"{name}: pred must be a (B, C, D, H, W) tensor, got {getattr(pred, 'shape', type(pred))}")
    if target is not None and target.shape != pred.shape:
        raise ValueError(f"{name}: pred {tuple(pred.shape)} and target {tuple(target.shape)} differ in shape")
    return pred.float(), None if target is None else target.float()


class VolumeMetric:
    """Cumulative metric protocol: ``update(pred, target)`` per batch, ``compute() -> float``, ``reset()``.

    ``cond`` is accepted by every metric so a loop can pass it to all of them; only region
    metrics read it. ``mask`` (bool, broadcastable to pred) is only for metrics with
    ``supports_mask``.
    """

    name: str
    higher_is_better: ClassVar[bool]
    supports_mask: ClassVar[bool] = False
    needs_target: ClassVar[bool] = True

    def update(self, pred: torch.Tensor, target: torch.Tensor | None = None, *,
               cond: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    def compute(self) -> float:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def _check(self, pred, target, mask) -> tuple[torch.Tensor, torch.Tensor | None]:
        if mask is not None and not self.supports_mask:
            raise ValueError(f"{self.name}: this metric has no in-mask variant; do not pass mask=")
        if self.needs_target and target is None:
            raise ValueError(f"{self.name}: needs a target (reference) volume")
        return _as_volumes(self.name, pred, target)


class _PerSampleMetric(VolumeMetric):
    """One value per sample, reduced over every sample seen (``mean``, ``max`` or ``sum``).

    With a region, samples whose region is empty contribute nothing (a volume with no
    tumour has no in-tumour PSNR); ``compute`` is NaN if no sample contributed.
    """

    base_name: ClassVar[str]
    reduction: ClassVar[str] = "mean"

    def __init__(self, region: str | None = None, cond_layout: str = "whole_head"):
        if region is not None and not self.supports_mask:
            raise ValueError(f"{self.base_name}: region={region!r} given, but this metric has no in-mask variant")
        self.region, self.cond_layout = region, cond_layout
        self.name = self.base_name if region is None else f"{self.base_name}_{region}"
        self.reset()

    def reset(self) -> None:
        self._values: list[torch.Tensor] = []

    def update(self, pred, target=None, *, cond=None, mask=None) -> None:
        pred, target = self._check(pred, target, mask)
        mask = _resolve_mask(self, pred, cond, mask)
        values = self._per_sample(pred, target, mask)
        if mask is not None:
            values = values[mask.flatten(1).any(1)]
        self._values.append(values.detach().double().cpu())

    def per_sample(self) -> torch.Tensor:
        """The (N,) float64 values of every sample seen so far (a region's empty samples left out)."""
        return torch.cat(self._values) if self._values else torch.empty(0, dtype=torch.float64)

    def compute(self) -> float:
        values = self.per_sample()
        if values.numel() == 0:
            return math.nan
        return float({"mean": values.mean, "max": values.max, "sum": values.sum}[self.reduction]())

    def _per_sample(self, pred, target, mask) -> torch.Tensor:
        """(B,) values; ``mask`` is None (whole volume) or a bool tensor shaped like pred."""
        raise NotImplementedError


def _resolve_mask(metric, pred: torch.Tensor, cond, mask) -> torch.Tensor | None:
    """The voxels a masked metric counts: explicit ``mask``, else its ``region`` of ``cond``, else all (None)."""
    if mask is None and metric.region is not None:
        if cond is None:
            raise ValueError(f"{metric.name}: region {metric.region!r} needs cond= (the conditioning mask)")
        mask = region_mask(cond, metric.region, metric.cond_layout)
    return None if mask is None else mask.to(device=pred.device, dtype=torch.bool).expand_as(pred)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sample mean over the masked voxels (NaN outside the mask is ignored, inside it propagates)."""
    return torch.where(mask, x, 0).flatten(1).sum(1) / mask.flatten(1).sum(1)


class PSNR(_PerSampleMetric):
    """Peak signal-to-noise ratio 20·log10(range) − 10·log10(MSE), in dB (MONAI ``PSNRMetric``).

    Identical volumes give +inf (MSE = 0), as in MONAI; the gate works on the equivalent
    normalised RMSE = 10^(−PSNR/20) instead, which is 0 there.
    """

    base_name, higher_is_better, supports_mask = "psnr", True, True

    def __init__(self, data_range: float = DATA_RANGE, region: str | None = None, cond_layout: str = "whole_head"):
        self.data_range = data_range
        self._monai = PSNRMetric(max_val=data_range, reduction="none")
        super().__init__(region, cond_layout)

    def _per_sample(self, pred, target, mask):
        if mask is None:
            return self._monai(pred, target).view(-1)
        mse = _masked_mean((pred - target) ** 2, mask)
        return 20 * math.log10(self.data_range) - 10 * torch.log10(mse)


class MAE(_PerSampleMetric):
    """Mean absolute error (MONAI ``MAEMetric`` for whole volumes)."""

    base_name, higher_is_better, supports_mask = "mae", False, True

    def _per_sample(self, pred, target, mask):
        if mask is None:
            return MAEMetric(reduction="none")(pred, target).view(-1)
        return _masked_mean((pred - target).abs(), mask)


class MaxAbsError(_PerSampleMetric):
    """Largest |pred − target| over all voxels and samples: catches local blow-ups that means hide."""

    base_name, higher_is_better, supports_mask, reduction = "max_error", False, True, "max"

    def _per_sample(self, pred, target, mask):
        err = (pred - target).abs()
        if mask is not None:
            err = torch.where(mask, err, 0)
        return err.flatten(1).amax(1)


class NonFiniteCount(_PerSampleMetric):
    """Number of NaN/inf voxels in pred (target unused); any non-zero count is a broken sample."""

    base_name, higher_is_better, supports_mask, reduction = "nonfinite", False, True, "sum"
    needs_target = False

    def _per_sample(self, pred, target, mask):
        bad = ~torch.isfinite(pred)
        if mask is not None:
            bad = bad & mask
        return bad.flatten(1).sum(1).double()


class SSIM(_PerSampleMetric):
    """3-D SSIM (Wang et al. 2004), Gaussian window 7³ like MS-SSIM (MONAI ``SSIMMetric(spatial_dims=3)``).

    SSIM's luminance term (2μxμy + c1)/(μx² + μy² + c1) is defined for intensities in
    [0, L] and is not shift-invariant: on [-1, 1] data, regions with mean near 0 would score
    0.5 for a tiny offset. Volumes are therefore shifted by ``-data_min`` into [0, data_range]
    first (``data_min=-1`` for Med-DDPM data), matching SSIM computed on [0, 1]-scaled images.
    """

    base_name, higher_is_better = "ssim", True

    def __init__(self, data_range: float = DATA_RANGE, data_min: float = -1.0, kernel_size: int = 7,
                 kernel_sigma: float = 1.5):
        self.data_min = data_min
        self._monai = SSIMMetric(spatial_dims=3, data_range=data_range, win_size=kernel_size,
                                 kernel_sigma=kernel_sigma, reduction="none")
        super().__init__()

    def _per_sample(self, pred, target, mask):
        return self._monai(pred - self.data_min, target - self.data_min).view(-1)


class MSSSIM(_PerSampleMetric):
    """3-D MS-SSIM (Wang et al. 2003), kernel 7, as many scales as the volume allows.

    ``weights=None`` picks them with :func:`ms_ssim_weights` from each batch's shape. Volumes
    are shifted into [0, data_range] first, as for :class:`SSIM`.
    """

    base_name, higher_is_better = "ms_ssim", True

    def __init__(self, data_range: float = DATA_RANGE, data_min: float = -1.0, kernel_size: int = 7,
                 kernel_sigma: float = 1.5, weights: Sequence[float] | None = None):
        self.data_range, self.data_min = data_range, data_min
        self.kernel_size, self.kernel_sigma = kernel_size, kernel_sigma
        self.weights = None if weights is None else tuple(weights)
        super().__init__()

    def _per_sample(self, pred, target, mask):
        weights = self.weights or ms_ssim_weights(pred.shape[2:], self.kernel_size)
        monai = MultiScaleSSIMMetric(spatial_dims=3, data_range=self.data_range, kernel_size=self.kernel_size,
                                     kernel_sigma=self.kernel_sigma, weights=weights, reduction="none")
        return monai(pred - self.data_min, target - self.data_min).view(-1)


class Diversity(VolumeMetric):
    """Mean pairwise MS-SSIM between samples generated for the same mask (pred only).

    Samples in a batch are grouped by identical ``cond`` (all one group when cond is None);
    every pair inside a group contributes. Lower means more diverse; a sampler that
    collapses modes scores higher than the reference. The gate compares it with the
    reference's own value rather than optimising it.
    """

    name, higher_is_better, needs_target = "diversity", False, False

    def __init__(self, data_range: float = DATA_RANGE, data_min: float = -1.0, kernel_size: int = 7):
        self._pair = MSSSIM(data_range=data_range, data_min=data_min, kernel_size=kernel_size)
        self.reset()

    def reset(self) -> None:
        self._pair.reset()

    def update(self, pred, target=None, *, cond=None, mask=None) -> None:
        pred, _ = self._check(pred, None, mask)
        groups = _groups_by_cond(cond, len(pred))
        pairs = [p for g in groups for p in itertools.combinations(g, 2)]
        if pairs:
            i, j = map(list, zip(*pairs))
            self._pair.update(pred[i], pred[j])

    def compute(self) -> float:
        return self._pair.compute()


def _groups_by_cond(cond: torch.Tensor | None, n: int) -> list[list[int]]:
    """Indices of samples that share an identical conditioning mask."""
    if cond is None:
        return [list(range(n))]
    groups: list[list[int]] = []
    for i in range(n):
        for g in groups:
            if torch.equal(cond[g[0]], cond[i]):
                g.append(i)
                break
        else:
            groups.append([i])
    return groups


class HistogramDistance(VolumeMetric):
    """Wasserstein-1 distance between the intensity histograms of all pred and all target voxels.

    W1 = ∫ |CDF_pred − CDF_target| dx (Villani 2009; for 1-D distributions it is the area
    between the CDFs). Values are clamped into ``value_range`` so no mass is lost, and
    non-finite voxels are left out (count them with :class:`NonFiniteCount`). Same units as
    the intensities; 0 for identical histograms.
    """

    name, higher_is_better, supports_mask = "histogram_w1", False, True

    def __init__(self, bins: int = 256, value_range: Sequence[float] = (-1.0, 1.0),
                 region: str | None = None, cond_layout: str = "whole_head"):
        self.bins, self.lo, self.hi = bins, float(value_range[0]), float(value_range[1])
        self.region, self.cond_layout = region, cond_layout
        if region is not None:
            self.name = f"histogram_w1_{region}"
        self.reset()

    def reset(self) -> None:
        self._counts = [torch.zeros(self.bins, dtype=torch.float64) for _ in range(2)]

    def update(self, pred, target=None, *, cond=None, mask=None) -> None:
        pred, target = self._check(pred, target, mask)
        mask = _resolve_mask(self, pred, cond, mask)
        for k, x in enumerate((pred, target)):
            keep = torch.isfinite(x) if mask is None else torch.isfinite(x) & mask
            vals = x[keep].clamp(self.lo, self.hi)
            self._counts[k] += torch.histc(vals, self.bins, self.lo, self.hi).double().cpu()

    def compute(self) -> float:
        p, q = (c / c.sum() for c in self._counts)
        width = (self.hi - self.lo) / self.bins
        return float((p.cumsum(0) - q.cumsum(0)).abs().sum() * width)


class _SetMetric(VolumeMetric):
    """Accumulates an embedding of every pred and target sample; compares the two sets at the end."""

    def reset(self) -> None:
        self._sets: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])

    def update(self, pred, target=None, *, cond=None, mask=None) -> None:
        pred, target = self._check(pred, target, mask)
        for store, x in zip(self._sets, (pred, target)):
            store.append(self._embed(x).detach().double().cpu())

    def compute(self) -> float:
        pred, target = (torch.cat(s) if s else torch.empty(0) for s in self._sets)
        if len(pred) < 2 or len(target) < 2:
            raise ValueError(f"{self.name}: needs at least 2 pred and 2 target samples, got {len(pred)} and {len(target)}")
        return float(self._distance(pred, target))

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)

    def _distance(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class MMD(_SetMetric):
    """Unbiased linear-kernel MMD² on raw voxels (Gretton et al. 2012, eq. 3; MONAI ``MMDMetric``).

    Being unbiased, the estimate can be negative (about −mean‖x‖²/N for two draws of one
    distribution); compare it with the seed-to-seed floor, never with 0.
    """

    name, higher_is_better = "mmd", False

    def __init__(self):
        self._monai = MMDMetric()
        self.reset()

    def _distance(self, pred, target):
        if pred.shape != target.shape:
            raise ValueError(f"mmd: MONAI's MMD needs as many pred as target samples, got {len(pred)} and {len(target)}")
        return self._monai(target, pred)  # MONAI's order is (y, y_pred)


class _FeatureSetMetric(_SetMetric):
    """A set metric over the features of a pluggable :class:`FeatureExtractor`."""

    def __init__(self, extractor: FeatureExtractor | None = None):
        self.extractor = extractor if extractor is not None else RandomConv3dFeatures()
        self.reset()

    def _embed(self, x):
        return self.extractor.to(x.device)(x)

    def describe(self) -> dict[str, Any]:
        return {"metric": self.name, "extractor": self.extractor.describe()}


class FID(_FeatureSetMetric):
    """Fréchet distance between Gaussians fitted to pred and target features (Heusel et al. 2017)."""

    name, higher_is_better = "fid", False

    def _distance(self, pred, target):
        return frechet_distance(pred, target)


class KID(_FeatureSetMetric):
    """Kernel inception distance: unbiased MMD² with the cubic polynomial kernel (Bińkowski et al. 2018)."""

    name, higher_is_better = "kid", False

    def _distance(self, pred, target):
        return kernel_distance(pred, target)


def _psd_sqrt(m: torch.Tensor) -> torch.Tensor:
    """Square root of a symmetric PSD matrix through ``eigh`` (negative round-off eigenvalues -> 0)."""
    vals, vecs = torch.linalg.eigh((m + m.T) / 2)
    return (vecs * vals.clamp_min(0).sqrt()) @ vecs.T


def frechet_distance(feats_a: torch.Tensor, feats_b: torch.Tensor) -> torch.Tensor:
    """FID = ||μa − μb||² + tr(Σa + Σb − 2(Σa Σb)^½), computed in float64 torch.

    tr((Σa Σb)^½) = tr((Σa^½ Σb Σa^½)^½) because the two products are similar matrices and the
    second is symmetric PSD, so a symmetric ``eigh`` replaces ``scipy.linalg.sqrtm`` (whose
    return signature changed in scipy 1.18 and breaks MONAI's ``FIDMetric``). Rank-deficient
    covariances (fewer samples than features) are fine.
    """
    a, b = feats_a.double(), feats_b.double()
    if not (a.isfinite().all() and b.isfinite().all()):
        return torch.tensor(math.nan, dtype=torch.float64)  # a broken sample: eigh would raise
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = torch.cov(a.T).reshape(a.shape[1], -1), torch.cov(b.T).reshape(b.shape[1], -1)
    root_a = _psd_sqrt(cov_a)
    inner = root_a @ cov_b @ root_a
    tr_covmean = torch.linalg.eigvalsh((inner + inner.T) / 2).clamp_min(0).sqrt().sum()
    fid = (mu_a - mu_b).square().sum() + cov_a.trace() + cov_b.trace() - 2 * tr_covmean
    return fid.clamp_min(0)  # >= 0 exactly; round-off of equal sets can land a hair below


def kernel_distance(feats_a: torch.Tensor, feats_b: torch.Tensor) -> torch.Tensor:
    """Unbiased MMD² with k(x, y) = (x·y / d + 1)³ over all samples (Bińkowski et al. 2018, eq. 4)."""
    a, b = feats_a.double(), feats_b.double()
    d, m, n = a.shape[1], len(a), len(b)
    k_aa, k_bb, k_ab = ((x @ y.T / d + 1) ** 3 for x, y in ((a, a), (b, b), (a, b)))
    off_diag = lambda k: k.sum() - k.diagonal().sum()  # noqa: E731
    return off_diag(k_aa) / (m * (m - 1)) + off_diag(k_bb) / (n * (n - 1)) - 2 * k_ab.mean()


METRICS: dict[str, Callable[..., VolumeMetric]] = {
    "psnr": PSNR, "mae": MAE, "max_error": MaxAbsError, "nonfinite": NonFiniteCount,
    "ssim": SSIM, "ms_ssim": MSSSIM, "diversity": Diversity, "histogram_w1": HistogramDistance,
    "mmd": MMD, "fid": FID, "kid": KID,
}


def build_metric(name: str, **kwargs: Any) -> VolumeMetric:
    """Instantiate a metric from the :data:`METRICS` registry by name."""
    if name not in METRICS:
        raise ValueError(f"unknown metric {name!r}; known: {sorted(METRICS)}")
    return METRICS[name](**kwargs)


def build_metrics(cfg: Mapping | None) -> dict[str, VolumeMetric]:
    """Instantiate the ``metric`` config group (multi-select: one ``_target_`` node per key)."""
    from hydra.utils import instantiate

    metrics = {}
    for key, node in (cfg or {}).items():
        if not isinstance(node, Mapping) or "_target_" not in node:
            raise ValueError(f"metric config {key!r}: expected a node with a _target_, got {node!r}")
        metrics[key] = instantiate(node)
    return metrics
