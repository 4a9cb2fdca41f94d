"""time_fn statistics on a fake clock: exact median/p10/p90/IQR, and the noisy-run warning."""

import itertools
import warnings

import pytest
import torch

from bench.core.timing import (
    DATASHEET_PEAK_TFLOPS,
    active_precision,
    datasheet_peak_tflops,
    peak_fraction,
    summarize,
    time_fn,
)

CPU = torch.device("cpu")


def fake_clock(durations_s):
    """A clock whose consecutive (start, end) reads are `durations_s` apart."""
    ticks = itertools.accumulate(itertools.chain.from_iterable((0.0, d) for d in durations_s))
    return iter(ticks).__next__


def test_time_fn_fake_clock_exact_statistics():
    calls = []
    ms = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        t = time_fn(lambda: calls.append(1), warmup=3, iters=10, device=CPU, clock=fake_clock([m / 1e3 for m in ms]))
    assert len(calls) == 13  # warm-up calls are made but not timed
    assert t.samples == pytest.approx(ms)
    assert t.median == pytest.approx(55.0)
    assert t.p10 == pytest.approx(19.0)  # numpy 'linear': 10 + 0.9 * 10
    assert t.p90 == pytest.approx(91.0)
    assert t.iqr_pct == pytest.approx((77.5 - 32.5) / 55.0 * 100)
    assert t.mean == pytest.approx(55.0)


def test_iqr_warning_only_when_noisy():
    with pytest.warns(RuntimeWarning, match="noisy timing"):
        summarize([10.0, 10.0, 20.0, 30.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = summarize([10.0, 10.1, 10.2, 10.3, 10.4])
    assert t.iqr_pct < 10


def test_summarize_rejects_empty():
    with pytest.raises(ValueError, match="iters"):
        summarize([])


# (the name torch reports, precision, the datasheet's printed figure, printed "with sparsity")
PRINTED = [("NVIDIA H100 80GB HBM3", "bf16", 1979, True), ("NVIDIA H100 PCIe", "tf32", 756, True),
           ("NVIDIA H200", "fp16", 1979, True), ("NVIDIA H200 NVL", "bf16", 1671, True),
           ("NVIDIA A100-SXM4-80GB", "tf32", 312, True), ("NVIDIA A100-SXM4-80GB", "fp32", 19.5, False),
           ("Tesla V100-PCIE-16GB", "fp16", 112, False), ("Tesla V100-SXM2-16GB", "fp16", 125, False)]


@pytest.mark.parametrize("gpu, precision, printed, sparse", PRINTED)
def test_each_gpu_name_finds_its_own_datasheet_row(gpu, precision, printed, sparse):
    """The names torch reports reach their own row (first match wins: H100 PCIe before H100, H200 NVL before H200),
    and a tensor-core figure NVIDIA prints with sparsity is halved to the dense peak."""
    assert datasheet_peak_tflops(gpu, precision) == pytest.approx(printed / 2 if sparse else printed, abs=0.5)


@pytest.mark.parametrize("pattern, peaks", DATASHEET_PEAK_TFLOPS)
def test_the_peaks_keep_the_tensor_cores_ratios(pattern, peaks):
    """Hopper and Ampere run bf16 and fp16 at one rate and tf32 at half of it, above plain fp32; V100 has no tf32 or
    bf16 path."""
    if peaks["tf32"] is None:
        assert peaks["bf16"] is None and peaks["fp16"] > peaks["fp32"]
        return
    assert peaks["bf16"] == peaks["fp16"] and peaks["tf32"] * 2 == pytest.approx(peaks["bf16"], rel=1e-3)
    assert peaks["fp32"] < peaks["tf32"]


def test_peak_fraction_divides_by_the_row_s_peak():
    assert peak_fraction(98.94, "NVIDIA H200", "bf16") == pytest.approx(0.1)
    assert peak_fraction(1.0, None, "fp32") is None and peak_fraction(1.0, "Tesla V100-SXM2-16GB", "bf16") is None


def test_active_precision_reads_live_switches():
    assert active_precision("cpu") == "fp32"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert active_precision("cpu") == "bf16"
