"""Narrow-output 3-D convolutions (Med-DDPM's 64 -> 1 output conv) computed as one dense GEMM + col2im.

Med-DDPM ends with a 64 -> 1 convolution (the predicted ε; 64 -> 4 for BraTS). cuDNN runs it as an
implicit GEMM whose output dimension is a handful of channels, far below the tensor cores' tile, so
it runs at a few % of the other convolutions' rate (H200 profiles, bench/results/h200/tuning/).

This recipe rewrites such a convolution as a GEMM whose other dimensions are wide. With ``τ``
ranging over the kernel's taps, ``r`` the "same" padding and the usual cross-correlation

    y[n, o, p] = b[o] + Σ_c Σ_τ W[o, c, τ] x[n, c, p + τ - r]                         (1)

one GEMM with N = taps × C_out gives every tap's product, then the adjoint of im2col, a shifted sum
over the taps (the "col2im" of Caffe's deconvolution):

    Z[n, q, (τ, o)] = Σ_c x[n, c, q] W[o, c, τ],  y[n, o, p] = b[o] + Σ_τ Z[n, p + τ - r, (τ, o)]   (2)

It is the same sum as (1) in another order. The GEMM runs on a channels-last view (NDHWC is the
GEMM's row-major [voxels × channels]); under ``torch.compile`` inductor fuses the tap sum into one
pointwise kernel after cuBLAS. The tap sum is accumulated in float32; under autocast, Z is rounded
to the compute dtype before it (one rounding per tap product, as a bf16 convolution's output is
rounded once).

The module, its Parameters and its state-dict keys are unchanged (the forward is overridden).

Example:
    >>> gemm_narrow_convs(model)                              # Med-DDPM whole-head
    ['out.2']
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from optim.base import Capabilities, Recipe, RecipeConflictError
from optim.channels_last import is_only_channels_last_3d
from optim.forward_override import override_forward

NARROW = 8  # cuDNN's NDHWC channel granule for 16-bit types: narrower convs fall off the fast kernels
ALIGN = 8  # GEMM leading dimensions padded to 8 elements (16 bytes), the alignment cuBLAS's tensor-core kernels need


def check_narrow(narrow: int) -> None:
    """The one validation of ``narrow``, shared by the recipe and its functional twin."""
    if isinstance(narrow, bool) or not isinstance(narrow, int) or narrow < 2:
        raise RecipeConflictError(f"narrow_conv_gemm narrow must be an integer >= 2, got {narrow!r}")


def is_same_conv(conv: nn.Module) -> bool:
    """An ungrouped, unstrided, undilated 3-D convolution with zero "same" padding and odd kernels:
    the convolutions (1) covers, with output size = input size."""
    if not isinstance(conv, nn.Conv3d) or conv.groups != 1 or conv.padding_mode != "zeros":
        return False
    k = conv.kernel_size
    same = conv.padding == "same" or tuple(conv.padding) == tuple(s // 2 for s in k)
    return same and all(s % 2 for s in k) and set(conv.stride) == {1} and set(conv.dilation) == {1}


def is_narrow_output(conv: nn.Module, narrow: int = NARROW) -> bool:
    """Whether ``conv`` is a "same" ``Conv3d`` with fewer than ``narrow`` output channels."""
    return is_same_conv(conv) and conv.out_channels < narrow

def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the convolution would compute in: autocast's, else the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _pad_last(t: torch.Tensor, multiple: int = ALIGN) -> torch.Tensor:
    return F.pad(t, (0, -t.shape[-1] % multiple))


def _same_pad(x_l: torch.Tensor, kernel: tuple[int, ...], extra_dims: int) -> torch.Tensor:
    """Zero-pad the spatial dims (1, 2, 3) of a channels-last view by ``k // 2`` on each side;
    the ``extra_dims`` trailing dims after them (channels, taps) are left alone."""
    pads = [0, 0] * extra_dims
    for k in reversed(kernel):
        pads += [k // 2, k // 2]
    return F.pad(x_l, pads)


def _taps(kernel: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """The kernel's taps τ in W's row-major (kd, kh, kw) order."""
    return list(itertools.product(*(range(k) for k in kernel)))


def _as_conv_output(y_l: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[N, D, H, W, O] -> [N, O, D, H, W], in the input's layout (as a convolution returns it)."""
    y = y_l.permute(0, 4, 1, 2, 3)
    return y if is_only_channels_last_3d(x) else y.contiguous()


def gemm_col2im_conv3d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Equation (2): one GEMM to (tap, out-channel) columns, then the shifted tap sum in (at least) float32."""
    dtype = _compute_dtype(x)
    acc = torch.promote_types(dtype, torch.float32)
    out_channels, kernel, size = weight.shape[0], tuple(weight.shape[2:]), x.shape[2:]
    w = weight.to(dtype).permute(1, 2, 3, 4, 0).reshape(weight.shape[1], -1)  # [C_in, (τ, o)]
    z = x.to(dtype).permute(0, 2, 3, 4, 1) @ _pad_last(w)
    z = _same_pad(z[..., :w.shape[1]].unflatten(-1, (*kernel, out_channels)), kernel, extra_dims=4)
    y_l = sum(z[:, a:a + size[0], b:b + size[1], c:c + size[2], a, b, c, :].to(acc) for a, b, c in _taps(kernel))
    if bias is not None:
        y_l = y_l + bias.to(acc)
    return _as_conv_output(y_l.to(dtype), x)


def gemm_conv_forward(x: torch.Tensor, conv: nn.Conv3d) -> torch.Tensor:
    """``conv(x)`` by equation (2)."""
    return gemm_col2im_conv3d(x, conv.weight, conv.bias)


def _gemm(original: Any, conv: nn.Conv3d) -> Any:
    """The override factory (deep-copyable: ``conv`` is rebound to the copy by deepcopy's memo)."""
    return functools.partial(gemm_conv_forward, conv=conv)


def gemm_narrow_convs(model: nn.Module, narrow: int = NARROW) -> list[str]:
    """Functional twin: compute every "same" ``Conv3d`` with fewer than ``narrow`` output channels by (2);
    returns the rewritten modules' names (state-dict keys unchanged)."""
    check_narrow(narrow)
    names = []
    for name, module in model.named_modules():
        if is_narrow_output(module, narrow):
            override_forward(module, functools.partial(_gemm, conv=module))
            names.append(name)
    return names


class NarrowConvGemm(Recipe):
    """Compute Med-DDPM's narrow output convolution (64 -> 1) as a dense GEMM and a tap sum."""

    name = "narrow_conv_gemm"
    capabilities = Capabilities(exact=False, tolerance={"rtol": 1e-5, "atol": 1e-6}, stage=10, pays_eagerly=False)

    def __init__(self, narrow: int = NARROW) -> None:
        check_narrow(narrow)
        self.narrow = narrow
        self.applied: list[str] = []

    def prepare_model(self, model: nn.Module) -> nn.Module:
        self.applied = gemm_narrow_convs(model, self.narrow)
        return model

    def options(self) -> dict[str, Any]:
        return {"narrow": self.narrow}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "gemm_convs": self.applied}
