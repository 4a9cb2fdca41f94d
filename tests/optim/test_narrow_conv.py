"""narrow_conv_gemm: which convolutions it rewrites, and that equation (2) is the convolution."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_deepcopy_runs_the_copy, output_and_grads, tiny_batch, tiny_unet

from optim import NarrowConvGemm, RecipeConflictError, gemm_narrow_convs
from optim.forward_override import overrides
from optim.narrow_conv import gemm_col2im_conv3d, is_narrow_output

CL = torch.channels_last_3d
F64 = torch.float64

# (in, out, kernel, padding): Med-DDPM's ends (3 -> 64, 64 -> 1), BraTS's (8 -> 64 is wide: 64 -> 4), odd boxes
SHAPES = [(3, 16, 3, 1), (16, 1, 3, 1), (16, 4, 3, 1), (2, 3, (3, 1, 5), "same"), (9, 1, (1, 3, 3), (0, 1, 1))]


def _conv(cin: int, cout: int, kernel, padding) -> torch.nn.Conv3d:
    torch.manual_seed(cin * 10 + cout)
    return torch.nn.Conv3d(cin, cout, kernel, padding=padding).to(F64)


@pytest.mark.parametrize(("cin", "cout", "kernel", "padding"), SHAPES)
def test_gemm_col2im_is_the_convolution_in_float64(cin, cout, kernel, padding) -> None:
    """(2) is (1) in another summation order: equal to 1e-12, whichever channels are narrow."""
    form = gemm_col2im_conv3d
    conv = _conv(cin, cout, kernel, padding)
    x = torch.randn(2, cin, 5, 6, 7, dtype=F64)
    torch.testing.assert_close(form(x, conv.weight, conv.bias), conv(x), rtol=0, atol=1e-12)
    torch.testing.assert_close(form(x, conv.weight, None), F.conv3d(x, conv.weight, None, padding=conv.padding),
                               rtol=0, atol=1e-12)


def test_gradients_pass_gradcheck() -> None:
    conv = _conv(2, 3, 3, 1)
    x = torch.randn(1, 2, 3, 4, 3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(gemm_col2im_conv3d, (x, conv.weight, conv.bias))


def test_one_tap_worked_by_hand() -> None:
    """A 1-voxel-wide row, one channel in and out, kernel (1, 1, 3) = [1, 10, 100], bias 0.5:
    y[i] = x[i-1] + 10 x[i] + 100 x[i+1] + 0.5 with zeros beyond the ends."""
    w = torch.tensor([1.0, 10.0, 100.0], dtype=F64).view(1, 1, 1, 1, 3)
    b = torch.tensor([0.5], dtype=F64)
    x = torch.tensor([1.0, 2.0, 3.0], dtype=F64).view(1, 1, 1, 1, 3)
    expected = [10 + 200 + 0.5, 1 + 20 + 300 + 0.5, 2 + 30 + 0.5]
    assert gemm_col2im_conv3d(x, w, b).flatten().tolist() == expected


def test_output_keeps_the_input_layout_and_autocast_dtype() -> None:
    form = gemm_col2im_conv3d
    conv = _conv(3, 16, 3, 1).float()
    x = torch.randn(1, 3, 4, 5, 6)
    assert form(x, conv.weight, conv.bias).is_contiguous()
    y = form(x.contiguous(memory_format=CL), conv.weight, conv.bias)
    assert y.is_contiguous(memory_format=CL) and not y.is_contiguous()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, ref = form(x, conv.weight, conv.bias), conv(x)
    assert y.dtype == ref.dtype == torch.bfloat16
    # one bf16 rounding of each product column more than the conv: within a few ulps of the output scale
    assert (y.float() - conv(x)).abs().max() <= 2 ** -6 * conv(x).abs().max()


def test_which_convolutions_are_rewritten() -> None:
    assert is_narrow_output(torch.nn.Conv3d(64, 1, 3, padding=1))
    assert is_narrow_output(torch.nn.Conv3d(3, 1, 3, padding=1))
    assert not is_narrow_output(torch.nn.Conv3d(3, 64, 3, padding=1))  # narrow input: cuDNN is faster
    assert not is_narrow_output(torch.nn.Conv3d(64, 4, 3, padding=1), narrow=4)
    assert gemm_narrow_convs(tiny_unet()) == ["out.2"]
    for conv in (torch.nn.Conv3d(64, 1, 3), torch.nn.Conv3d(64, 1, 3, padding=1, stride=2),
                 torch.nn.Conv3d(64, 1, 3, padding=2, dilation=2), torch.nn.Conv3d(4, 2, 3, padding=1, groups=2),
                 torch.nn.Conv3d(64, 1, 2, padding="same"), torch.nn.Conv3d(64, 1, 3, padding=1, padding_mode="reflect"),
                 torch.nn.Conv2d(64, 1, 3, padding=1)):
        assert not is_narrow_output(conv), conv


@pytest.mark.parametrize("channels_last", [False, True], ids=["ncdhw", "ndhwc"])
def test_tiny_unet_matches_forward_and_gradients(channels_last: bool) -> None:
    ref, model = tiny_unet(), tiny_unet()
    keys = list(model.state_dict())
    assert gemm_narrow_convs(model) == ["out.2"]
    assert list(model.state_dict()) == keys and len(overrides(model.get_submodule("out.2"))) == 1
    x, t, target = tiny_batch(batch=2)
    if channels_last:
        ref, model, x = ref.to(memory_format=CL), model.to(memory_format=CL), x.contiguous(memory_format=CL)
    (y_ref, g_ref), (y, g) = (output_and_grads(net, x, t, target) for net in (ref, model))
    for a, b in zip([y, *g], [y_ref, *g_ref], strict=True):  # float32: only the summation order differs
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6 + 1e-5 * b.abs().max().item())  # the card's tolerance


def test_deepcopy_runs_the_copy_and_describe_lists_the_convolutions() -> None:
    recipe = NarrowConvGemm()
    model = recipe.prepare_model(torch.nn.Sequential(torch.nn.Conv3d(16, 1, 3, padding=1)))
    assert recipe.describe()["gemm_convs"] == ["0"] and recipe.describe()["narrow"] == 8
    assert_deepcopy_runs_the_copy(model, torch.randn(1, 16, 4, 4, 4))


def test_bad_options_are_refused() -> None:
    for narrow in (1, 0, 2.5, True):
        with pytest.raises(RecipeConflictError, match="narrow must be"):
            NarrowConvGemm(narrow)
        with pytest.raises(RecipeConflictError, match="narrow must be"):
            gemm_narrow_convs(torch.nn.Conv3d(8, 1, 3), narrow)
