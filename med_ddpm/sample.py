"""Sample volumes for masks: ``python -m med_ddpm.sample checkpoint=PATH masks=DIR output_dir=OUT``.

Accepts this project's checkpoints and original Med-DDPM ones (architecture inferred from
the weights). For every mask it writes ``<mask name>.nii.gz`` (``_k`` suffixes when
``num_samples > 1``) with that mask's affine and header, plus a PNG montage of mid-slices
(image | mask overlay). Fewer steps: ``sampler=ddim sampler.steps=50`` (or dpm_solver_pp, deis).
Recipes apply as in training: ``'recipe=[tf32,amp_bf16]'``.

Multi-GPU: ``torchrun --nproc_per_node=N -m med_ddpm.sample ...`` gives rank r the masks
r, r+N, ...; each output is written once, by the rank that owns its mask. Mask i's noise comes
from a generator keyed by (seed, i), so a volume does not depend on N or on the other masks.

Example:
    python -m med_ddpm.sample checkpoint=runs/last.pt masks=data/whole_head/mask output_dir=samples
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
import nibabel as nib
import torch
from omegaconf import DictConfig, OmegaConf

from med_ddpm import cli, distributed
from med_ddpm.checkpoint import Loaded, load_checkpoint
from med_ddpm.data import VARIANT_BY_IMAGE_CHANNELS, load_condition
from med_ddpm.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    OutputError,
    check_choice,
    check_device,
    check_int,
    check_sampler,
    check_size,
)
from med_ddpm.phantoms import SyntheticPhantoms
from med_ddpm.samplers import sample, sampler_from_config
from med_ddpm.utils import seed_everything
from med_ddpm.volume_io import save_montage_png, save_volume_like
from optim import RecipeStack

log = logging.getLogger("med_ddpm.sample")
CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


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
    """(data variant, model image size, resize mode).

    The size is ``image_size`` when given; else the size this project's checkpoint was trained at;
    else (an original Med-DDPM checkpoint, which records none) None: each mask's own size, as the
    original sampling script does.
    """
    saved = loaded.config
    variant = VARIANT_BY_IMAGE_CHANNELS.get(loaded.model.out_channels)
    if variant is None:
        raise CheckpointError(f"{cfg.checkpoint}: {loaded.model.out_channels} output channels match no known data "
                              f"variant {sorted(VARIANT_BY_IMAGE_CHANNELS)}; pass a whole-head or BraTS checkpoint")
    resize_mode = saved.get("data", {}).get("resize_mode") or cfg.data.get("resize_mode", "crop_or_pad")
    if cfg.get("image_size") is not None:
        return variant, list(cfg.image_size), resize_mode
    if "data" in saved:  # this project's checkpoint: sample at the size it was trained at
        return variant, list(saved["model"]["image_size"]), resize_mode
    return variant, None, resize_mode


def native_size(mask_path: Path) -> list[int]:
    """A mask's (D, H, W) in model axis order: NIfTI (i, j, k) reversed."""
    return list(reversed(nib.load(mask_path).shape[:3]))


def conditions(cfg: DictConfig, variant: str, size: list[int] | None, resize_mode: str, levels: int):
    """Yield (mask index, name, cond (C,D,H,W), reference NIfTI or None) for this rank's masks."""
    if cfg.masks is None:
        size = size or list(cfg.model.image_size)
        phantoms = SyntheticPhantoms(num_volumes=2, image_size=size, variant=variant, seed=cfg.seed)
        for i in distributed.shard(range(len(phantoms))):
            yield i, f"phantom_{i}", phantoms[i]["cond"], None
        return
    for i, path in distributed.shard(list(enumerate(list_masks(cfg.masks)))):
        cond, nifti = load_condition(path, variant, size or native_size(path), resize_mode=resize_mode,
                                     seg_labels=cfg.data.get("seg_labels", "auto"))
        check_divisible(cond.shape[1:], levels, path)
        yield i, path.name.removesuffix(".gz").removesuffix(".nii"), cond, nifti


