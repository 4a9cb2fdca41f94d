"""Procedural head phantoms: the embedded default dataset, so everything runs with no download.

Each phantom is a few random ellipsoids (scalp, skull, brain, ventricles, tumour) in a normalised [-1, 1]^3
box, so any (D, H, W) size works, with smooth texture from upsampled low-resolution noise. Everything is
vectorised numpy/torch (a 64^3 phantom takes a few milliseconds). Item ``i`` depends only on ``(seed, i)``,
so datasets of different lengths, workers and resumed runs all see the same volumes.

Variants follow ``med_ddpm.data.encoding.VARIANTS``:
* ``whole_head``: one T1-like channel with skull and scalp; labels 0 background, 1 head (everything inside
  the scalp except the tumour: like the real masks, whose "brain" label covers most of the head), 2 tumour.
* ``brats``: skull-stripped brain, four modalities (t1, t1ce, t2, flair) with their typical contrasts;
  Med-DDPM labels 1 necrotic core, 2 oedema, 3 enhancing tumour, 4 healthy brain.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from med_ddpm.config_checks import ConfigError, check_one_of
from med_ddpm.data.cache import cached_dataset, resolve_cache
from med_ddpm.data.discovery import BRATS_MODALITIES
from med_ddpm.data.encoding import get_variant, labels_to_cond, medddpm_slice_minmax
from med_ddpm.data.volume_io import save_volume_like

# Tissue classes of the phantom (not labels: several tissues share a label).
BACKGROUND, BRAIN, CSF, NECROSIS, OEDEMA, ENHANCING, SKULL, SCALP = range(8)
# Mean intensity per tissue (rows) and channel (columns) before texture; background must stay 0.
TISSUE_INTENSITY = {
    "whole_head": np.array([[0.0], [0.6], [0.2], [0.9], [0.9], [0.9], [0.12], [0.75]], dtype=np.float32),
    #                  t1    t1ce   t2    flair
    "brats": np.array([[0.0, 0.0, 0.0, 0.0],
                       [0.55, 0.55, 0.45, 0.45],
                       [0.15, 0.15, 0.95, 0.10],
                       [0.20, 0.25, 0.90, 0.50],
                       [0.42, 0.45, 0.85, 0.90],
                       [0.50, 0.98, 0.70, 0.70],
                       [0.0, 0.0, 0.0, 0.0],
                       [0.0, 0.0, 0.0, 0.0]], dtype=np.float32),
}
# Grey/white-matter contrast: brain intensity + slope * pattern, pattern in (-1, 1).
GREY_WHITE_SLOPE = {"whole_head": np.array([0.15]), "brats": np.array([0.12, 0.12, -0.10, -0.05])}
# Label of each tissue class per variant (whole-head: the tumour tissues all become tumour 2).
TISSUE_LABEL = {"whole_head": np.array([0, 1, 1, 2, 2, 2, 1, 1], dtype=np.uint8),
                "brats": np.array([0, 4, 4, 1, 2, 3, 0, 0], dtype=np.uint8)}

# Tumour ellipsoid radii (fraction of the half box): whole-head tumours are small (231-2,201 of 128^3 voxels
# in the real masks); BraTS cases are selected for large gliomas with visible sub-regions.
TUMOUR_SIZE = {"whole_head": (0.07, 0.16), "brats": (0.18, 0.3)}


def _grid(size: Sequence[int]) -> tuple[np.ndarray, ...]:
    axes = [np.linspace(-1.0, 1.0, int(n), dtype=np.float32) for n in size]
    return tuple(np.meshgrid(*axes, indexing="ij", sparse=True))  # broadcasting, no full 3-D grids


def _ellipsoid(grid: tuple[np.ndarray, ...], centre: np.ndarray, radii: np.ndarray) -> np.ndarray:
    """Quadratic form sum(((x - c) / r)^2): <= 1 inside the ellipsoid."""
    return sum(((g - c) / r) ** 2 for g, c, r in zip(grid, centre, radii))


def _smooth_noise(rng: np.random.Generator, size: Sequence[int], cells: int) -> np.ndarray:
    """Band-limited noise: a cells^3 Gaussian grid upsampled trilinearly (unit-ish amplitude)."""
    coarse = torch.from_numpy(rng.standard_normal((1, 1, cells, cells, cells)).astype(np.float32))
    return F.interpolate(coarse, size=tuple(int(s) for s in size), mode="trilinear", align_corners=True)[0, 0].numpy()


def _tissue_map(rng: np.random.Generator, size: Sequence[int], tumour_size: tuple[float, float]) -> np.ndarray:
    """Random head anatomy as a (D, H, W) map of tissue classes; tumour radii drawn from ``tumour_size``."""
    grid = _grid(size)
    head_c = rng.uniform(-0.04, 0.04, 3)
    head_r = rng.uniform([0.74, 0.80, 0.72], [0.84, 0.90, 0.82])
    brain_r = head_r * rng.uniform(0.82, 0.88)
    head, skull_in = _ellipsoid(grid, head_c, head_r), _ellipsoid(grid, head_c, head_r * 0.93)
    brain = _ellipsoid(grid, head_c, brain_r) <= 1
    tissue = np.zeros(np.broadcast_shapes(*(g.shape for g in grid)), dtype=np.uint8)
    tissue[head <= 1] = SCALP
    tissue[skull_in <= 1] = SKULL
    tissue[brain] = BRAIN
    for side in (-1, 1):  # lateral ventricles, left/right along W
        offset = np.array([0.05, -0.05, 0.12 * side]) * brain_r / 0.7
        tissue[_ellipsoid(grid, head_c + offset, brain_r * np.array([0.3, 0.35, 0.08])) <= 1] = CSF
    direction = rng.normal(size=3)
    tumour_c = head_c + direction / np.linalg.norm(direction) * rng.uniform(0.1, 0.5) * brain_r
    tumour_r = rng.uniform(*tumour_size, 3)
    tumour = _ellipsoid(grid, tumour_c, tumour_r)
    for tissue_class, scale in ((OEDEMA, rng.uniform(1.3, 1.6)), (ENHANCING, 1.0), (NECROSIS, rng.uniform(0.5, 0.7))):
        tissue[(tumour <= scale**2) & brain] = tissue_class
    return tissue


def generate_phantom(size: Sequence[int], variant: str = "whole_head", *, seed: int = 0,
                     index: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One phantom: image (C, D, H, W) float32 in [-1, 1] and labels (D, H, W) uint8, in model axis order.

    Every channel has background exactly -1 and maximum exactly 1, and tissue strictly above -1, so a volume
    min-max leaves it unchanged and the BraTS "t1 > -1" healthy-brain rule recovers the labels.
    """
    rng = np.random.default_rng([int(seed), int(index)])
    tissue = _tissue_map(rng, size, TUMOUR_SIZE[variant])
    if variant == "brats":  # BraTS volumes are skull-stripped
        tissue[(tissue == SKULL) | (tissue == SCALP)] = BACKGROUND
    grey_white = np.tanh(3 * _smooth_noise(rng, size, 7))
    texture = np.clip(1 + 0.10 * _smooth_noise(rng, size, 4) + 0.04 * _smooth_noise(rng, size, 16), 0.5, 1.5)
    image = np.moveaxis(TISSUE_INTENSITY[variant][tissue], -1, 0)  # (C, D, H, W)
    image += GREY_WHITE_SLOPE[variant][:, None, None, None].astype(np.float32) * grey_white * (tissue == BRAIN)
    image *= texture
    image = image / image.max(axis=(1, 2, 3), keepdims=True) * 2 - 1
    return image.astype(np.float32), TISSUE_LABEL[variant][tissue]


