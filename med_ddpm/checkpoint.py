"""Checkpoints: this project's format and the original Med-DDPM format, both ways.

Original Med-DDPM ``Trainer.save()`` files are ``{'step', 'model', 'ema'}``, each a
``GaussianDiffusion.state_dict()``: 13 schedule buffers, then ``denoise_fn.*`` network
tensors. :func:`load_checkpoint` reads those with no flags at all: the architecture
(widths, levels, res-blocks, attention placement, in/out channels, T) is inferred from the
keys and shapes, because the published weights come with no config.

Example:
    >>> loaded = load_checkpoint("model_128.pt")          # original or ours, EMA weights
    >>> x0 = sample(loaded.model, DDPMSampler(loaded.schedule), cond)
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from med_ddpm.config_checks import CheckpointError
from med_ddpm.diffusion import BUFFER_NAMES, NoiseSchedule
from med_ddpm.model import UNet3D, build_model
from med_ddpm.utils import atomic_save

FORMAT = "med-ddpm-bench"
FORMAT_VERSION = 1
PREFIX = "denoise_fn."
MAX_LISTED = 8
LOAD_FIX = "pass a checkpoint written by med_ddpm.train or the published Med-DDPM weights"
ZIP_MAGIC, GZIP_MAGIC = b"PK\x03\x04", b"\x1f\x8b"  # torch.save writes a zip archive; a .nii.gz is gzip
NIFTI_HEADER = 348  # bytes of a NIfTI-1 header, which ends in the magic b"n+1\0"


@dataclass
class Loaded:
    """A loaded checkpoint: the network in eval mode, its schedule, and the hyperparameters."""

    model: UNet3D
    schedule: NoiseSchedule
    config: dict[str, Any]
    step: int


def _listed(keys) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - MAX_LISTED} more)" if len(keys) > MAX_LISTED else ""
    return ", ".join(keys[:MAX_LISTED]) + more


def read_checkpoint(path: str | os.PathLike, *, option: str = "checkpoint", fix: str = LOAD_FIX) -> dict[str, Any]:
    """``torch.load(weights_only=True)``; a file it cannot read, or one that is no Med-DDPM checkpoint, is a
    :class:`CheckpointError` naming ``option=path`` and giving ``fix``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated / foreign files
        raise CheckpointError(f"{option}={path}: not a PyTorch checkpoint ({unreadable_reason(path, e)}); {fix}") from e
    if not isinstance(ckpt, dict) or not ({"model", "ema"} & ckpt.keys()):
        raise CheckpointError(f"{option}={path}: not a Med-DDPM checkpoint (expected a dict with 'model'/'ema' "
                              f"entries); {fix}")
    return ckpt


def unreadable_reason(path: Path, err: Exception) -> str:
    """Why ``torch.load`` could not read ``path``, in a few words: what the file holds when its first bytes tell,
    else the first sentence of torch's reason (without its advice to load with ``weights_only=False``, which
    runs any code a file of unknown origin holds)."""
    with path.open("rb") as f:
        head = f.read(NIFTI_HEADER)
    refused = str(err).partition("WeightsUnpickler error:")[2]  # a whole file, holding more than tensors
    if not head:
        return "the file is empty"
    if head.startswith(GZIP_MAGIC):
        return "gzip data, such as a .nii.gz volume"
    if head[NIFTI_HEADER - 4:NIFTI_HEADER - 1] == b"n+1":
        return "a NIfTI volume"
    if head.startswith(ZIP_MAGIC) and not refused:  # torch's own format, cut short or damaged
        return "a truncated or damaged zip archive"
    first = next((part for part in (refused or str(err)).split("\n\n") if part.strip()), "")
    sentence = " ".join(first.split()).split(". ")[0].rstrip(".")
    return f"{type(err).__name__}: {sentence}" if sentence else type(err).__name__