def check_divisible(size, levels: int, path: Path) -> None:
    """Each axis must halve ``levels - 1`` times for the U-Net's skips to line up."""
    step = 2 ** (levels - 1)
    if any(s % step for s in size):
        raise DataError(f"{path}: model size {list(size)} (D, H, W) is not divisible by {step} for a "
                        f"{levels}-level U-Net; pass image_size=[D,H,W] (e.g. [144,192,192] for BraTS)")


def write_outputs(x0: torch.Tensor, cond: torch.Tensor, name: str, nifti, out_dir: Path, resize_mode: str) -> Path:
    """NIfTI with the mask's affine/header (identity affine for phantoms) + PNG montage."""
    out = out_dir / f"{name}.nii.gz"
    reference = nifti if nifti is not None else (torch.eye(4).numpy(), None)
    save_volume_like(x0, reference, out, dtype="float32", resize_mode=resize_mode)
    save_montage_png(x0, cond, out_dir / f"{name}.png", title=name)
    return out


def run(cfg: DictConfig) -> list[Path]:
    """Load the checkpoint, then sample ``num_samples`` volumes for each of this rank's masks; returns its files."""
    device = distributed.init_from_env(cfg.device)  # joins torchrun's process group, if any
    seed_everything(cfg.seed)
    loaded = load_checkpoint(cfg.checkpoint, weights=cfg.weights)
    variant, size, resize_mode = sampling_geometry(loaded, cfg)
    sampler = sampler_from_config(cfg.sampler, loaded.schedule.to(device))
    stack = RecipeStack.from_config(cfg.get("recipe"))
    stack.require(device)
    out_dir = Path(distributed.broadcast_object(str(cfg.output_dir)))  # Hydra's timestamped dir may differ per rank
    written = []
    with stack.session():
        model = stack.prepare_model(loaded.model.to(device))
        for index, name, cond, nifti in conditions(cfg, variant, size, resize_mode, len(loaded.model.config["channel_mult"])):
            c = stack.prepare_input(cond[None].to(device).expand(cfg.num_samples, *cond.shape))
            generator = distributed.keyed_generator(device, cfg.seed, index)
            x0 = sample(model, sampler, c, generator=generator, progress=cfg.progress and distributed.is_main(),
                        forward_context=stack.forward_context, out_channels=loaded.model.out_channels)
            for k in range(cfg.num_samples):
                suffix = f"_{k}" if cfg.num_samples > 1 else ""
                written.append(write_outputs(x0[k].cpu(), cond, name + suffix, nifti, out_dir, resize_mode))
                log.info("wrote %s", written[-1])
    return written


def check_options(cfg: DictConfig) -> None:
    """Refuse, before the checkpoint is loaded, a value sampling would ignore or fail on."""
    if OmegaConf.is_missing(cfg, "checkpoint"):
        raise ConfigError("checkpoint: not set; pass checkpoint=PATH (a checkpoint written by med_ddpm.train, "
                          "or the published Med-DDPM weights)")
    check_int(cfg, "num_samples", 1)
    check_int(cfg, "seed", 0)
    check_choice(cfg, "weights", ("ema", "model"))
    check_size(cfg, "image_size", optional=True)
    check_device(cfg)
    # the options only: the steps are checked against the checkpoint's own schedule when it is loaded
    check_sampler(OmegaConf.merge(cfg.sampler, {"steps": None}), cfg.diffusion)


def check_output_dir(out_dir: Path) -> None:
    """Samples of two runs must not mix in one folder (nor a new run overwrite the old one's)."""
    found = sorted(out_dir.glob("*.nii.gz"))
    if found:
        raise OutputError(f"output_dir={out_dir}: already holds {len(found)} sample(s) ({found[0].name}, ...); "
                          "choose another output_dir=, or remove them")


@hydra.main(config_path=CONFIG_DIR, config_name="sample", version_base="1.3")
@cli.entry
def main(cfg: DictConfig) -> None:
    check_output_dir(cli.output_dir(cfg))
    check_options(cfg)
    written = run(cfg)
    total = sum(distributed.all_gather_object(len(written)))  # also waits for every rank's files
    if distributed.is_main():
        print(f"{total} samples (NIfTI + PNG) in {Path(cfg.output_dir).resolve()}")
    distributed.cleanup()


if __name__ == "__main__":
    cli.run(main)