class SyntheticPhantoms(Dataset):
    """Deterministic dataset of head phantoms with items like the NIfTI datasets' ("image", "cond", "name").

    Args:
        num_volumes: dataset length.
        image_size: (D, H, W).
        variant: ``whole_head`` (1 image channel, 2 cond channels in {-1, 1}) or ``brats`` (4 and 4 in {0, 1}).
        seed: item i depends only on (seed, i).
        intensity: ``volume_minmax``/``none`` keep the generated [-1, 1] volume; ``medddpm_slice_minmax``
            applies the original's per-slice scaling, as the NIfTI loader would.
        cache: ``memory`` generates every phantom once, at construction (MONAI ``CacheDataset``), so a training
            step does not wait for procedural generation; ``auto`` does so when the set fits
            (:func:`med_ddpm.data.cache.resolve_cache`); ``none`` generates each item when it is read.
    """

    def __init__(self, num_volumes: int = 8, image_size: Sequence[int] = (32, 32, 32), *,
                 variant: str = "whole_head", seed: int = 0, intensity: str = "volume_minmax",
                 cache: str = "none") -> None:
        if num_volumes < 1:
            raise ConfigError(f"data.num_volumes={num_volumes}: must be >= 1; pass data.num_volumes=N with N >= 1")
        self.variant = get_variant(variant)
        self.num_volumes, self.image_size, self.seed = int(num_volumes), tuple(int(s) for s in image_size), int(seed)
        self.intensity = intensity
        check_one_of("data.cache", cache, ("auto", "memory", "none"))  # nothing to keep on disk: generation is cheap
        self.cache = resolve_cache(cache, self.num_volumes, self.variant, self.image_size)
        self._cached = None
        if self.cache == "memory":
            from monai.transforms import Lambda  # a MONAI transform: CacheDataset caches only those

            self._cached = cached_dataset(range(self.num_volumes), Lambda(self.generate), "memory", None)

    def __len__(self) -> int:
        return self.num_volumes

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_volumes:
            raise IndexError(f"phantom index {index} out of range [0, {self.num_volumes})")
        # a copy of the cached item (MONAI hands out the cached object itself): an in-place edit stays the caller's
        return copy.deepcopy(self._cached[index]) if self._cached is not None else self.generate(index)

    def generate(self, index: int) -> dict:
        """Item ``index``, generated now: a function of (seed, index) alone."""
        image, labels = generate_phantom(self.image_size, self.variant.name, seed=self.seed, index=index)
        image = torch.from_numpy(image)
        if self.intensity == "medddpm_slice_minmax":
            image = medddpm_slice_minmax(image)
        cond = labels_to_cond(torch.from_numpy(labels)[None], self.variant)
        return {"image": image, "cond": cond, "name": f"phantom_{index:04d}"}


