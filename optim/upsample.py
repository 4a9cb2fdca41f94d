"""Trilinear ×2 upsampling whose backward is a gather, not an atomic scatter.

The decoder's ``Upsample`` doubles every spatial size with trilinear interpolation
(``align_corners=False``). Its gradient is a scatter: each output voxel adds into eight input
voxels. PyTorch's CUDA kernel and inductor's compiled form (``_unsafe_index_put`` with
``accumulate=True``) both do that with atomic adds; in the channels-last step neighbouring voxels'
adds collide on C-strided addresses, and the kernel became one of the step's largest
(bench/results/h200/tuning/profile_train_channels_last_4fe4200/).

For an exact ×2 the scatter has a closed-form gather. The interpolation is separable, and along
one axis of size n, output j reads the source coordinate j/2 - 1/4 (clamped at 0), so

    out[2i]   = 3/4 x[i] + 1/4 x[max(i-1, 0)]
    out[2i+1] = 3/4 x[i] + 1/4 x[min(i+1, n-1)]

and its adjoint (the backward), with e = g[0::2], o = g[1::2], is

    dx[i] = 3/4 (e[i] + o[i]) + 1/4 (e[i+1] + o[i-1])    (terms outside 0..n-1 left out)
            + 1/4 e[0]   if i = 0          (out[0]'s clamped left neighbour is x[0])
            + 1/4 o[n-1] if i = n-1        (out[2n-1]'s clamped right neighbour is x[n-1]).

Applied along D, H and W in turn, that is the exact gradient of ``F.interpolate(mode="trilinear")``
for a ×2 size. It is computed in float32 (float64 stays float64) and cast to x's dtype: each input
voxel's gradient is one sum, with no atomics, so it is also deterministic. The forward is
``F.interpolate`` itself, so outputs are bit-identical.

Option ``forward="gather"`` also writes the forward as the separable formula above (one axis after
another, float32, cast at the end) instead of ``F.interpolate``. Why: at batch > 1 inductor's
compiled channels-last ``F.interpolate`` (``_unsafe_index`` loads) walks the voxels in NCDHW order
and stores to NDHWC addresses, uncoalesced (bench/results/h200/tuning/profile_channels_last_batch4_ac80870/).
Not bit-identical to ``F.interpolate`` (another summation order; float32 rounding).

Modules opt in by declaring ``interpolation = "trilinear_x2"`` and upsampling through
``self.interpolate(x)`` (Med-DDPM's ``Upsample``); the recipe sets that attribute on the instance.

Example:
    >>> use_gather_upsample(model)   # Med-DDPM whole-head: the 4 decoder Upsamples
    4
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from optim.base import Capabilities, Recipe
from optim.channels_last import is_only_channels_last_3d

MODE = "trilinear_x2"
FORWARDS = ("interpolate", "gather")  # the recipe's forward options: F.interpolate, or the separable gather


def trilinear_x2_reference(x: torch.Tensor) -> torch.Tensor:
    """``F.interpolate`` to twice every spatial size, trilinear, ``align_corners=False``."""
    return F.interpolate(x, size=[2 * s for s in x.shape[2:]], mode="trilinear")


def interpolate_x2(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Linear ×2 interpolation along ``dim`` (module docstring): out[2i] = 3/4 x[i] + 1/4 x[max(i-1, 0)],
    out[2i+1] = 3/4 x[i] + 1/4 x[min(i+1, n-1)]; size n -> 2n."""
    n = x.shape[dim]
    left = torch.cat([x.narrow(dim, 0, 1), x.narrow(dim, 0, n - 1)], dim)
    right = torch.cat([x.narrow(dim, 1, n - 1), x.narrow(dim, n - 1, 1)], dim)
    even, odd = 0.75 * x + 0.25 * left, 0.75 * x + 0.25 * right
    return torch.stack([even, odd], dim + 1).flatten(dim, dim + 1)


