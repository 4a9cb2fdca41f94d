"""GroupNorm32 (+SiLU) of a channels-last-3D tensor in that layout, with a closed-form backward for inductor.

The forward (:func:`group_norm_act_channels_last`) views x as the (N, S, C) matrix its NDHWC memory
is: per-channel statistics over S, combined exactly per group, then one pointwise pass
x·a_c + b_c (+SiLU). ``torch.compile`` fuses it; its backward is then whatever autograd derives
from those ops: three kernels per 128-channel norm of the decoder in the H200 train-step profile
(bench/results/h200/tuning/profile_train_gather_0effe44/). Inductor's code for this backward (generated on the CPU under its GPU backend's reuse rule; the GPU code itself has not
been read) writes a full-size float32 intermediate, the recomputed pre-activation y = x·a_c + b_c,
which the reduction and the dx pass read back. Per 128-channel norm at 128³ that buffer is 1.07 GB.

:class:`GroupNormActNDHWC` states the backward in closed form instead (equations in
:func:`group_norm_act_backward_ndhwc`), so that it is one column reduction over (dy, x) and one
pointwise pass over (dy, x) → dx, recomputing y and the SiLU gradient inside each: five passes
over bf16 tensors and no float32 one. Whether inductor keeps y inline depends on its
realize-on-reuse heuristic: a reused pointwise value is written out when it reads more than
``realize_reads_threshold`` (4) buffers, and y reads x, the group mean and rstd, the weight and
the bias. So it is inline at ``realize_reads_threshold`` 6, which the ``fused_groupnorm`` recipe
declares for the stack's session (``Capabilities.inductor``; ``compile``'s own ``inductor`` option
wins); with the default, y is written once in float32 (one buffer, where the autograd form writes one
or two). ``tests/optim/test_groupnorm_ndhwc.py`` checks the generated code on the CPU, and the GPU test
``test_groupnorm_closed_form_backward_compiles_without_a_float32_intermediate`` on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype: float32 for float32 and narrower (GroupNorm32), float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _as_matrix(t: torch.Tensor) -> torch.Tensor:
    """An (N, C, D, H, W) tensor as the (N, S, C) matrix of its NDHWC memory, in the arithmetic dtype."""
    return t.permute(0, 2, 3, 4, 1).reshape(t.shape[0], -1, t.shape[1]).to(_acc_dtype(t.dtype))


def _as_volume(m: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_as_matrix`, cast to ``like``'s dtype; the last op is a view, so the
    buffer inductor writes is NDHWC."""
    n, c = like.shape[:2]
    return m.type(like.dtype).reshape(n, *like.shape[2:], c).permute(0, 4, 1, 2, 3)


