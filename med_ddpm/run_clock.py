"""Where a command's wall time went, written to ``<output_dir>/timings.json`` (atomically) at its end.

``med_ddpm.train`` and ``med_ddpm.sample`` record the split a user (and ``bench.core.e2e``) needs to see
why a run took as long as it did: process start to the first useful work (imports, CUDA init, data and
checkpoint loading), the first step or volume (compilation, cuDNN autotuning, CUDA-graph capture), the
steady state and, for sampling, writing. Times are seconds from this process's start, read from
``/proc`` (so Python's own start-up and the imports count), or from the first mark elsewhere.

Example:
    >>> clock = RunClock()
    >>> clock.mark("model_ready")
    >>> clock.set(ms_per_volume=61.2)
    >>> clock.write(out_dir)          # out_dir/timings.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from med_ddpm.utils import atomic_write_text

TIMINGS_FILE = "timings.json"
# torch.compile's own phase counters kept in timings.json: all of it (forward frames and the backward graphs compiled
# at the first backward), the forward frames, the backward graphs, AOTAutograd + Inductor, Inductor alone (a loaded
# compile cache makes these small: Dynamo still traces), and waiting for Triton kernel compiles
COMPILE_PHASES = ("total_wall_time", "entire_frame_compile", "entire_backward_compile", "backend_compile",
                  "inductor_compile", "async_compile.wait")


def process_start_time() -> float:
    """Epoch seconds at which this process started (Linux: ``/proc/self/stat``, 10 ms resolution), else now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a mark means "done", not "queued"."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compile_phases() -> dict[str, float]:
    """Seconds ``torch.compile`` spent in this process, per phase of :data:`COMPILE_PHASES` (Dynamo's counters,
    summed over every frame it compiled; empty when nothing was compiled). What a first step or volume took
    beyond ``total_wall_time`` is the rest of its first run: cuDNN autotuning, CUDA-graph capture and the
    step itself."""
    utils = sys.modules.get("torch._dynamo.utils")  # loaded by torch.compile; not imported here if never used
    spent = getattr(utils, "calculate_time_spent", None)
    return {k: round(v, 4) for k, v in spent().items() if k in COMPILE_PHASES} if spent else {}


class RunClock:
    """Named marks (seconds since process start) and figures, dumped as one JSON object."""

    def __init__(self, command: str) -> None:
        self.start = process_start_time()
        self.values: dict[str, Any] = {"command": command, "process_start_epoch": self.start}

    def now(self) -> float:
        return time.time() - self.start

    def mark(self, name: str) -> float:
        """Record ``<name>_s``: seconds from process start to now, and what ``torch.compile`` has spent so far."""
        self.values[f"{name}_s"] = round(self.now(), 4)
        self._keep_compile_phases()
        return self.values[f"{name}_s"]

    def _keep_compile_phases(self) -> None:
        """Keep the largest of Dynamo's counters seen: the compile recipes end their session with
        ``torch.compiler.reset()``, which zeroes them before :meth:`write` runs."""
        phases = compile_phases()
        if phases.get("total_wall_time", 0.0) >= self.values.get("torch_compile_s", {}).get("total_wall_time", 0.0):
            self.values["torch_compile_s"] = phases

    def set(self, **values: Any) -> None:
        self.values.update(values)

    def write(self, out_dir: str | Path) -> Path:
        self.values["total_s"] = round(self.now(), 4)
        self._keep_compile_phases()
        return atomic_write_text(Path(out_dir) / TIMINGS_FILE, json.dumps(self.values, indent=1, sort_keys=True))


class TimedIterator:
    """An iterator that adds up the seconds its consumer waited in ``next()`` (the data-wait share)."""

    def __init__(self, source: Iterator) -> None:
        self.source, self.wait_s = source, 0.0

    def __iter__(self) -> TimedIterator:
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        try:
            return next(self.source)
        finally:
            self.wait_s += time.perf_counter() - start


class LoopTimer:
    """First step and steady state of a training loop, with one device sync at each end of the window.

    Step 1 (compilation, cuDNN autotuning, CUDA-graph capture) is timed on its own; the steady state is
    every step after the first ``1 + warmup`` (CUDA-graph trees record on their second call). Syncing only
    at the window's ends keeps the loop's own overlap of host and device intact.

    Args:
        clock: the run's :class:`RunClock` (marks ``loop_start`` now).
        device: the device whose queue the marks wait for.
        batches: the loop's :class:`TimedIterator`, for the data-wait share of the window.
        volumes_per_step: volumes an optimizer step trains on (batch x accumulation, this rank).
        warmup: steps after the first kept out of the steady state.
    """

    def __init__(self, clock: RunClock, device: torch.device, batches: TimedIterator, volumes_per_step: int,
                 warmup: int = 2) -> None:
        self.clock, self.device, self.batches = clock, device, batches
        self.volumes_per_step, self.warmup, self.steps = volumes_per_step, warmup, 0
        self.loop_start = clock.mark("loop_start")
        self.window: tuple[float, float] | None = None  # (clock time, data wait) at the window's start

    def step_done(self, last: bool) -> bool:
        """Call after each optimizer step; True right after the first (compile caches save then)."""
        self.steps += 1
        if self.steps == 1:
            synchronize(self.device)
            self.clock.set(first_step_s=round(self.clock.now() - self.loop_start, 4))
            self.clock.mark("first_step_done")
        if self.steps == 1 + self.warmup and not last:
            synchronize(self.device)
            self.window = (self.clock.now(), self.batches.wait_s)
        elif last and self.window is not None:
            synchronize(self.device)
            self._steady(self.steps - 1 - self.warmup)
        return self.steps == 1

    def _steady(self, steps: int) -> None:
        start, wait_start = self.window
        seconds, wait = self.clock.now() - start, self.batches.wait_s - wait_start
        self.clock.set(steady_steps=steps, ms_per_step=round(1e3 * seconds / steps, 3),
                       ms_per_volume=round(1e3 * seconds / (steps * self.volumes_per_step), 3),
                       data_wait_pct=round(100 * wait / seconds, 2))

    def write(self, out_dir: str | Path, **values: Any) -> Path:
        self.clock.set(steps=self.steps, volumes_per_step=self.volumes_per_step, **values)
        return self.clock.write(out_dir)
