"""Where a dataset's preprocessed items are kept (``data.cache``): in memory, on disk, or nowhere, and the
``auto`` choice between memory and none by the RAM this machine has free.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from med_ddpm.config_checks import ConfigError
from med_ddpm.data.encoding import Variant

CACHE_MODES = ("auto", "none", "memory", "disk")
MEMORY_CACHE_SHARE = 0.5  # cache=auto keeps the dataset in RAM when it takes at most this share of what is free


def available_ram_bytes() -> int:
    """Memory the OS can give this process now: ``MemAvailable`` (Linux), else free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def dataset_bytes(num_items: int, variant: Variant, image_size: Sequence[int]) -> int:
    """Size of the preprocessed dataset in memory: float32 image + condition channels per item."""
    return num_items * (variant.image_channels + variant.cond_channels) * int(np.prod(image_size)) * 4


def resolve_cache(cache: str, num_items: int, variant: Variant, image_size: Sequence[int]) -> str:
    """``auto``: ``memory`` when the preprocessed dataset, once per process on this machine, takes at most
    :data:`MEMORY_CACHE_SHARE` of the available RAM (each file is then decoded once, at start-up, not at every step), else ``none``."""
    if cache != "auto":
        return cache
    # every process of this machine (torchrun: LOCAL_WORLD_SIZE ranks) caches its own copy
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    need, free = dataset_bytes(num_items, variant, image_size) * ranks, available_ram_bytes()
    chosen = "memory" if need <= MEMORY_CACHE_SHARE * free else "none"
    logging.getLogger("med_ddpm.data").info("data.cache=auto: %s (dataset %.2f GiB, %.1f GiB RAM available)",
                                            chosen, need / 2**30, free / 2**30)
    return chosen


def cached_dataset(records: Sequence, transform: Callable, cache: str, cache_dir: str | Path | None) -> Dataset:
    """``records`` through ``transform`` (MONAI transforms: CacheDataset caches the deterministic ones), kept
    where ``cache`` says: ``memory``, ``disk`` (in ``cache_dir``) or ``none`` (transformed at every read)."""
    from monai.data import CacheDataset, PersistentDataset
    from monai.data import Dataset as MonaiDataset

    if cache == "memory":
        return CacheDataset(records, transform, cache_rate=1.0, num_workers=0, progress=False)  # one thread: threaded caching can mix up a BraTS case's 4 image files
    if cache == "disk":
        if not cache_dir:
            raise ConfigError("data.cache=disk needs data.cache_dir; pass data.cache_dir=FOLDER (for MONAI's "
                              "PersistentDataset)")
        return PersistentDataset(records, transform, cache_dir=Path(cache_dir))
    return MonaiDataset(records, transform)
