"""Writing model-space volumes back to NIfTI, and PNG montages for a quick look.

Model tensors are (C, D, H, W) with model[c, d, h, w] = nifti[w, h, d, c] (Med-DDPM's axis convention, see
``med_ddpm.data.datasets``). Generated volumes go back to NIfTI axis order and carry the conditioning mask's affine
and header, so they overlay the mask in any viewer, exactly as the original sampling script does.
"""

from __future__ import annotations

import gzip
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import torch

from med_ddpm.config_checks import DataError
from med_ddpm.utils import atomic_write, save_figure

MODEL_TO_NIFTI_AXES = (3, 2, 1, 0)  # (C, D, H, W) = (C, k, j, i) -> (i, j, k, C)
Reference = str | Path | nib.Nifti1Image | tuple[np.ndarray, Any]


def _reference(reference: Reference) -> tuple[np.ndarray, nib.Nifti1Header | None, tuple[int, ...] | None]:
    """(affine, header, spatial shape or None) from a NIfTI path, a nibabel image or an (affine, header) pair."""
    if isinstance(reference, tuple):
        affine, header = reference
        return np.asarray(affine, dtype=np.float64), header, None
    img = reference if isinstance(reference, nib.Nifti1Image) else nib.load(str(reference))
    return img.affine, img.header, tuple(img.shape[:3])


def _to_reference_grid(volume: torch.Tensor, shape: tuple[int, ...] | None, resize_mode: str | None,
                       pad_value: float) -> torch.Tensor:
    """Undo the loader's crop/pad or resampling so the volume matches the reference's voxel grid."""
    target = tuple(reversed(shape)) if shape is not None else tuple(volume.shape[1:])
    if tuple(volume.shape[1:]) == target:
        return volume
    if resize_mode is None:
        raise DataError(f"volume shape {tuple(volume.shape[1:])} (model D, H, W) does not match the reference "
                        f"grid {target}; pass resize_mode='crop_or_pad' or 'resample' to map it back")
    if resize_mode == "resample":
        from monai.transforms import Resize  # imports all of MONAI: only this mode needs it

        return torch.as_tensor(Resize(target, mode="trilinear")(volume))
    return invert_crop_or_pad(torch.as_tensor(volume), target, pad_value)


