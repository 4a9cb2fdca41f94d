"""Sampling's write path: a bounded background writer whose errors reach the sampling thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from med_ddpm.sample import BackgroundWriter, prefetched


def test_writes_run_behind_sampling_in_order_and_the_queue_is_bounded():
    release, seen = threading.Event(), []

    def slow_write(path: Path) -> Path:
        release.wait(timeout=10)
        seen.append(path)
        return path

    writer = BackgroundWriter(depth=2)
    writer.submit(slow_write, Path("a"))
    writer.submit(slow_write, Path("b"))
    assert len(writer.pending) == 2 and not seen  # sampling went on while nothing was written
    threading.Timer(0.2, release.set).start()
    writer.submit(slow_write, Path("c"))  # a third volume waits for the oldest write
    assert len(writer.pending) <= 2 and writer.wait_s > 0.1
    assert writer.close() == [Path("a"), Path("b"), Path("c")] == seen
    assert writer.busy_s > 0.1  # the held write counts as writing time


def test_a_write_error_surfaces_in_the_sampling_thread():
    def broken(path: Path) -> Path:
        raise OSError(f"{path}: disk full")

    writer = BackgroundWriter(depth=1)
    writer.submit(broken, Path("a"))
    with pytest.raises(OSError, match="a: disk full"):
        writer.submit(broken, Path("b"))  # waits for "a", gets its error, and queues nothing more
    assert writer.close() == []
    last = BackgroundWriter()
    last.submit(broken, Path("c"))
    with pytest.raises(OSError, match="c: disk full"):  # the last volume's error: at close
        last.close()


def test_the_first_mask_is_prepared_before_anyone_asks_for_it():
    """The first mask is read while the recipes and compile cache load, not after (on the H200 its read and MONAI's
    import took 6 s after the model was ready)."""
    prepared = []

    def masks():
        prepared.append("a")
        yield "a"

    stream = prefetched(masks())
    time.sleep(0.5)
    assert prepared == ["a"]
    assert list(stream) == ["a"]


def test_the_next_mask_is_prepared_while_this_one_samples():
    prepared = []

    def masks():
        for name in ("a", "b", "c"):
            prepared.append(name)
            yield name
        raise ValueError("d.nii.gz: unreadable")

    stream = prefetched(masks())
    assert next(stream) == "a"
    time.sleep(0.5)  # meanwhile the thread reads "b"
    assert prepared == ["a", "b"]
    assert list(zip(range(2), stream)) == [(0, "b"), (1, "c")]
    with pytest.raises(ValueError, match="d.nii.gz"):
        next(stream)