def load_into(module: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Strict load whose error names the missing, unexpected and mis-shaped keys."""
    own = module.state_dict()
    missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
    shapes = [
        f"{k} {tuple(state[k].shape)} vs expected {tuple(own[k].shape)}"
        for k in own.keys() & state.keys()
        if own[k].shape != state[k].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing keys: {_listed(missing)}")
    if unexpected:
        problems.append(f"unknown keys: {_listed(unexpected)}")
    if shapes:
        problems.append(f"shape mismatch: {_listed(shapes)}")
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))
    module.load_state_dict(state, strict=True)


def split_medddpm_state(state: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
    """Split a ``GaussianDiffusion`` state dict into (schedule buffers, network tensors)."""
    buffers = {k: v for k, v in state.items() if k in BUFFER_NAMES}
    net = {k[len(PREFIX) :]: v for k, v in state.items() if k.startswith(PREFIX)}
    return buffers, net


def _block_indices(net: Mapping[str, torch.Tensor], name: str) -> list[int]:
    return sorted({int(k.split(".")[1]) for k in net if k.startswith(name + ".")})


def infer_model_config(net: Mapping[str, torch.Tensor], source: str = "state dict") -> dict[str, Any]:
    """Read the U-Net hyperparameters off the keys and shapes of a network state dict.

    Levels = downsamplers + 1; res-blocks per level from the number of input blocks
    (1 + L·R + (L − 1)); each level's width from its first ResBlock; attention placement
    from where ``.1.qkv`` keys are (the BraTS model has none outside the middle block).
    """
    try:
        mc, in_ch = net["input_blocks.0.0.weight"].shape[:2]
        out_ch = net["out.2.weight"].shape[0]
    except KeyError as e:
        raise CheckpointError(f"{source}: missing key {e.args[0]!r}: not a Med-DDPM U-Net") from e
    blocks = _block_indices(net, "input_blocks")
    downs = [i for i in blocks if f"input_blocks.{i}.0.op.weight" in net]
    levels = len(downs) + 1
    res_total = len(blocks) - 1 - len(downs)
    if res_total <= 0 or res_total % levels:
        raise CheckpointError(f"{source}: {len(blocks)} input blocks fit no U-Net layout")
    num_res = res_total // levels
    mult, attention_ds, idx, ds = [], set(), 1, 1
    for level in range(levels):
        emb_w = net[f"input_blocks.{idx}.0.emb_layers.1.weight"]
        width = net[f"input_blocks.{idx}.0.out_layers.3.weight"].shape[0]
        if emb_w.shape[0] != width:
            raise CheckpointError(f"{source}: scale-shift (FiLM) ResBlocks are not part of Med-DDPM")
        mult.append(width // mc)
        for j in range(num_res):
            if f"input_blocks.{idx + j}.1.qkv.weight" in net:
                attention_ds.add(ds)
        idx += num_res + (level < levels - 1)
        ds *= 2
    return dict(
        in_channels=int(in_ch),
        out_channels=int(out_ch),
        model_channels=int(mc),
        channel_mult=mult,
        num_res_blocks=num_res,
        attention_ds=sorted(attention_ds),
        num_heads=1,
        dropout=0.0,
    )


def _schedule_from_buffers(buffers: Mapping[str, torch.Tensor], source: str) -> tuple[NoiseSchedule, dict]:
    missing = set(BUFFER_NAMES) - buffers.keys()
    if missing:
        raise CheckpointError(f"{source}: missing schedule buffers: {_listed(missing)}")
    schedule = NoiseSchedule(timesteps=int(buffers["betas"].shape[0]))
    cosine = torch.allclose(schedule.betas, buffers["betas"].float(), rtol=1e-5, atol=1e-7)
    load_into(schedule, buffers, source)  # keep the stored values exactly
    cfg = dict(schedule.config, schedule="cosine" if cosine else "stored")
    return schedule, cfg


def _load_medddpm(ckpt: dict, weights: str, source: str, num_heads: int) -> Loaded:
    buffers, net = split_medddpm_state(ckpt[weights])
    foreign = ckpt[weights].keys() - set(buffers) - {PREFIX + k for k in net}
    if foreign:
        raise CheckpointError(f"{source}: unknown keys: {_listed(foreign)}")
    schedule, diffusion_cfg = _schedule_from_buffers(buffers, source)
    model_cfg = dict(infer_model_config(net, source), num_heads=num_heads)
    model = build_model(model_cfg)
    load_into(model, net, source)
    config = {"model": model_cfg, "diffusion": diffusion_cfg, "source": "medddpm", "weights": weights}
    return Loaded(model.eval(), schedule, config, int(ckpt.get("step", 0)))


def _load_own(ckpt: dict, weights: str, source: str) -> Loaded:
    config = ckpt.get("config") or {}
    if "model" not in config or "diffusion" not in config:
        raise CheckpointError(f"{source}: checkpoint config lacks 'model'/'diffusion' sections")
    model = build_model(config["model"])
    load_into(model, ckpt[weights], source)
    schedule = NoiseSchedule.from_config(config["diffusion"])
    return Loaded(model.eval(), schedule, dict(config, source=FORMAT, weights=weights), int(ckpt["step"]))


def load_checkpoint(path: str | os.PathLike, weights: str = "ema", *, num_heads: int = 1) -> Loaded:
    """Load this project's checkpoint or an original Med-DDPM one (format is detected).

    Args:
        path: the ``.pt`` file.
        weights: ``"ema"`` (what Med-DDPM samples with) or ``"model"`` (the raw weights).
        num_heads: attention heads of an original checkpoint (not recoverable from its
            keys; every released Med-DDPM model uses 1).
    """
    if weights not in ("ema", "model"):
        raise ValueError(f"weights must be 'ema' or 'model', got {weights!r}")
    ckpt = read_checkpoint(path)
    source = f"{path} [{weights}]"
    if ckpt.get(weights) is None:
        raise CheckpointError(f"{path}: has no {weights!r} weights (entries: {sorted(ckpt)})")
    if ckpt.get("format") == FORMAT:
        return _load_own(ckpt, weights, source)
    return _load_medddpm(ckpt, weights, source, num_heads)


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model_state: Mapping[str, torch.Tensor],
    ema_state: Mapping[str, torch.Tensor] | None,
    config: Mapping[str, Any],
    step: int,
    **training_state: Any,
) -> Path:
    """Write this project's checkpoint atomically.

    ``config`` needs ``model`` and ``diffusion`` sections (the resolved Hydra config does);
    ``training_state`` holds what resume needs (optimizer, scaler, RNG states, EMA counter).
    """
    ckpt = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": int(step),
        "config": dict(config),
        "model": OrderedDict(model_state),
        "ema": OrderedDict(ema_state) if ema_state is not None else None,
        **training_state,
    }
    return atomic_save(ckpt, path)


def to_medddpm_state(net_state: Mapping[str, torch.Tensor], schedule: NoiseSchedule) -> OrderedDict:
    """A ``GaussianDiffusion.state_dict()``: schedule buffers first, then ``denoise_fn.*``."""
    state = OrderedDict((k, v.detach().clone()) for k, v in schedule.state_dict().items())
    state.update((PREFIX + k, v.detach().clone()) for k, v in net_state.items())
    return state


def save_medddpm_checkpoint(
    path: str | os.PathLike,
    model_state: Mapping[str, torch.Tensor],
    ema_state: Mapping[str, torch.Tensor],
    schedule: NoiseSchedule,
    step: int,
) -> Path:
    """Export to the original ``Trainer.save()`` layout, loadable by Med-DDPM's own scripts."""
    ckpt = {
        "step": int(step),
        "model": to_medddpm_state(model_state, schedule),
        "ema": to_medddpm_state(ema_state, schedule),
    }
    return atomic_save(ckpt, path)
