"""Which masks a sampling run conditions on, and the size it samples at: the rules ``med_ddpm.sample``,
``med_ddpm.step_search`` and ``med_ddpm.tune`` share, so a grid is searched and gated at the size it is sampled at."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from med_ddpm.checkpoint import Loaded
from med_ddpm.config_checks import CheckpointError, DataError, check_divisible
from med_ddpm.data.datasets import read_volume
from med_ddpm.data.encoding import VARIANT_BY_IMAGE_CHANNELS


def list_masks(masks: str | None) -> list[Path]:
    """A mask file, or every ``*.nii``/``*.nii.gz`` in a folder (sorted)."""
    path = Path(masks)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"masks={masks}: no such file or folder; pass a mask file or a folder of *.nii.gz masks")
    found = sorted(p for p in path.iterdir() if p.name.endswith((".nii.gz", ".nii")))
    if not found:
        raise DataError(f"masks={masks}: folder has no .nii/.nii.gz mask files; pass a folder of NIfTI masks")
    return found


def sampling_geometry(loaded: Loaded, cfg: DictConfig) -> tuple[str, list[int] | None, str]:
    """(data variant, model image size (:func:`sampling_size`), resize mode)."""
    saved = loaded.config
    variant = VARIANT_BY_IMAGE_CHANNELS.get(loaded.model.out_channels)
    if variant is None:
        raise CheckpointError(f"{cfg.checkpoint}: {loaded.model.out_channels} output channels match no known data "
                              f"variant {sorted(VARIANT_BY_IMAGE_CHANNELS)}; pass a whole-head or BraTS checkpoint")
    resize_mode = saved.get("data", {}).get("resize_mode") or cfg.data.get("resize_mode", "crop_or_pad")
    return variant, sampling_size(loaded, cfg), resize_mode


def sampling_size(loaded: Loaded, cfg: DictConfig) -> list[int] | None:
    """``image_size`` when given; else the size this project's checkpoint was trained at; else (an original
    Med-DDPM checkpoint, which records none) None: each mask's own size, as the original sampling script does.
    A size the checkpoint's U-Net cannot take is refused."""
    if cfg.get("image_size") is not None:
        size, origin = list(cfg.image_size), ""
    elif "data" in loaded.config:
        size, origin = list(loaded.config["model"]["image_size"]), f" (the training size of checkpoint={cfg.checkpoint})"
    else:
        return None
    return check_divisible(f"image_size={size}{origin}", size, loaded.model.config["channel_mult"], "image_size")


def native_size(mask_path: Path, channel_mult: list[int]) -> list[int]:
    """A mask's (D, H, W) in model axis order (NIfTI (i, j, k) reversed), to sample it at its own size."""
    size = list(reversed(read_volume(mask_path, "mask")[0].shape))  # a broken file: one line naming it
    return check_divisible(f"{mask_path} (sampled at its own size {size}, D, H, W)", size, channel_mult,
                           "image_size", DataError)
