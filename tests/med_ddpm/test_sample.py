"""Sampling's pipeline around the device: masks prepared ahead by a worker process, and a bounded background
writer; errors of either reach the sampling loop as they were."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from med_ddpm.config_checks import DataError
from med_ddpm.sample import BackgroundWriter, MaskConditions, Raised, prepared_masks
from med_ddpm.utils import atomic_write_text


def held_write(folder: Path, name: str) -> Path:
    """A write that waits for ``folder/release``, then leaves ``name`` holding the pid of the process that wrote it."""
    deadline = time.monotonic() + 60
    while not (folder / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return atomic_write_text(folder / name, str(os.getpid()))


def broken(path: Path) -> Path:
    raise OSError(f"{path}: disk full")


def test_writes_run_behind_sampling_in_other_processes_in_order_and_the_queue_is_bounded(tmp_path):
    writer = BackgroundWriter(depth=2)
    writer.submit(held_write, tmp_path, "a")
    writer.submit(held_write, tmp_path, "b")
    assert len(writer.pending) == 2 and not (tmp_path / "a").exists()  # sampling went on while nothing was written
    threading.Timer(0.5, (tmp_path / "release").touch).start()
    writer.submit(held_write, tmp_path, "c")  # a third volume waits for the oldest write
    assert len(writer.pending) <= 2 and writer.wait_s > 0.3
    assert writer.close() == [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    assert writer.busy_s > 0.3  # the held write counts as writing time
    assert str(os.getpid()) not in {(tmp_path / n).read_text() for n in "abc"}  # written by the writer processes


def test_a_write_error_surfaces_in_the_sampling_loop():
    writer = BackgroundWriter(depth=1)
    writer.submit(broken, Path("a"))
    with pytest.raises(OSError, match="a: disk full"):
        writer.submit(broken, Path("b"))  # waits for "a", gets its error, and queues nothing more
    assert writer.close() == []
    last = BackgroundWriter()
    last.submit(broken, Path("c"))
    with pytest.raises(OSError, match="c: disk full"):  # the last volume's error: at close
        last.close()


class Marked(torch.utils.data.Dataset):
    """Items that leave a file naming the process that prepared them; item ``bad`` fails as a mask read would."""

    def __init__(self, folder: Path, n: int, bad: int | None = None) -> None:
        self.folder, self.n, self.bad = folder, n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int):
        atomic_write_text(self.folder / str(k), str(os.getpid()))  # the test reads it while the worker goes on
        if k == self.bad:
            return Raised(DataError(f"{k}.nii.gz: unreadable NIfTI mask"))
        return k, torch.full((2,), float(k))


def prepared(folder: Path) -> dict[int, int]:
    return {int(f.name): int(f.read_text()) for f in folder.iterdir() if not f.name.startswith(".")}  # no temp file


def test_the_first_masks_are_prepared_by_another_process_before_anyone_asks(tmp_path):
    """MONAI's import and the mask reads run in a worker process from the checkpoint's load on: on the H200, a thread
    of the sampling process took turns with the recipes' imports under the interpreter lock."""
    stream = prepared_masks(Marked(tmp_path, 3), workers=1)
    deadline = time.monotonic() + 60
    while 0 not in prepared(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prepared(tmp_path) and set(prepared(tmp_path).values()) != {os.getpid()}
    assert [(k, x.tolist()) for k, x in stream] == [(0, [0.0, 0.0]), (1, [1.0, 1.0]), (2, [2.0, 2.0])]


def test_a_mask_error_is_raised_as_it_was_when_its_turn_comes(tmp_path):
    stream = prepared_masks(Marked(tmp_path, 4, bad=2), workers=1)
    assert [k for k, _ in itertools.islice(stream, 2)] == [0, 1]
    with pytest.raises(DataError, match=r"^2.nii.gz: unreadable NIfTI mask$"):
        next(stream)
    with pytest.raises(ProcessLookupError):  # the error ended the stream: its worker was stopped and reaped
        os.kill(prepared(tmp_path)[0], 0)


def test_without_workers_each_mask_is_read_here_when_asked(tmp_path):
    stream = prepared_masks(Marked(tmp_path, 2), workers=0)
    assert not prepared(tmp_path)
    assert next(stream)[0] == 0 and prepared(tmp_path) == {0: os.getpid()}


def test_mask_conditions_hand_back_a_broken_file_as_its_error(tmp_path):
    broken = tmp_path / "broken.nii.gz"
    broken.write_bytes(b"not a nifti")
    cfg = OmegaConf.create({"masks": str(broken), "seed": 0, "data": {}, "model": {"image_size": [16, 16, 16]}})
    (item,) = list(MaskConditions(cfg, "whole_head", [16, 16, 16], "crop_or_pad", [1, 2]))  # ends: a sequence
    assert isinstance(item, Raised) and isinstance(item.error, DataError) and str(broken) in str(item.error)


class RecordingNet(torch.nn.Module):
    """An ε-network that records the layout of each input it is called with and predicts zeros."""

    in_channels, out_channels = 3, 1

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        self.calls.append((x.shape, x.stride(), x.dtype, t.shape, t.dtype))
        return torch.zeros_like(x[:, :1])


class Collected:
    def submit(self, fn, *args) -> None:
        pass


@pytest.mark.parametrize("slow_first_call", [True, False])
def test_a_compiled_stack_s_first_call_runs_on_zeros_laid_out_as_the_first_mask_s(monkeypatch, slow_first_call):
    """The warm-up call (loading the compiled forward, autotuning, graph capture while the worker reads the first mask)
    must be the call the first mask makes, or a compiled forward would compile again at it."""
    from types import SimpleNamespace

    from med_ddpm.cli import CONFIG_DIR
    from med_ddpm.diffusion import NoiseSchedule
    from med_ddpm.run_clock import RunClock
    from med_ddpm.sample import SamplingJob, sample_all
    from med_ddpm.samplers import build_sampler
    from optim import RecipeStack

    monkeypatch.setattr(RecipeStack, "slow_first_call", property(lambda self: slow_first_call))
    net, size = RecordingNet(), [8, 8, 8]
    cfg = OmegaConf.create({"num_samples": 2, "seed": 0, "progress": False})
    stack = RecipeStack.from_config(OmegaConf.load(CONFIG_DIR / "recipe" / "channels_last_3d.yaml"))
    job = SamplingJob(cfg, torch.device("cpu"), SimpleNamespace(model=net), build_sampler("ddim", NoiseSchedule(10), 2),
                      stack, ("whole_head", size, "crop_or_pad"), Path("."), None,
                      iter([(0, "m", torch.ones(2, *size), None)]))
    clock = RunClock("sample")
    with contextlib.ExitStack() as sessions:
        sample_all(job, Collected(), clock, sessions)
    first_mask = net.calls[1:] if slow_first_call else net.calls
    assert len(first_mask) == 2 and ("warmed_up_s" in clock.values) == slow_first_call
    if slow_first_call:
        assert net.calls[0] == first_mask[0]
