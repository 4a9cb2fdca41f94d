"""bench.micro: the GroupNorm forms it times agree with GroupNorm32, and it writes one record."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from bench import micro


def test_padded_adds_zero_channels_and_keeps_ndhwc() -> None:
    w = torch.randn(1, 64, 3, 3, 3)
    p = micro.padded(w, 0)
    assert p.shape == (8, 64, 3, 3, 3) and p.is_contiguous(memory_format=torch.channels_last_3d)
    assert torch.equal(p[:1], w) and not p[1:].any()
    x = torch.randn(1, 3, 4, 4, 4)
    assert micro.padded(x, 1).shape[1] == 8 and torch.equal(micro.padded(x, 1)[:, :3], x)
    assert micro.padded(torch.randn(1, 16, 2, 2, 2), 1).shape[1] == 16  # already a multiple


def test_zero_padded_convolutions_compute_the_same_channels() -> None:
    """The padded variants it times are the same convolution: exact zeros in, sliced channels out."""
    x, w = torch.randn(1, 3, 6, 6, 6, dtype=torch.float64), torch.randn(64, 3, 3, 3, 3, dtype=torch.float64)
    torch.testing.assert_close(F.conv3d(micro.padded(x, 1), micro.padded(w, 1), padding=1), F.conv3d(x, w, padding=1))
    x, w = torch.randn(1, 64, 6, 6, 6, dtype=torch.float64), torch.randn(1, 64, 3, 3, 3, dtype=torch.float64)
    torch.testing.assert_close(F.conv3d(x, micro.padded(w, 0), padding=1)[:, :1], F.conv3d(x, w, padding=1))


@pytest.mark.filterwarnings("ignore:noisy timing")
def test_run_writes_rows_for_every_form_and_conv(tmp_path) -> None:
    path = micro.run(tmp_path, size=8, compile=False, iters=2)
    record = json.loads(path.read_text())
    assert record["env"]["torch"] == torch.__version__ and record["size"] == 8
    gn = [r for r in record["rows"] if r["kind"] == "groupnorm_silu"]
    assert [r["channels"] for r in gn] == list(micro.CHANNELS)  # CPU, no compile: the eager composite only
    assert all("error" not in r and r["max_abs_err"] == 0.0 and r["ms_median"] > 0 for r in gn)
    convs = [r["conv"] for r in record["rows"] if r["kind"] == "conv3d"]
    assert convs == ["input 3->64", "input 8->64 (zero-padded)", "output 64->1", "output 64->8 (zero-padded)"]


def test_the_compiled_ndhwc_form_matches_groupnorm32() -> None:
    x = torch.randn(1, 64, 6, 6, 6)
    w, b = torch.randn(64), torch.randn(64)
    cases = dict((form, (fn, inp)) for form, fn, inp in micro.groupnorm_cases(x, compile=True))
    fn, inp = cases["compiled NDHWC form (fused_groupnorm)"]
    assert inp.is_contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(fn(inp, 32, w, b, 1e-5), micro.group_norm_silu(x, 32, w, b, 1e-5), rtol=1e-5, atol=1e-5)


def test_bad_arguments_print_usage() -> None:
    assert micro.main(["size=8"]) == 2 and micro.main(["out=x", "bogus=1"]) == 2