def trilinear_x2_forward(x: torch.Tensor) -> torch.Tensor:
    """:func:`trilinear_x2_reference` as three separable gathers in float32, cast back to ``x``'s dtype
    and memory format (channels-last 3-D in, channels-last 3-D out, as ``F.interpolate`` does)."""
    y = x.to(torch.promote_types(x.dtype, torch.float32))
    for dim in (4, 3, 2):
        y = interpolate_x2(y, dim)
    layout = torch.channels_last_3d if is_only_channels_last_3d(x) else torch.contiguous_format
    return y.to(x.dtype, memory_format=layout)


def adjoint_x2(g: torch.Tensor, dim: int) -> torch.Tensor:
    """The adjoint of linear ×2 interpolation along ``dim`` (module docstring): size 2n -> n."""
    n = g.shape[dim] // 2
    pairs = g.unflatten(dim, (n, 2))
    even, odd = pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)
    if n == 1:
        return even + odd
    first, zero = even.narrow(dim, 0, 1), torch.zeros_like(even.narrow(dim, 0, 1))
    left = torch.cat([first + even.narrow(dim, 1, 1), even.narrow(dim, 2, n - 2), zero], dim)
    right = torch.cat([zero, odd.narrow(dim, 0, n - 2), odd.narrow(dim, n - 2, 1) + odd.narrow(dim, n - 1, 1)], dim)
    return 0.75 * (even + odd) + 0.25 * (left + right)


def trilinear_x2_backward(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gradient of :func:`trilinear_x2_reference` w.r.t. its input, as a gather, in ``dtype``."""
    g = grad.to(torch.promote_types(grad.dtype, torch.float32))
    for dim in (4, 3, 2):
        g = adjoint_x2(g, dim)
    return g.to(dtype)


class _TrilinearX2(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gather_forward: bool) -> torch.Tensor:
        ctx.dtype = x.dtype
        return trilinear_x2_forward(x) if gather_forward else trilinear_x2_reference(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return trilinear_x2_backward(grad, ctx.dtype), None


def _check_5d(x: torch.Tensor) -> None:
    if x.dim() != 5:
        raise ValueError(f"trilinear x2 upsampling needs an (N, C, D, H, W) tensor, got shape {tuple(x.shape)}")


def trilinear_x2_gather(x: torch.Tensor) -> torch.Tensor:
    """:func:`trilinear_x2_reference` with the gather backward (5-D input)."""
    _check_5d(x)
    return _TrilinearX2.apply(x, False)


def trilinear_x2_gather_both(x: torch.Tensor) -> torch.Tensor:
    """Trilinear ×2 with a gather forward (:func:`trilinear_x2_forward`) and the gather backward."""
    _check_5d(x)
    return _TrilinearX2.apply(x, True)


def upsample_for(forward: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The upsampling function for the recipe's ``forward`` option (checked here, once for both entry points)."""
    if forward not in FORWARDS:
        raise ValueError(f"gather_upsample: forward must be one of {FORWARDS}, got {forward!r}")
    return trilinear_x2_gather_both if forward == "gather" else trilinear_x2_gather


def use_gather_upsample(model: nn.Module, forward: str = "interpolate") -> int:
    """Functional twin: every module declaring ``interpolation = "trilinear_x2"`` upsamples through
    :func:`trilinear_x2_gather` (``forward="gather"``: :func:`trilinear_x2_gather_both`); returns how
    many (parameter-free: state-dict keys unchanged)."""
    upsample = upsample_for(forward)
    swapped = 0
    for module in model.modules():
        if getattr(type(module), "interpolation", None) == MODE:
            module.interpolate = upsample
            swapped += 1
    return swapped


class GatherUpsample(Recipe):
    """Trilinear ×2 upsampling with an atomic-free, deterministic backward (same forward)."""

    name = "gather_upsample"
    capabilities = Capabilities(exact=False, tolerance={"rtol": 1e-5, "atol": 1e-6}, stage=10,
                                pays_eagerly=False)

    def __init__(self, forward: str = "interpolate") -> None:
        upsample_for(forward)  # a bad option fails when the stack is built, not at the first model
        self.forward = forward
        self.swapped = 0

    def prepare_model(self, model: nn.Module) -> nn.Module:
        self.swapped = use_gather_upsample(model, self.forward)
        return model

    def options(self) -> dict[str, Any]:
        return {"forward": self.forward}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "swapped_modules": self.swapped}
