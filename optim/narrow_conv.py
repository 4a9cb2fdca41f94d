"""Narrow 3-D convolutions (few input or few output channels) computed as one dense GEMM each.

Med-DDPM starts with a 3 -> 64 convolution (the noisy image and the two-channel mask) and ends
with a 64 -> 1 one (the predicted ε); BraTS has 8 -> 64 and 64 -> 4. cuDNN runs both as implicit
GEMMs whose reduction (in) or output (out) dimension is a handful of channels, far below the
tensor cores' tile, so they run at a few % of the convolutions' rate. In the H200 profiles
(bench/results/h200/tuning/): the 3 -> 64 forward takes 0.64 ms (about 34 TFLOP/s) and the
64 -> 1 output convolution's weight and data gradients take 1.76 + 0.68 ms of a 58.9 ms training
step, for 0.01 % of its FLOPs; padding the channels to 8 (``pad_conv_channels``) helps the
output conv's forward only partly (1.15 -> 0.82 ms) and the input conv not at all.

This recipe rewrites such a convolution as a GEMM whose other dimensions are wide. With
``τ`` ranging over the kernel's taps, ``r`` the "same" padding and the usual cross-correlation

    y[n, o, p] = b[o] + Σ_c Σ_τ W[o, c, τ] x[n, c, p + τ - r]                         (1)

* **few input channels (im2col)**: gather the taps into columns, then one GEMM with K = taps × C_in:

    U[n, p, (τ, c)] = x[n, c, p + τ - r]  (zero outside),  y[n, p, :] = U[n, p, :] Ŵ + b,
    Ŵ[(τ, c), o] = W[o, c, τ]                                                          (2)

* **few output channels (GEMM + col2im)**: one GEMM with N = taps × C_out, then the adjoint of
  im2col, a shifted sum over the taps (the "col2im" of Caffe's deconvolution):

    Z[n, q, (τ, o)] = Σ_c x[n, c, q] W[o, c, τ],  y[n, o, p] = b[o] + Σ_τ Z[n, p + τ - r, (τ, o)]   (3)

Both are the same sum as (1) in another order. The GEMMs run on channels-last views (NDHWC is
the GEMM's row-major [voxels × channels]); under ``torch.compile`` inductor fuses the im2col
gather and the col2im sum into single pointwise kernels around cuBLAS. The tap sum of (3) is
accumulated in float32; under autocast, Z is rounded to the compute dtype before it (one
rounding per tap product, as a bf16 convolution's output is rounded once).

The module, its Parameters and its state-dict keys are unchanged (the forward is overridden).

Example:
    >>> gemm_narrow_convs(model)                              # Med-DDPM whole-head, default forms
    {'out.2': 'col2im'}
    >>> gemm_narrow_convs(model, forms=("im2col", "col2im"))  # the input conv too
    {'input_blocks.0.0': 'im2col', 'out.2': 'col2im'}
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from optim.base import Recipe, RecipeConflictError
from optim.channels_last import is_only_channels_last_3d
from optim.forward_override import override_forward

NARROW = 8  # cuDNN's NDHWC channel granule for 16-bit types: narrower convs fall off the fast kernels
ALIGN = 8  # GEMM leading dimensions padded to 8 elements (16 bytes), the alignment cuBLAS's tensor-core kernels need


def check_options(narrow: int, forms: tuple[str, ...]) -> None:
    """The one validation of the options, shared by the recipe and its functional twin."""
    if not isinstance(narrow, int) or narrow < 2:
        raise RecipeConflictError(f"narrow_conv_gemm narrow must be an integer >= 2, got {narrow!r}")
    if not forms or set(forms) - set(FORMS):
        raise RecipeConflictError(f"narrow_conv_gemm forms must be a non-empty subset of {sorted(FORMS)}, got {forms!r}")


def is_same_conv(conv: nn.Module) -> bool:
    """An ungrouped, unstrided, undilated 3-D convolution with zero "same" padding and odd kernels:
    the convolutions (1) covers, with output size = input size."""
    if not isinstance(conv, nn.Conv3d) or conv.groups != 1 or conv.padding_mode != "zeros":
        return False
    k = conv.kernel_size
    same = conv.padding == "same" or tuple(conv.padding) == tuple(s // 2 for s in k)
    return same and all(s % 2 for s in k) and set(conv.stride) == {1} and set(conv.dilation) == {1}


def form_for(conv: nn.Module, narrow: int = NARROW, forms: tuple[str, ...] = ("im2col", "col2im")) -> str | None:
    """Of ``forms``: ``"im2col"`` when the input is narrow, ``"col2im"`` when the output is, else ``None``."""
    if not is_same_conv(conv):
        return None
    if conv.in_channels < narrow and "im2col" in forms:
        return "im2col"
    return "col2im" if conv.out_channels < narrow and "col2im" in forms else None


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


def im2col_conv3d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Equation (2): the taps gathered into columns (K = taps × C_in, padded to 8), one GEMM."""
    dtype = _compute_dtype(x)
    kernel, size = tuple(weight.shape[2:]), x.shape[2:]
    x_l = _same_pad(x.to(dtype).permute(0, 2, 3, 4, 1), kernel, extra_dims=1)
    cols = [x_l[:, a:a + size[0], b:b + size[1], c:c + size[2], :] for a, b, c in _taps(kernel)]
    u = _pad_last(torch.cat(cols, dim=-1))
    w = weight.to(dtype).permute(2, 3, 4, 1, 0).reshape(-1, weight.shape[0])  # Ŵ[(τ, c), o]
    y_l = u @ F.pad(w, (0, 0, 0, u.shape[-1] - w.shape[0]))
    if bias is not None:
        y_l = y_l + bias.to(dtype)
    return _as_conv_output(y_l, x)


