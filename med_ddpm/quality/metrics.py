"""Image-fidelity metrics for synthesised volumes, with one argument order: ``update(pred, target)``.

Example:
    >>> psnr = PSNR(data_range=2.0, region="tumour")
    >>> psnr.update(sample, reference, cond=cond)      # (B, C, D, H, W) each; cond (B, 2, D, H, W)
    >>> psnr.compute()                                 # mean over samples, in dB

Every metric is cumulative (``update`` over batches, ``compute`` once, ``reset``), declares
``name`` and ``higher_is_better``, and takes the candidate first and the reference second:
MONAI's own metrics take ``(y_pred, y)``; the wrappers keep that order and add regions. Data are
Med-DDPM's [-1, 1] volumes, so ``data_range`` defaults to 2.

Two families of paired metrics:

* voxel metrics (PSNR, MAE, max error), optionally restricted to a region of the conditioning
  mask (``region="brain" | "tumour"`` or an explicit ``mask``);
* structural metrics (3-D SSIM, 3-D MS-SSIM), whole volume.

:func:`frechet_distance` is FID's distance between feature sets. The set comparisons with their
permutation nulls (KID, MMD, histogram W1, diversity gap) are in :mod:`med_ddpm.quality.stats`.

MONAI is imported where a metric is built or computed: ``import monai`` takes seconds (it imports scipy and
matplotlib), and the commands that import the quality gate without computing a metric (``bench.report``,
``bench.sweep``, ``bench.ladder``) start without it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch

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
        if target is None:
            raise ValueError(f"{self.name}: needs a target (reference) volume")
        return _as_volumes(self.name, pred, target)


class _PerSampleMetric(VolumeMetric):
    """One value per sample, reduced over every sample seen (``mean`` or ``max``).

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
        return float({"mean": values.mean, "max": values.max}[self.reduction]())

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
        from monai.metrics import PSNRMetric

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
            from monai.metrics import MAEMetric

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
        from monai.metrics import SSIMMetric

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
        from monai.metrics import MultiScaleSSIMMetric

        weights = self.weights or ms_ssim_weights(pred.shape[2:], self.kernel_size)
        monai = MultiScaleSSIMMetric(spatial_dims=3, data_range=self.data_range, kernel_size=self.kernel_size,
                                     kernel_sigma=self.kernel_sigma, weights=weights, reduction="none")
        return monai(pred - self.data_min, target - self.data_min).view(-1)


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

