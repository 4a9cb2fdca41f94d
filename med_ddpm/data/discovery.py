"""Which NIfTI files make one training case, in the whole-head and the two BraTS layouts.

Files are paired by name, never by sort order: whole-head ``<root>/image/<name>.nii.gz`` with
``<root>/mask/<name>.nii.gz``; BraTS by case ID, in one folder per case (``<case>/<case>_<modality>.nii.gz``, the
official release) or one folder per modality (``t1/<case>_t1.nii.gz``, Med-DDPM's repository). What cannot be
paired is reported, not dropped in silence: a mask without images stays usable for sampling, an image without a
mask is a problem the dataset names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from med_ddpm.config_checks import DataError, check_one_of

BRATS_LAYOUTS = ("auto", "per_case", "per_modality")
BRATS_MODALITIES = ("t1", "t1ce", "t2", "flair")  # target channel order of the original


@dataclass(frozen=True)
class Case:
    """One training example on disk: image files in channel order and the label-map file."""

    name: str
    images: tuple[Path, ...]
    mask: Path


@dataclass
class Pairing:
    """Result of scanning a data root.

    Attributes:
        pairs: complete cases, sorted by name.
        orphan_masks: masks without an image: left out of training, still usable for sampling.
        problems: (file or case, reason) for images that cannot be trained on (e.g. no mask).
        ignored: NIfTI files whose names fit no pattern of the layout.
    """

    pairs: list[Case] = field(default_factory=list)
    orphan_masks: list[Path] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)
    ignored: list[Path] = field(default_factory=list)


def nifti_stem(path: Path) -> str:
    """File name without ``.nii.gz`` / ``.nii``."""
    name = path.name
    return name[: -len(".nii.gz")] if name.endswith(".nii.gz") else name[: -len(".nii")]


def _nifti_index(folder: Path) -> dict[str, Path]:
    """Map stem -> path of the NIfTI files in ``folder`` (hidden files such as ``._x.nii.gz`` skipped)."""
    index: dict[str, Path] = {}
    if not folder.is_dir():
        return index
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or not path.name.endswith((".nii", ".nii.gz")):
            continue
        stem = nifti_stem(path)
        if stem in index:
            raise DataError(f"{path}: clashes with {index[stem]} (two files for the name {stem!r})")
        index[stem] = path
    return index


# What to pass where a folder does not hold its layout: the refusals of this module and of med_ddpm.data.datasets end in it.
WHOLE_HEAD_FIX = "pass data.root=<a folder with image/*.nii.gz and mask/*.nii.gz>, the whole-head layout"
BRATS_FIX = ("pass data.root=<a folder of BraTS cases>, per_case <case>/<case>_{t1,t1ce,t2,flair,seg}.nii.gz or "
             "per_modality {t1,t1ce,t2,flair,seg}/<case>_<modality>.nii.gz (data=whole_head for image/ and mask/)")


def _require_dir(path: Path, fix: str) -> None:
    if not path.is_dir():
        raise DataError(f"{path}: no such folder; {fix}")


def list_pairs(root: str | Path) -> Pairing:
    """Pair ``<root>/image/*.nii.gz`` with ``<root>/mask/*.nii.gz`` by file name, never by sort order."""
    root = Path(root)
    _require_dir(root / "image", WHOLE_HEAD_FIX)
    images, masks = _nifti_index(root / "image"), _nifti_index(root / "mask")
    pairing = Pairing(orphan_masks=[masks[n] for n in sorted(masks) if n not in images])
    for name, image in images.items():
        if name in masks:
            pairing.pairs.append(Case(name, (image,), masks[name]))
        else:
            pairing.problems.append((str(image), f"image has no mask (expected {root / 'mask' / image.name})"))
    return pairing


_BRATS_FILE = re.compile(r"^(?P<case>.+)_(?P<kind>t1|t1ce|t2|flair|seg)$")


def _brats_layout(root: Path, layout: str) -> str:
    check_one_of("data.layout", layout, BRATS_LAYOUTS)
    if layout != "auto":
        return layout
    modality_dirs = [(root / m).is_dir() for m in (*BRATS_MODALITIES, "seg")]
    return "per_modality" if any(modality_dirs) else "per_case"


def list_brats_cases(root: str | Path, layout: str = "auto") -> Pairing:
    """Group BraTS files by case ID (``<case>_<modality>.nii.gz``) in either layout."""
    root = Path(root)
    _require_dir(root, BRATS_FIX)
    files: dict[str, dict[str, Path]] = {}
    ignored: list[Path] = []
    if _brats_layout(root, layout) == "per_modality":
        folders = [(kind, root / kind) for kind in (*BRATS_MODALITIES, "seg")]
    else:
        folders = [(None, d) for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".")]
    for expected_kind, folder in folders:
        for stem, path in _nifti_index(folder).items():
            match = _BRATS_FILE.match(stem)
            ok = match and (match["kind"] == expected_kind if expected_kind else match["case"] == folder.name)
            if not ok:
                ignored.append(path)
                continue
            files.setdefault(match["case"], {})[match["kind"]] = path
    pairing = _classify_brats(files)
    pairing.ignored = ignored
    return pairing


def _classify_brats(files: dict[str, dict[str, Path]]) -> Pairing:
    pairing = Pairing()
    for case in sorted(files):
        found = files[case]
        missing = [m for m in BRATS_MODALITIES if m not in found]
        if "seg" not in found:
            pairing.problems.append((f"case {case}", f"images {sorted(found)} have no seg mask"))
        elif len(missing) == len(BRATS_MODALITIES):
            pairing.orphan_masks.append(found["seg"])
        elif missing:
            pairing.problems.append((f"case {case}", f"seg {found['seg']} lacks modalities {missing}"))
        else:
            pairing.pairs.append(Case(case, tuple(found[m] for m in BRATS_MODALITIES), found["seg"]))
    return pairing
