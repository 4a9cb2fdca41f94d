"""NIfTI datasets for Med-DDPM: up-front validation, MONAI preprocessing, caching (which files make a case:
:mod:`med_ddpm.data.discovery`).

Two on-disk layouts are supported, as documented in the Med-DDPM repository's sample data and
``tests/data/reference/BRATS.md``:

* whole-head: ``<root>/image/<name>.nii.gz`` + ``<root>/mask/<name>.nii.gz`` paired by file name
  (labels 0 background, 1 brain/head, 2 tumour -> 2 condition channels in {-1, 1});
* BraTS: one folder per case (``<case>/<case>_{t1,t1ce,t2,flair,seg}.nii.gz``, the official release) or one
  folder per modality (``t1/<case>_t1.nii.gz`` ..., Med-DDPM's repository), paired by case ID
  (4 image channels t1, t1ce, t2, flair; Med-DDPM labels 1..4 -> 4 condition channels in {0, 1}).

Every file is read once when a dataset is built, so a truncated download or a label map with a stray label
fails at start-up with the file's name instead of hours into training. Items are dicts
``{"image": (C_img, D, H, W) float32 in [-1, 1], "cond": (C_mask, D, H, W) float32, "name": str}`` in the
original's axis order: model[c, d, h, w] = nifti[w, h, d, c] (spatial axes fully reversed), so original
Med-DDPM checkpoints see what they were trained on.

MONAI is imported inside the functions that build transforms and datasets: ``import monai`` imports every
MONAI submodule (scipy and matplotlib with them), which a command that only checks its options or prints
its config does not need. Its submodules also import every optional package they find installed (transformers,
torchvision, CuPy...); a process that only reads and preprocesses volumes hides those first
(:func:`without_monai_extras`).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import nibabel as nib
import numpy as np
import torch
from torch.utils.data import Dataset

from med_ddpm.config_checks import DataError, check_one_of
from med_ddpm.data.cache import CACHE_MODES, cached_dataset, resolve_cache
from med_ddpm.data.discovery import (
    BRATS_FIX,
    WHOLE_HEAD_FIX,
    Case,
    Pairing,
    list_brats_cases,
    list_pairs,
    nifti_stem,
)
from med_ddpm.data.encoding import (
    VARIANTS,
    Variant,
    get_variant,
    labels_to_cond,
    medddpm_slice_minmax,
    plain_tensor,
    remap_brats_raw_labels,
)
from med_ddpm.data.phantoms import SyntheticPhantoms

if TYPE_CHECKING:
    from monai.transforms import Compose

INTENSITY_MODES = ("volume_minmax", "medddpm_slice_minmax", "none")
RESIZE_MODES = ("crop_or_pad", "resample")
BAD_FILE_MODES = ("error", "skip")
SEG_LABEL_MODES = ("auto", "raw", "medddpm")
NIFTI_AXES_TO_MODEL = (0, 3, 2, 1)  # (C, i, j, k) -> (C, k, j, i); its own inverse
# Optional packages that MONAI's import loads where they are installed (its network zoo, readers and GPU transforms)
# and that these transforms never use. On a GPU image that has them they are most of ``import monai``'s time.
MONAI_EXTRAS_UNUSED = ("transformers", "torchvision", "cupy", "cucim", "itk", "tensorboard", "pandas", "skimage")


def without_monai_extras() -> None:
    """Make :data:`MONAI_EXTRAS_UNUSED` unimportable in this process before it imports MONAI.

    For a process that only reads, preprocesses or writes volumes: ``sample``'s masks' worker and writers, and the
    process that builds training's dataset. A ``None`` in ``sys.modules`` makes an import raise
    ``ModuleNotFoundError``, which MONAI's optional imports take for "not installed": MONAI then runs as it does
    without them (as in the tests), and its import leaves theirs out. A package this process imported already stays
    as it is.
    """
    for name in MONAI_EXTRAS_UNUSED:
        sys.modules.setdefault(name, None)


# ----------------------------------------------------------------------------------------------------------
# Validation: every file read in full once, before training starts
# ----------------------------------------------------------------------------------------------------------


def read_volume(path: Path, role: str) -> tuple[np.ndarray, nib.Nifti1Image]:
    """Read a 3-D NIfTI volume completely; raise ``DataError`` naming the file for any defect.

    Trailing singleton axes ((i, j, k, 1) files) are accepted; MONAI's reader squeezes them the same way.
    """
    try:
        img = nib.load(str(path))
        data = np.asanyarray(img.dataobj)  # decompresses everything: catches truncated .nii.gz
    except Exception as err:  # nibabel/gzip/zlib raise many types for a broken file
        raise DataError(f"{path}: unreadable NIfTI {role} ({type(err).__name__}: {err})") from err
    while data.ndim > 3 and data.shape[-1] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise DataError(f"{path}: {role} has {data.ndim} dimensions (shape {data.shape}); expected a 3-D volume")
    bad = data.size - int(np.isfinite(data).sum()) if data.dtype.kind == "f" else 0
    if bad:
        raise DataError(f"{path}: {role} contains {bad} NaN/inf voxels")
    return data, img


def check_labels(data: np.ndarray, path: Path, allowed: Sequence[int]) -> np.ndarray:
    """Check that a mask is an integer label map with labels in ``allowed``; return the labels present."""
    values = np.unique(data)
    if not np.array_equal(values, np.round(values)):
        odd = values[values != np.round(values)][:5]
        raise DataError(f"{path}: mask is not a label map (non-integer values such as {odd.tolist()}); "
                        "pass the label mask, not an image")
    unexpected = sorted(set(values.astype(int).tolist()) - set(allowed))
    if unexpected:
        raise DataError(f"{path}: unexpected mask labels {unexpected} (expected a subset of {list(allowed)}); "
                        "a BraTS seg needs a BraTS checkpoint or data=brats, a whole-head mask the whole-head model")
    return values.astype(int)


def _check_intensity(data: np.ndarray, path: Path, intensity: str) -> None:
    if data.min() == data.max():
        raise DataError(f"{path}: image is constant (every voxel {data.min()}); cannot scale it to [-1, 1]")
    if intensity == "none" and (data.min() < -1 or data.max() > 1):
        raise DataError(
            f"{path}: intensity 'none' needs values in [-1, 1], found [{data.min()}, {data.max()}]"
        )


def resolve_seg_labels(seg_labels: str, labels: np.ndarray, seg: np.ndarray, t1: np.ndarray | None,
                       path: Path) -> str:
    """Decide whether a BraTS seg holds raw release labels or Med-DDPM's (with healthy brain = 4).

    ``auto``: label 3 only exists after remapping; without it, a raw seg still has label-0 voxels inside
    the head (t1 above its minimum), which the Med-DDPM preprocessing turns into 4. Without a t1 volume, a
    Med-DDPM seg is recognised by label 4 (healthy brain) outweighing the tumour labels.
    """
    check_one_of("data.seg_labels", seg_labels, SEG_LABEL_MODES)
    present = set(labels.tolist())
    if seg_labels == "auto":
        if 3 in present:
            seg_labels = "medddpm"
        elif t1 is not None:
            seg_labels = "raw" if np.any((seg == 0) & (t1 > t1.min())) else "medddpm"
        elif 4 in present and (seg == 4).sum() > np.isin(seg, (1, 2)).sum():
            seg_labels = "medddpm"
        else:  # only a mask to sample for has no t1 (load_condition); a training case always has one
            raise DataError(f"{path}: labels {sorted(present)} may be raw BraTS labels (0, 1, 2, 4) or Med-DDPM's "
                            "(0..4, 4 healthy brain), which only the case's t1 volume tells apart; if they are "
                            "Med-DDPM's, pass data=brats data.seg_labels=medddpm (sampling takes no raw BraTS labels; "
                            "a whole-head mask needs a whole-head checkpoint)")
    if seg_labels == "raw" and 3 in present:
        raise DataError(f"{path}: unexpected mask labels [3] for a raw BraTS seg (raw labels are 0, 1, 2, 4); "
                        "pass data.seg_labels=medddpm for Med-DDPM's relabelled segs")
    return seg_labels


def validate_case(case: Case, variant: Variant, intensity: str, seg_labels: str = "auto") -> dict[str, Any]:
    """Read every file of ``case`` and return the record the MONAI pipeline loads.

    Raises:
        DataError: naming the file and the problem (unreadable, rank, NaN/inf, labels, shape mismatch).
    """
    mask, _ = read_volume(case.mask, "mask")
    labels = check_labels(mask, case.mask, variant.labels)
    t1 = None
    for index, path in enumerate(case.images):
        image, _ = read_volume(path, "image")
        if image.shape != mask.shape:
            raise DataError(f"{path}: image shape {image.shape} does not match mask {case.mask} shape {mask.shape}")
        _check_intensity(image, path, intensity)
        t1 = image if index == 0 else t1
    record = {"image": [str(p) for p in case.images], "mask": str(case.mask), "name": case.name}
    if variant.name == "brats":
        record["seg_labels"] = resolve_seg_labels(seg_labels, labels, mask, t1, case.mask)
    return record


# ----------------------------------------------------------------------------------------------------------
# MONAI preprocessing pipeline
# ----------------------------------------------------------------------------------------------------------


def _intensity_step(intensity: str) -> list[Callable]:
    from monai.transforms import Lambdad, ScaleIntensityd

    check_one_of("data.intensity", intensity, INTENSITY_MODES)
    if intensity == "volume_minmax":  # each modality on its own, like the original BraTS preprocessing
        return [ScaleIntensityd("image", minv=-1.0, maxv=1.0, channel_wise=True)]
    if intensity == "medddpm_slice_minmax":
        return [Lambdad("image", medddpm_slice_minmax)]
    return []


def _resize_steps(keys: Sequence[str], image_size: Sequence[int], resize_mode: str) -> list[Callable]:
    """Bring (C, D, H, W) tensors to ``image_size`` (D, H, W): centre crop/pad or resampling.

    Images are padded with -1, the background value after scaling; masks with label 0.
    """
    from monai.transforms import Resized, ResizeWithPadOrCropd

    check_one_of("data.resize_mode", resize_mode, RESIZE_MODES)
    size = tuple(int(s) for s in image_size)
    if resize_mode == "resample":
        return [Resized(keys, size, mode=tuple("nearest" if k == "mask" else "trilinear" for k in keys))]
    return [ResizeWithPadOrCropd(k, size, mode="constant", value=-1.0 if k == "image" else 0.0) for k in keys]


def _apply_seg_convention(item: dict[str, Any]) -> dict[str, Any]:
    if item.get("seg_labels") == "raw":
        item["mask"] = remap_brats_raw_labels(item["mask"], item["image"][0:1])
    return item


def _finalise(item: dict[str, Any], variant: Variant) -> dict[str, Any]:
    """Plain tensors in the item layout: cond from the label map, image as float32."""
    out = {"cond": labels_to_cond(item["mask"], variant), "name": item["name"]}
    if "image" in item:
        out["image"] = plain_tensor(item["image"]).float().contiguous()
    return out


def build_transforms(variant: Variant, image_size: Sequence[int], *, intensity: str = "volume_minmax",
                     resize_mode: str = "crop_or_pad", keys: Sequence[str] = ("image", "mask")) -> Compose:
    """Deterministic pipeline from a record of file paths to a model-ready item.

    Load (channel first) -> reverse spatial axes to the original's model order -> scale intensities ->
    BraTS raw-label remapping (needs the scaled t1) -> crop/pad or resample -> one-hot condition.
    """
    from monai.data.image_reader import NibabelReader
    from monai.transforms import Compose, Lambda, LoadImaged, Transposed

    keys = list(keys)
    reader = NibabelReader(squeeze_non_spatial_dims=True)
    steps: list[Callable] = [
        LoadImaged(keys, reader=reader, image_only=True, ensure_channel_first=True),
        Transposed(keys, NIFTI_AXES_TO_MODEL),  # model[c, d, h, w] = nifti[w, h, d, c]
    ]
    if "image" in keys:
        steps += _intensity_step(intensity)
    steps += [Lambda(_apply_seg_convention), *_resize_steps(keys, image_size, resize_mode), Lambda(partial(_finalise, variant=variant))]  # picklable for workers
    return Compose(steps)


# ----------------------------------------------------------------------------------------------------------
# Datasets
# ----------------------------------------------------------------------------------------------------------


class NiftiPairDataset(Dataset):
    """Validated image/mask cases behind a MONAI (optionally caching) dataset.

    Attributes:
        variant: the ``Variant`` (channel counts) the items follow.
        records: one dict of file paths per usable case.
        skipped: (file or case, reason) for every case left out under ``on_bad_file="skip"``.
        orphan_masks: masks without an image (reported in one warning, not trained on).
        cache: where preprocessed items live: ``memory`` (MONAI ``CacheDataset``, decoded once at start-up),
            ``disk`` (``PersistentDataset``) or ``none`` (decoded at every access); ``auto`` picks memory
            when it fits (:func:`resolve_cache`). A memory-cached item is the cache's own object: the
            DataLoader's collation copies it; copy it before editing it in place.
    """

    ROOT_FIX = "pass data.root=<a folder of NIfTI images and masks>"  # each layout's class says which folders

    def __init__(self, pairing: Pairing, variant: Variant, image_size: Sequence[int], *,
                 intensity: str = "volume_minmax", resize_mode: str = "crop_or_pad", seg_labels: str = "auto",
                 on_bad_file: str = "error", cache: str = "auto", cache_dir: str | Path | None = None,
                 root: str | Path = "") -> None:
        check_one_of("data.on_bad_file", on_bad_file, BAD_FILE_MODES)
        check_one_of("data.cache", cache, CACHE_MODES)
        self.variant, self.orphan_masks = variant, list(pairing.orphan_masks)
        transform = build_transforms(variant, image_size, intensity=intensity, resize_mode=resize_mode)
        self._warn_unused(pairing)
        problems = list(pairing.problems)
        self.records = []
        for case in pairing.pairs:
            try:
                self.records.append(validate_case(case, variant, intensity, seg_labels))
            except DataError as err:
                problems.append((case.name, str(err)))
        self.skipped = self._handle_problems(problems, on_bad_file, root)
        if not self.records:
            fix = "fix the files the warning lists, or pass another data.root=" if self.skipped else self.ROOT_FIX
            raise DataError(f"{root}: no usable image/mask pairs (skipped {len(self.skipped)}); {fix}")
        signature = f"{variant.name}|{intensity}|{resize_mode}|{tuple(image_size)}"  # keys the disk cache
        for record in self.records:
            record["prep"] = signature + "|" + "|".join(_file_stamp(p) for p in [*record["image"], record["mask"]])
        self.cache = resolve_cache(cache, len(self.records), variant, image_size)
        self._data = cached_dataset(self.records, transform, self.cache, cache_dir)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._data[index]

    def _warn_unused(self, pairing: Pairing) -> None:
        if pairing.orphan_masks:
            listed = ", ".join(str(p) for p in pairing.orphan_masks)
            warnings.warn(f"{len(pairing.orphan_masks)} masks have no image and are left out of training "
                          f"(they can still condition sampling): {listed}", stacklevel=4)
        if pairing.ignored:
            listed = ", ".join(str(p) for p in pairing.ignored)
            warnings.warn(f"ignored {len(pairing.ignored)} NIfTI files with unexpected names: {listed}", stacklevel=4)

    @staticmethod
    def _handle_problems(problems: list[tuple[str, str]], on_bad_file: str, root: str | Path) -> list:
        if not problems:
            return []
        listed = "\n".join(f"  {why}" if what in why else f"  {what}: {why}" for what, why in problems)
        if on_bad_file == "error":
            raise DataError(f"{len(problems)} bad input(s) under {root} (set data.on_bad_file=skip to skip "
                            f"them):\n{listed}")
        warnings.warn(f"skipped {len(problems)} bad input(s) under {root}:\n{listed}", stacklevel=4)
        return problems


def _file_stamp(path: str) -> str:
    stat = Path(path).stat()
    return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"


class WholeHeadDataset(NiftiPairDataset):
    """Med-DDPM whole-head data: ``<root>/image`` + ``<root>/mask`` paired by file name."""

    ROOT_FIX = WHOLE_HEAD_FIX

    def __init__(self, root: str | Path, image_size: Sequence[int] = (128, 128, 128), **kwargs: Any) -> None:
        super().__init__(list_pairs(root), VARIANTS["whole_head"], image_size, root=root, **kwargs)


class BratsDataset(NiftiPairDataset):
    """BraTS data in the per-case or per-modality layout, paired by case ID."""

    ROOT_FIX = BRATS_FIX

    def __init__(self, root: str | Path, image_size: Sequence[int] = (144, 192, 192), *, layout: str = "auto",
                 **kwargs: Any) -> None:
        super().__init__(list_brats_cases(root, layout), VARIANTS["brats"], image_size, root=root, **kwargs)


DATASETS = ("synthetic", "whole_head", "brats")


def dataset_variant(cfg_data: Mapping[str, Any]) -> Variant:
    """The channel layout of the Hydra ``data`` node's dataset, known before it is built (checked against the
    network while the dataset is built elsewhere)."""
    name = check_one_of("data.name", cfg_data["name"], DATASETS)
    return get_variant(cfg_data.get("variant", "whole_head") if name == "synthetic" else name)


def build_dataset(cfg_data: Mapping[str, Any], image_size: Sequence[int] | None = None) -> Dataset:
    """Dataset from the Hydra ``data`` node (``name`` in synthetic | whole_head | brats).

    ``image_size`` (D, H, W) normally comes from the model node; ``cfg_data.image_size`` is the fallback.
    """
    name = check_one_of("data.name", cfg_data["name"], DATASETS)
    size = tuple(int(s) for s in (image_size if image_size is not None else cfg_data["image_size"]))
    common = {k: cfg_data[k] for k in ("intensity",) if k in cfg_data}
    if name == "synthetic":
        return SyntheticPhantoms(cfg_data.get("num_volumes", 8), size, variant=cfg_data.get("variant", "whole_head"),
                                 seed=cfg_data.get("seed", 0), cache=cfg_data.get("cache", "none"), **common)
    files = {k: cfg_data[k] for k in ("resize_mode", "on_bad_file", "cache", "cache_dir") if k in cfg_data}
    if name == "whole_head":
        return WholeHeadDataset(cfg_data["root"], size, **common, **files)
    return BratsDataset(cfg_data["root"], size, layout=cfg_data.get("layout", "auto"),
                        seg_labels=cfg_data.get("seg_labels", "auto"), **common, **files)


def load_condition(mask_path: str | Path, variant: str, image_size: Sequence[int], *,
                   resize_mode: str = "crop_or_pad", seg_labels: str = "auto",
                   t1_path: str | Path | None = None) -> tuple[torch.Tensor, nib.Nifti1Image]:
    """Condition tensor (C, D, H, W) for one mask file, for sampling; validated like training masks.

    Returns the nibabel image too, so samples can be written with the mask's affine and header. A raw BraTS
    seg needs its ``t1_path`` to derive the healthy-brain label.
    """
    spec, mask_path = get_variant(variant), Path(mask_path)
    mask, nifti = read_volume(mask_path, "mask")
    labels = check_labels(mask, mask_path, spec.labels)
    record: dict[str, Any] = {"mask": str(mask_path), "name": nifti_stem(mask_path)}
    keys = ["mask"]
    if spec.name == "brats":
        t1 = read_volume(Path(t1_path), "image")[0] if t1_path is not None else None
        if t1 is not None and t1.shape != mask.shape:
            raise DataError(f"{t1_path}: t1 shape {t1.shape} does not match mask {mask_path} shape {mask.shape}")
        record["seg_labels"] = resolve_seg_labels(seg_labels, labels, mask, t1, mask_path)
        if record["seg_labels"] == "raw":
            if t1 is None:
                raise DataError(f"{mask_path}: a raw BraTS seg needs its case's t1 volume to derive the healthy-brain "
                                "label 4; pass t1_path=<the t1 file>, or seg_labels='medddpm' for Med-DDPM's labels 0..4")
            record["image"], keys = [str(t1_path)], ["image", "mask"]
    transform = build_transforms(spec, image_size, resize_mode=resize_mode, keys=keys)
    return transform(record)["cond"], nifti

