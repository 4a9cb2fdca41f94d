"""pad_conv_channels: which convolutions it pads, and that they compute the same channels."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_deepcopy_runs_the_copy, output_and_grads, tiny_batch, tiny_unet

from optim import RecipeConflictError, pad_conv_out_channels
from optim.forward_override import overrides
from optim.pad_channels import first_channels, pad_dim

CL = torch.channels_last_3d


def test_pad_dim_adds_zero_channels_and_keeps_the_layout() -> None:
    w = torch.randn(1, 64, 3, 3, 3).contiguous(memory_format=CL)
    p = pad_dim(w, 0)
    assert p.shape == (8, 64, 3, 3, 3) and p.is_contiguous(memory_format=CL)
    assert torch.equal(p[:1], w) and not p[1:].any()
    x = torch.randn(1, 3, 4, 4, 4)
    assert pad_dim(x, 1).shape[1] == 8 and pad_dim(x, 1).is_contiguous() and torch.equal(pad_dim(x, 1)[:, :3], x)
    aligned = torch.randn(16, 2)
    assert pad_dim(aligned, 0) is aligned
    assert pad_dim(torch.ones(4), 0, multiple=3).tolist() == [1, 1, 1, 1, 0, 0]


def test_zero_padding_is_the_same_convolution() -> None:
    """Exact zeros in (input channels) or out (sliced output channels): in float64 the same numbers."""
    x, w = torch.randn(1, 3, 6, 6, 6, dtype=torch.float64), torch.randn(64, 3, 3, 3, 3, dtype=torch.float64)
    torch.testing.assert_close(F.conv3d(pad_dim(x, 1), pad_dim(w, 1), padding=1), F.conv3d(x, w, padding=1))
    x, w = torch.randn(1, 64, 6, 6, 6, dtype=torch.float64), torch.randn(1, 64, 3, 3, 3, dtype=torch.float64)
    torch.testing.assert_close(F.conv3d(x, pad_dim(w, 0), padding=1)[:, :1], F.conv3d(x, w, padding=1))


@pytest.mark.parametrize("channels_last", [False, True], ids=["ncdhw", "ndhwc"])
def test_padded_network_matches_forward_and_gradients(channels_last: bool) -> None:
    ref, model = tiny_unet(), tiny_unet()  # identical, every layer non-zero (randomize_zero_init)
    keys = list(model.state_dict())
    assert pad_conv_out_channels(model) == ["out.2"]  # tiny UNet3D: only the 1-channel output conv is narrow
    assert list(model.state_dict()) == keys and len(overrides(model.get_submodule("out.2"))) == 1
    x, t, target = tiny_batch(batch=2)
    if channels_last:
        ref, model = ref.to(memory_format=CL), model.to(memory_format=CL)
        x = x.contiguous(memory_format=CL)
    (y_ref, g_ref), (y, g) = (output_and_grads(net, x, t, target) for net in (ref, model))
    assert y.shape == y_ref.shape and y.is_contiguous()  # dense (one channel: both layouts)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)  # float32: only the summation order may differ
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())


def test_first_channels_are_dense_in_the_same_layout() -> None:
    y = torch.randn(1, 8, 3, 4, 5).contiguous(memory_format=CL)
    for n in (1, 4):
        out = first_channels(y, n)
        assert torch.equal(out, y[:, :n]) and out.is_contiguous(memory_format=CL)
    assert first_channels(torch.randn(1, 8, 3, 4, 5), 4).is_contiguous()


def test_four_output_channels_keep_the_conv_layout_and_deepcopy_runs_the_copy() -> None:
    conv = torch.nn.Sequential(torch.nn.Conv3d(16, 4, 3, padding=1)).to(memory_format=CL)
    ref = copy.deepcopy(conv)
    assert pad_conv_out_channels(conv) == ["0"]
    x = torch.randn(1, 16, 5, 5, 5).contiguous(memory_format=CL)
    y = conv(x)
    for fmt in (CL, torch.contiguous_format):  # the unpadded conv's layout (NDHWC on CUDA; the CPU conv returns NCDHW)
        assert y.is_contiguous(memory_format=fmt) == ref(x).is_contiguous(memory_format=fmt)
    torch.testing.assert_close(y, ref(x), rtol=1e-5, atol=1e-6)
    assert_deepcopy_runs_the_copy(conv, x)


def test_aligned_and_grouped_convolutions_are_left_alone() -> None:
    model = torch.nn.Sequential(torch.nn.Conv3d(8, 16, 3), torch.nn.Conv3d(16, 12, 3, groups=4), torch.nn.Conv2d(8, 3, 3))
    assert pad_conv_out_channels(model) == []


@pytest.mark.parametrize("multiple", [1, 0, 2.5])
def test_bad_multiple_is_refused(multiple) -> None:
    with pytest.raises(RecipeConflictError, match="multiple"):
        pad_conv_out_channels(torch.nn.Conv3d(8, 1, 3), multiple)
