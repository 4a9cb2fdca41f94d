"""Training's dataset, built in another process while this one prepares the model.

Building the dataset is mostly Python: importing MONAI (seconds, without the optional packages it would load and
never use: :func:`~med_ddpm.data.datasets.without_monai_extras`) and decoding every NIfTI file for the memory cache.
Preparing the model is Python too: building the recipes and the network, loading the compile cache, applying the
recipes. Two threads would take turns under one interpreter lock, so :class:`DatasetBuild` forks a process that
builds the dataset while the command prepares the model, and :meth:`DatasetBuild.result` waits for it where the loop
first needs data.

With ``data.cache`` ``memory`` (or ``auto`` choosing it) the process reads each item once into tensors in shared
memory, stacked per key (:class:`SharedItems`): they reach this process without a copy and without importing MONAI
here, and the loader's workers read them as they would a cache of their own. Otherwise the process hands back the
dataset object itself, which reads its files when an item is asked for. Where ``fork`` is missing, the dataset is
built here; where the process dies (out of memory, or a ``/dev/shm`` too small for the set), too, as one warning
says.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import torch
from torch.utils.data import Dataset

from med_ddpm.data.cache import resolve_cache
from med_ddpm.data.datasets import build_dataset, without_monai_extras
from med_ddpm.data.encoding import Variant

log = logging.getLogger("med_ddpm.data")


class SharedItems(Dataset):
    """A dataset's items read once, their tensors stacked per key (``image``, ``cond``) and, when asked, moved to
    shared memory; other values (``name``) kept as lists. Item ``i`` holds views into the stacks: the loader's
    collation copies them, so copy an item before editing it in place.

    Attributes:
        variant: the source dataset's ``Variant``.
        cache: ``memory``: every item is decoded once, here.
    """

    cache = "memory"

    def __init__(self, dataset: Dataset, share: bool) -> None:
        self.variant: Variant = dataset.variant
        first = dataset[0]
        self.length = len(dataset)
        self.columns: dict[str, Any] = {}
        for key, value in first.items():
            if isinstance(value, torch.Tensor):
                stack = torch.empty((self.length, *value.shape), dtype=value.dtype)
                self.columns[key] = stack.share_memory_() if share else stack
            else:
                self.columns[key] = [None] * self.length
        for index in range(self.length):
            for key, value in (first if index == 0 else dataset[index]).items():
                self.columns[key][index] = value

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.length:
            raise IndexError(f"item {index} out of range [0, {self.length})")
        return {key: column[index] for key, column in self.columns.items()}


class Built(NamedTuple):
    dataset: Dataset | None  # None: the build raised ``error``
    seconds: float  # the build's, where it ran
    warnings: list[warnings.WarningMessage]  # what it warned about (files left out), for the command to repeat
    error: Exception | None  # raised by the command, after the warnings (the build's traceback in its notes)


def build_training_dataset(cfg_data: Mapping[str, Any], image_size: Sequence[int], share: bool) -> Built:
    """The dataset of ``cfg_data``, built and timed, its warnings kept. Under a memory cache (``auto`` choosing it)
    the items are read into :class:`SharedItems`, once each, instead of MONAI's ``CacheDataset``: one copy in memory,
    which another process can take over through shared memory (``share``)."""
    start, dataset, error = time.perf_counter(), None, None
    wanted = cfg_data.get("cache", "none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if wanted not in ("auto", "memory"):
                dataset = build_dataset(cfg_data, image_size)
            else:
                dataset = build_dataset({**cfg_data, "cache": "none"}, image_size)
                if resolve_cache(wanted, len(dataset), dataset.variant, image_size) == "memory":
                    dataset = SharedItems(dataset, share)
        except Exception as err:
            err.add_note(traceback.format_exc())
            error = err
    return Built(dataset, time.perf_counter() - start, caught, error)


def _serve(conn: Connection, cfg_data: Mapping[str, Any], image_size: Sequence[int]) -> None:
    """The forked process: build the dataset, send it, and run until the command has taken it (shared tensors
    travel as file descriptors that this process hands over while it runs)."""
    without_monai_extras()
    conn.send(build_training_dataset(cfg_data, image_size, share=True))
    conn.recv()


class DatasetBuild:
    """:func:`build_training_dataset` in a forked process, started now; :meth:`result` waits for it.

    The process is a daemon: a command that fails before it needs the data ends it on exit instead of waiting for it.

    Attributes:
        seconds: what the build took where it ran (None until :meth:`result` returns).
    """

    def __init__(self, cfg_data: Mapping[str, Any], image_size: Sequence[int]) -> None:
        self.cfg_data, self.image_size = dict(cfg_data), [int(s) for s in image_size]
        self.seconds: float | None = None
        self._dataset: Dataset | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        if "fork" in multiprocessing.get_all_start_methods():
            context = multiprocessing.get_context("fork")
            self._conn, theirs = context.Pipe()
            self._process = context.Process(target=_serve, args=(theirs, self.cfg_data, self.image_size),
                                            name="med_ddpm-dataset", daemon=True)
            self._process.start()
            theirs.close()

    def result(self) -> Dataset:
        """The dataset: the process's, received once (its error raised here as it was, its warnings repeated
        here), or built here."""
        if self._dataset is None:
            built = self._receive()
            for caught in built.warnings:
                warnings.warn_explicit(caught.message, caught.category, caught.filename, caught.lineno)
            if built.error is not None:
                raise built.error
            self._dataset, self.seconds = built.dataset, built.seconds
        return self._dataset

    def _receive(self) -> Built:
        if self._process is None:
            return build_training_dataset(self.cfg_data, self.image_size, False)
        try:
            built = self._conn.recv()
            self._conn.send(True)  # taken: the process may end
        except (EOFError, OSError):
            self._process.join()
            log.warning("the process building the dataset stopped (exit code %s: out of memory, or /dev/shm too "
                        "small for the set?); building it in this process", self._process.exitcode)
            return build_training_dataset(self.cfg_data, self.image_size, False)
        finally:
            self._conn.close()
        self._process.join()
        return built