def invert_crop_or_pad(volume: torch.Tensor, target: Sequence[int], pad_value: float) -> torch.Tensor:
    """Exact inverse of MONAI's ``ResizeWithPadOrCrop`` from a ``target``-sized grid to ``volume``'s.

    Per axis, where the loader padded r → m it put (m − r)//2 voxels before (``SpatialPad``,
    symmetric); where it cropped r → m it started at r//2 − m//2 (``CenterSpatialCrop``). The two
    offsets differ for odd differences, so running the same transform backwards would shift the
    sample by a voxel against its mask.
    """
    out = volume
    for axis, (m, r) in enumerate(zip(volume.shape[1:], target), start=1):
        if m > r:
            out = out.narrow(axis, (m - r) // 2, r)
        elif m < r:
            before = r // 2 - m // 2
            shape = list(out.shape)
            shape[axis] = r
            padded = torch.full(shape, pad_value, dtype=out.dtype)
            padded.narrow(axis, before, m).copy_(out)
            out = padded
    return out


def save_volume_like(volume: torch.Tensor | np.ndarray, reference: Reference, out_path: str | Path, *,
                     dtype: np.dtype | str | None = None, resize_mode: str | None = None,
                     pad_value: float = -1.0) -> Path:
    """Write a model-order volume as NIfTI with the reference's affine and header (atomically).

    Args:
        volume: (C, D, H, W) or (D, H, W) in model axis order. One channel is written as a 3-D file, several
            channels as a 4-D (i, j, k, C) file.
        reference: the conditioning mask (path or nibabel image), or an ``(affine, header)`` pair
            (header may be None).
        out_path: ``.nii.gz`` (gzip) or ``.nii``.
        dtype: on-disk dtype; defaults to the volume's (e.g. float32 images, uint8 label maps).
        resize_mode: if the volume's grid differs from the reference's, map it back with ``crop_or_pad``
            (exact inverse of the loader's centre crop/pad) or ``resample``; None makes a mismatch an error.
        pad_value: fill for voxels that ``crop_or_pad`` adds back (-1 = background after scaling).

    Returns:
        The written path.
    """
    affine, header, shape = _reference(reference)
    vol = torch.as_tensor(volume).detach().cpu()
    vol = vol[None] if vol.ndim == 3 else vol
    if vol.ndim != 4:
        raise DataError(f"{out_path}: expected a (C, D, H, W) or (D, H, W) volume, got shape {tuple(vol.shape)}")
    vol = _to_reference_grid(vol, shape, resize_mode, pad_value)
    data = vol.numpy().transpose(MODEL_TO_NIFTI_AXES)  # model[c, d, h, w] = nifti[w, h, d, c]
    data = np.ascontiguousarray(data[..., 0] if data.shape[-1] == 1 else data)
    dtype = np.dtype(dtype) if dtype is not None else data.dtype
    img = nib.Nifti1Image(data.astype(dtype), affine, header=header.copy() if header is not None else None)
    img.set_data_dtype(dtype)  # a mask's header says uint8; a generated image is float
    img.header.set_slope_inter(np.nan, np.nan)  # the reference's intensity scaling does not apply to new data
    payload = img.to_bytes()
    out_path = Path(out_path)
    if out_path.name.endswith(".gz"):
        payload = gzip.compress(payload, compresslevel=1)  # nibabel's level: half level 6's time, a few % more bytes
    return atomic_write(out_path, lambda f: f.write(payload))


def cond_to_labels(cond: torch.Tensor) -> np.ndarray:
    """Collapse one-hot condition channels ({-1, 1} or {0, 1}) to a (D, H, W) label map (channel k -> k+1)."""
    on = torch.as_tensor(cond).detach().cpu().float() > 0
    labels = torch.zeros(on.shape[1:], dtype=torch.uint8)
    for k in range(on.shape[0]):
        labels[on[k]] = k + 1
    return labels.numpy()


def _mid_slices(volume: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Axial, coronal and sagittal mid-slices of a (D, H, W) = (k, j, i) volume, rows = superior-up axis."""
    d, h, w = (n // 2 for n in volume.shape)
    return [("axial", volume[d]), ("coronal", volume[:, h, :]), ("sagittal", volume[:, :, w])]


def save_montage_png(image: torch.Tensor, cond: torch.Tensor, out_path: str | Path, *,
                     title: str | None = None, channel_names: Sequence[str] | None = None) -> Path:
    """PNG of mid-slices in three orientations: each image channel, then that channel with the mask overlaid.

    Uses a bare Agg ``Figure`` (no pyplot global state), so it is safe in training loops and worker threads.
    Matplotlib is imported here, on the first montage, not when the CLI starts.
    """
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    img = torch.as_tensor(image).detach().cpu().float().numpy()
    labels = cond_to_labels(cond)
    names = list(channel_names or [f"ch{c}" for c in range(img.shape[0])])
    cmap = matplotlib.colormaps["tab10"]
    height = 1.55 * img.shape[0] + 0.45
    fig = Figure(figsize=(9, height), dpi=72)
    FigureCanvasAgg(fig)
    axes = fig.subplots(img.shape[0], 6, squeeze=False)
    fig.subplots_adjust(left=0.03, right=0.995, bottom=0.01, top=1 - 0.42 / height, wspace=0.04, hspace=0.06)
    for c in range(img.shape[0]):
        for o, ((view, plane), (_, lab)) in enumerate(zip(_mid_slices(img[c]), _mid_slices(labels))):
            for col, overlay in ((2 * o, False), (2 * o + 1, True)):
                ax = axes[c, col]
                ax.imshow(plane, cmap="gray", vmin=-1, vmax=1, origin="lower", interpolation="nearest")
                if overlay:
                    ax.imshow(np.ma.masked_equal(lab, 0), cmap=cmap, vmin=0, vmax=9, alpha=0.45,
                              origin="lower", interpolation="nearest")
                ax.set_axis_off()
                if c == 0:
                    ax.set_title(f"{view}{' + mask' if overlay else ''}", fontsize=8)
            axes[c, 0].text(-0.05, 0.5, names[c], transform=axes[c, 0].transAxes, rotation=90, va="center",
                            ha="right", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    return save_figure(fig, out_path)
