"""time_fn statistics on a fake clock: exact median/p10/p90/IQR, and the noisy-run warning."""

import itertools
import warnings

import pytest
import torch

from bench.core.timing import active_precision, datasheet_peak_tflops, peak_fraction, summarize, time_fn

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


def test_datasheet_peaks_and_fraction():
    assert datasheet_peak_tflops("NVIDIA H200", "bf16") == pytest.approx(989.4)
    assert datasheet_peak_tflops("NVIDIA H100 PCIe", "tf32") == pytest.approx(378.0)
    assert datasheet_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == pytest.approx(19.5)
    assert datasheet_peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None
    assert peak_fraction(98.94, "NVIDIA H200", "bf16") == pytest.approx(0.1)
    assert peak_fraction(1.0, None, "fp32") is None


def test_active_precision_reads_live_switches():
    assert active_precision("cpu") == "fp32"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert active_precision("cpu") == "bf16"
