"""``train.memory_cap_gib``: train as on a smaller GPU. The cap on PyTorch's allocator, the allocator setting that
makes a capped run's freed memory reusable, and the check afterwards that the run stayed under the cap."""

from __future__ import annotations

import logging
import os

import torch

from med_ddpm.config_checks import ConfigError

log = logging.getLogger("med_ddpm.train")


def cap_memory(device: torch.device, gib: float | None) -> None:
    """``train.memory_cap_gib``: this process may allocate at most that much GPU memory, as on a smaller card
    (``torch.cuda.set_per_process_memory_fraction``), so a run that passes here fits there. The cap covers
    PyTorch's allocator (tensors, cached blocks, cuDNN and cuBLAS workspaces), not the CUDA context itself."""
    if gib is None:
        return
    if device.type != "cuda":
        log.info("train.memory_cap_gib=%s ignored: the run is on %s", gib, device)
        return
    total = torch.cuda.get_device_properties(device).total_memory
    if not 0 < gib * 2**30 <= total:
        raise ConfigError(f"train.memory_cap_gib={gib}: must be in (0, {total / 2**30:.1f}], this GPU's memory in GiB; "
                          "pass a smaller train.memory_cap_gib=")
    index = torch.cuda.current_device() if device.index is None else device.index
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total, index)


def check_cap_held(gib: float | None, peak_reserved_gib: float | None) -> bool:
    """Whether the allocator stayed within ``train.memory_cap_gib``; warns when it did not, since then a run that
    finished here would not be shown to fit a card of that size (timings.json keeps both figures)."""
    if gib is None or peak_reserved_gib is None or peak_reserved_gib <= gib:
        return True
    log.warning("train.memory_cap_gib=%s: the allocator held up to %.2f GiB, above the cap; this run does not show "
                "that training fits a %s GiB card", gib, peak_reserved_gib, gib)
    return False


ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def expandable_segments_under_cap(gib: float | None) -> None:
    """Under ``train.memory_cap_gib`` fragmentation decides whether a run fits: the cap counts blocks the allocator
    keeps cached, and a cached block cannot serve a larger request. Expandable segments grow one mapping per stream,
    so freed memory serves any size. Set before CUDA starts (the allocator reads it then), and never over the user's
    own allocator settings (docs/end-to-end.md, "BraTS on a 16 GB card")."""
    if gib is None or any(var in os.environ for var in ALLOC_CONF_VARS):
        return
    if torch.cuda.is_initialized():
        log.warning("train.memory_cap_gib=%s: CUDA already started, allocator settings left as they are", gib)
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