def gemm_col2im_conv3d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Equation (3): one GEMM to (tap, out-channel) columns, then the shifted tap sum in (at least) float32."""
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


FORMS = {"im2col": im2col_conv3d, "col2im": gemm_col2im_conv3d}
# im2col measured 3x slower than cuDNN's 3 -> 64 forward on the H200 (bench.micro, round 9): opt in with forms
DEFAULT_FORMS = ("col2im",)


def gemm_conv_forward(x: torch.Tensor, conv: nn.Conv3d, form: str) -> torch.Tensor:
    """``conv(x)`` by ``form`` (a key of :data:`FORMS`)."""
    return FORMS[form](x, conv.weight, conv.bias)


def _gemm(original: Any, conv: nn.Conv3d, form: str) -> Any:
    """The override factory (deep-copyable: ``conv`` is rebound to the copy by deepcopy's memo)."""
    return functools.partial(gemm_conv_forward, conv=conv, form=form)


def gemm_narrow_convs(model: nn.Module, narrow: int = NARROW, forms: tuple[str, ...] = DEFAULT_FORMS) -> dict[str, str]:
    """Functional twin: compute every "same" ``Conv3d`` with fewer than ``narrow`` input or output
    channels as a GEMM of ``forms``; returns ``{module name: form}`` (state-dict keys unchanged)."""
    check_options(narrow, forms)
    applied = {}
    for name, module in model.named_modules():
        if form := form_for(module, narrow, forms):
            override_forward(module, functools.partial(_gemm, conv=module, form=form))
            applied[name] = form
    return applied


class NarrowConvGemm(Recipe):
    """Compute Med-DDPM's narrow end convolutions (64 -> 1; 3 -> 64 with ``forms``) as dense GEMMs."""

    name = "narrow_conv_gemm"
    exact = False
    tolerance = {"rtol": 1e-5, "atol": 1e-6}
    stage = 10
    conflicts = ("pad_conv_channels",)  # both replace the output convolution's forward

    def __init__(self, narrow: int = NARROW, forms: Sequence[str] = DEFAULT_FORMS) -> None:
        self.narrow, self.forms = narrow, tuple(forms)
        check_options(self.narrow, self.forms)
        self.applied: dict[str, str] = {}

    def prepare_model(self, model: nn.Module) -> nn.Module:
        self.applied = gemm_narrow_convs(model, self.narrow, self.forms)
        return model

    def options(self) -> dict[str, Any]:
        return {"narrow": self.narrow, "forms": list(self.forms)}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "gemm_convs": self.applied}