def _raw_brats_labels(labels: np.ndarray) -> np.ndarray:
    """Med-DDPM labels -> BraTS release labels (enhancing 3 -> 4, healthy brain 4 -> 0)."""
    return np.array([0, 1, 2, 4, 0], dtype=np.uint8)[labels]


def _brats_file(root: Path, layout: str, case: str, kind: str) -> Path:
    if layout not in ("per_case", "per_modality"):
        raise ValueError(f"layout={layout!r} is not one of ['per_case', 'per_modality']")
    return (root / case if layout == "per_case" else root / kind) / f"{case}_{kind}.nii.gz"


def write_phantom_niftis(root: str | Path, num_volumes: int, image_size: Sequence[int] = (32, 32, 32), *,
                         variant: str = "whole_head", seed: int = 0, layout: str = "per_case",
                         raw_labels: bool = True, names: Sequence[str] | None = None,
                         spacing: float = 1.5) -> list[str]:
    """Write phantoms as NIfTI files in a layout ``med_ddpm.data.datasets`` reads (for tests and the demo).

    whole_head: ``<root>/image/<name>.nii.gz`` + ``<root>/mask/<name>.nii.gz``. brats: ``layout`` per_case
    (``<root>/<name>/<name>_<mod>.nii.gz``) or per_modality (``<root>/<mod>/<name>_<mod>.nii.gz``), with the
    release's raw labels unless ``raw_labels=False``. Phantom i is named ``names[i]`` (default
    ``phantom_0000``...). Volumes are written in NIfTI axis order (the model's reversed), RAS affine with
    ``spacing`` mm voxels.

    Returns:
        The case names written.
    """
    root, names = Path(root), list(names or [f"phantom_{i:04d}" for i in range(num_volumes)])
    affine = np.diag([spacing, spacing, spacing, 1.0])
    for index, name in enumerate(names[:num_volumes]):
        image, labels = generate_phantom(image_size, variant, seed=seed, index=index)
        if variant == "whole_head":
            files = {root / "image" / f"{name}.nii.gz": image, root / "mask" / f"{name}.nii.gz": labels}
        else:
            files = {_brats_file(root, layout, name, m): image[c] for c, m in enumerate(BRATS_MODALITIES)}
            files[_brats_file(root, layout, name, "seg")] = _raw_brats_labels(labels) if raw_labels else labels
        for path, volume in files.items():
            save_volume_like(volume, (affine, None), path)
    return names[:num_volumes]
