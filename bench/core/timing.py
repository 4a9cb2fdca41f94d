"""Timing, peak memory and FLOP accounting for one benchmark scenario.

The rules follow nanoGPT's ``bench.py`` and the diffusers benchmark suite: warm up before
timing, synchronise, time every iteration with CUDA events (so p10/p90 are real per-step
numbers, not averages of blocks), report the median with p10/p90 and the IQR, and record the
peak memory of the scenario alone.

Example:
    >>> t = time_fn(lambda: torch.ones(8) * 2, warmup=1, iters=5, device=torch.device("cpu"))
    >>> t.median, t.p10, t.p90        # milliseconds
"""

from __future__ import annotations

import gc
import math
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from med_ddpm.run_clock import synchronize
from optim.flags import effective_flags

IQR_WARN_PCT = 10.0
GIB = 2**30

# Dense (no structured sparsity) peak TFLOP/s from the NVIDIA datasheets: V100 (SXM2/PCIe),
# A100 (40/80 GB, SXM4 and PCIe share the tensor peaks), H100 SXM5 / PCIe, H200 SXM / NVL.
# NVIDIA quotes TF32/BF16/FP16 "with sparsity"; the values here are those halved.
# None = the GPU has no tensor-core path for that precision.  Order matters: first match wins.
DATASHEET_PEAK_TFLOPS: tuple[tuple[str, dict[str, float | None]], ...] = (
    (r"H200.*NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    (r"H200", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (r"H100.*PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5}),
    (r"H100", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    (r"A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"V100.*PCIE", {"fp32": 14.0, "tf32": None, "bf16": None, "fp16": 112.0}),
    (r"V100", {"fp32": 15.7, "tf32": None, "bf16": None, "fp16": 125.0}),
)


@dataclass(frozen=True)
class Timings:
    """Per-iteration wall times of one scenario, in milliseconds."""

    samples: tuple[float, ...]
    median: float
    p10: float
    p90: float
    iqr_pct: float  # (p75 - p25) / median * 100: the spread the 10 % warning is about
    mean: float
    std: float

    def as_dict(self) -> dict:
        return asdict(self)


def percentile(sorted_ms: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default "linear" method) of sorted data."""
    pos = (len(sorted_ms) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (pos - lo)


def summarize(samples_ms: list[float]) -> Timings:
    """Median, p10, p90, IQR % and mean/std of per-iteration times; warns on a noisy run."""
    if not samples_ms:
        raise ValueError("summarize: no timing samples (iters must be >= 1)")
    s = sorted(samples_ms)
    median = percentile(s, 50)
    iqr_pct = (percentile(s, 75) - percentile(s, 25)) / median * 100.0 if median > 0 else 0.0
    mean = sum(s) / len(s)
    std = math.sqrt(sum((x - mean) ** 2 for x in s) / (len(s) - 1)) if len(s) > 1 else 0.0
    if iqr_pct > IQR_WARN_PCT:
        warnings.warn(
            f"noisy timing: IQR is {iqr_pct:.1f}% of the median ({median:.3f} ms) over {len(s)} "
            f"iterations (> {IQR_WARN_PCT:.0f}%); check for a busy GPU/CPU or raise iters",
            RuntimeWarning,
            stacklevel=2,
        )
    return Timings(tuple(samples_ms), median, percentile(s, 10), percentile(s, 90), iqr_pct, mean, std)


def _cuda_event_times(fn: Callable[[], object], iters: int) -> list[float]:
    """One start/end event pair per iteration, read after a single final synchronise."""
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in pairs]


def _clock_times(fn: Callable[[], object], iters: int, clock: Callable[[], float], sync: Callable[[], None]) -> list[float]:
    out = []
    for _ in range(iters):
        sync()
        t0 = clock()
        fn()
        sync()
        out.append((clock() - t0) * 1e3)
    return out


def time_fn(
    fn: Callable[[], object],
    *,
    warmup: int = 5,
    iters: int = 20,
    device: torch.device,
    clock: Callable[[], float] | None = None,
) -> Timings:
    """Time ``fn`` after ``warmup`` untimed calls.

    On CUDA (and no injected clock) each iteration is bracketed by CUDA events, so host-side
    launch gaps inside the step count but the host's lead over the GPU does not. Elsewhere
    ``clock`` (default ``time.perf_counter``, seconds) brackets each call with a synchronise.

    Args:
        fn: the step; its return value is ignored.
        warmup: untimed calls first (cuDNN autotuning, allocator growth, compile recompiles).
        iters: timed calls (>= 20 recommended for a stable p10/p90).
        device: where the step runs.
        clock: injectable seconds clock (tests use a fake one).

    Returns:
        :class:`Timings` in milliseconds.
    """
    if iters < 1:
        raise ValueError(f"time_fn: iters must be >= 1, got {iters}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type == "cuda" and clock is None:
        samples = _cuda_event_times(fn, iters)
    else:
        samples = _clock_times(fn, iters, clock or time.perf_counter, lambda: synchronize(device))
    return summarize(samples)


def time_once(fn: Callable[[], object], device: torch.device, clock: Callable[[], float] = time.perf_counter) -> float:
    """Wall seconds of one synchronised call (used for the compile / first call)."""
    synchronize(device)
    t0 = clock()
    fn()
    synchronize(device)
    return clock() - t0


def flush(device: torch.device) -> None:
    """Free cached memory and reset the peak counter, so the next scenario's peak is its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float | None:
    """Peak allocated memory since the last :func:`flush` (GiB); None where not tracked (CPU)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / GIB


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs of one call of ``fn`` from ``torch.utils.flop_counter`` (matmul/conv/attention ops).

    Run it on the meta device to count the model's FLOPs without computing anything.
    """
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return int(counter.get_total_flops())


def active_precision(device_type: str) -> str:
    """The math precision in force right now: bf16/fp16 under autocast, else tf32 or fp32.

    Read from the live switches (autocast state, ``fp32_precision`` of cuDNN conv and cuBLAS),
    i.e. what the recipe stack's session and forward context actually set, so the peak
    that :func:`peak_fraction` divides by matches the kernels that ran.
    """
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    if device_type != "cuda":  # the fp32_precision switches are cuDNN/cuBLAS ones
        return "fp32"
    flags = effective_flags()  # "none" leaves inherit from their parents
    return "tf32" if "tf32" in (flags["cudnn.conv.fp32_precision"], flags["cuda.matmul.fp32_precision"]) else "fp32"


def datasheet_peak_tflops(gpu_name: str, precision: str) -> float | None:
    """Dense datasheet peak (TFLOP/s) of ``gpu_name`` at ``precision``; None if unknown."""
    for pattern, peaks in DATASHEET_PEAK_TFLOPS:
        if re.search(pattern, gpu_name, flags=re.IGNORECASE):
            return peaks.get(precision)
    return None


def achieved_tflops(flops: int | None, ms: float | None) -> float | None:
    """FLOPs per step over the median step time, in TFLOP/s."""
    if not flops or not ms:
        return None
    return flops / (ms * 1e-3) / 1e12


def peak_fraction(tflops: float | None, gpu_name: str | None, precision: str) -> float | None:
    """Achieved over datasheet peak for the active precision (None on CPU / unknown GPUs)."""
    if tflops is None or not gpu_name:
        return None
    peak = datasheet_peak_tflops(gpu_name, precision)
    return tflops / peak if peak else None