def group_stats(xs: torch.Tensor, num_groups: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(sample, group) mean and rstd = 1/sqrt(biased var + eps), each (N, G, 1), of the (N, S, C) matrix.

    1. per-channel mean and biased variance over S (``var_mean`` on dim 1): a column reduction
       of a row-major matrix, whose loads are coalesced and which inductor splits over the whole
       GPU at batch 1. (Reducing each group over an (N, S, G, Cg) view instead reads
       Cg-element runs every C elements: uncoalesced, and slower in ``bench.micro``.)
    2. the Cg channel statistics of each group combined exactly, all channels having S values
       (Chan et al.'s pairwise update): mean_g = mean_c(mean_c), var_g = mean_c(var_c) +
       mean_c((mean_c - mean_g)²). Welford per channel, then this, has none of the cancellation
       of E[x²] - E[x]².
    """
    n, _, c = xs.shape
    var_c, mean_c = torch.var_mean(xs, dim=1, correction=0)
    mean_c, var_c = mean_c.view(n, num_groups, -1), var_c.view(n, num_groups, -1)
    mean = mean_c.mean(-1, keepdim=True)
    var = var_c.mean(-1, keepdim=True) + (mean_c - mean).square().mean(-1, keepdim=True)
    return mean, torch.rsqrt(var + eps)


def affine(mean: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
           c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel a_c = w_c·rstd_g and b_c = bias_c - mean_g·a_c, each (N, 1, C): y = x·a + b."""
    n, num_groups = mean.shape[:2]
    scale = rstd.expand(n, num_groups, c // num_groups)
    if weight is not None:
        scale = scale * weight.view(num_groups, -1)
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias.view(num_groups, -1)
    return scale.reshape(n, 1, c), shift.reshape(n, 1, c)


def group_norm_act_channels_last(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None,
                                 bias: torch.Tensor | None, eps: float, silu: bool) -> torch.Tensor:
    """GroupNorm32 (+SiLU) of an NDHWC tensor computed in that layout and returned NDHWC.

    ``native_group_norm``'s decomposition (what inductor compiles) reshapes x to (N, G, Cg·S):
    for a channels-last input that reshape is a copy and the result is NCDHW. Here the statistics
    come from :func:`group_stats`; normalise, affine, cast and SiLU are then one pointwise pass
    on the (N, D, H, W, C) view, and only then is it permuted back, so the next convolution gets a
    channels-last input (with ``compile``'s ``layout_optimization`` off, its ``auto``). Same maths
    as ``F.group_norm`` (biased variance) in float32; the rounding differs in the last bits.
    Its backward is autograd's; :func:`group_norm_act_ndhwc_closed_form` is the same forward with a
    closed-form backward.
    """
    return _forward(x, num_groups, weight, bias, eps, silu)[0]


def _forward(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
             eps: float, silu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(act(GroupNorm32(x)), mean, rstd)`` of an NDHWC tensor (the statistics each (N, G, 1))."""
    xs = _as_matrix(x)
    mean, rstd = group_stats(xs, num_groups, eps)
    scale, shift = affine(mean, rstd, weight, bias, x.shape[1])
    y = _as_volume(xs * scale + shift, x)  # cast before SiLU, as Med-DDPM's GroupNorm32 + SiLU
    return (F.silu(y) if silu else y), mean, rstd


def group_norm_act_backward_ndhwc(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                                  bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor,
                                  silu: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Closed-form GroupNorm(+SiLU) gradient on the (N, S, C) matrix view: ``(dx, dw, db)``.

    With y = x·a_c + b_c (a_c = w_c·rstd_g), s = sigmoid(y), the SiLU gradient
    gy = g·s·(1 + y·(1 - s)) (gy = g without SiLU), and per channel over S

        A_c = Σ_s gy,   H_c = Σ_s gy·x,   B_c = Σ_s gy·x̂ = rstd_g (H_c - mean_g·A_c),

    the parameter gradients are db_c = Σ_n A_c and dw_c = Σ_n B_c, and with M = Cg·S elements a
    group, m1 = Σ_{c∈g} w_c A_c / M (the mean of gx̂ = gy·w) and m2 = Σ_{c∈g} w_c B_c / M (the mean of
    gx̂·x̂), the input gradient dx = rstd (gx̂ - m1 - x̂·m2) is, per element,

        dx = a_c·gy + (-rstd_g²·m2)·x + (rstd_g²·m2·mean_g - rstd_g·m1).

    The same formula as :func:`optim.fused_groupnorm.group_norm_act_backward` (which the eager
    Triton path slices by groups to bound its float32 temporaries); here it is two passes for
    inductor to fuse: the sums A, H (one column reduction of gy and gy·x) and dx (one pointwise).
    """
    n, c = x.shape[:2]
    num_groups = mean.shape[1]
    xs, gy = _as_matrix(x), _as_matrix(grad)
    scale, shift = affine(mean, rstd, weight, bias, c)
    if silu:
        y = xs * scale + shift
        s = torch.sigmoid(y)
        gy = gy * s * (1 + y * (1 - s))
    sum_gy, sum_gyx = gy.sum(1), (gy * xs).sum(1)  # A, H: (N, C)
    per_channel = (n, num_groups, c // num_groups)
    mean_c, rstd_c = mean.expand(per_channel).reshape(n, c), rstd.expand(per_channel).reshape(n, c)
    sum_gy_xhat = rstd_c * (sum_gyx - mean_c * sum_gy)  # B
    w = weight.view(1, c) if weight is not None else 1.0
    m = xs.shape[1] * c // num_groups
    m1 = (w * sum_gy).view(per_channel).sum(-1, keepdim=True) / m
    m2 = (w * sum_gy_xhat).view(per_channel).sum(-1, keepdim=True) / m
    coef_x = (-rstd * rstd * m2).expand(per_channel).reshape(n, 1, c)
    const = (rstd * (rstd * m2 * mean - m1)).expand(per_channel).reshape(n, 1, c)
    dx = _as_volume(scale * gy + coef_x * xs + const, x)
    dw = sum_gy_xhat.sum(0).to(weight.dtype) if weight is not None else None
    db = sum_gy.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dw, db


class GroupNormActNDHWC(torch.autograd.Function):
    """:func:`group_norm_act_channels_last` with :func:`group_norm_act_backward_ndhwc` as its backward.

    Saves x (its own dtype), weight, bias and the (N, G, 1) mean / rstd. Written in torch ops, so
    dynamo traces forward and backward into the compiled graphs.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                num_groups: int, eps: float, silu: bool) -> torch.Tensor:
        out, mean, rstd = _forward(x, num_groups, weight, bias, eps, silu)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.silu = silu
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = group_norm_act_backward_ndhwc(grad, x, weight, bias, mean, rstd, ctx.silu)
        return dx, dw, db, None, None, None


def group_norm_act_ndhwc_closed_form(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None,
                                     bias: torch.Tensor | None, eps: float, silu: bool) -> torch.Tensor:
    """:func:`group_norm_act_channels_last` through :class:`GroupNormActNDHWC` (closed-form backward)."""
    return GroupNormActNDHWC.apply(x, weight, bias, num_groups, eps, silu)
