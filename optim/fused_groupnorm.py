"""GroupNorm + SiLU fused into one module, with a batch-1-friendly Triton kernel on CUDA.

Med-DDPM normalises with ``GroupNorm32`` (statistics in float32, cast back) and almost always
follows it with SiLU: ``Sequential(GroupNorm32, SiLU, ...)``. At batch 1 PyTorch's GroupNorm
statistics kernel runs only N x G = 32 blocks and dominates the eager bf16 step. This recipe rewrites the model generically:

* in every ``nn.Sequential``, a (``nn.GroupNorm`` subclass, ``nn.SiLU``) pair becomes
  (``FusedGroupNormAct(act="silu")``, ``nn.Identity()``) at the same indices;
* any other ``nn.GroupNorm`` becomes ``FusedGroupNormAct(act=None)``.

``FusedGroupNormAct`` *is* an ``nn.GroupNorm`` holding the same ``weight``/``bias`` Parameters,
so state-dict keys and the optimiser's parameters are unchanged.

Implementations (``impl``):

* ``"triton"``: :mod:`optim.triton_groupnorm` (split-reduction Welford statistics, then one
  normalise + affine + SiLU + cast pass, NCDHW and channels-last-3D without copies), through
  the autograd Function ``_GroupNormActFn``. It saves only x (in its own dtype, bf16 under AMP),
  weight, bias and the kernel's (N, G) float32 mean and rstd; its backward is the closed-form
  GroupNorm(+SiLU) gradient (:func:`group_norm_act_backward`, float32 arithmetic), computed in
  ``BACKWARD_CHUNKS`` = 8 slices of groups so that its float32 temporaries (at most three
  slice-sized tensors at a time) never cover more than ~1/8 of the activation; activations under
  8 x ``MIN_CHUNK_ELEMENTS`` = 32 Mi elements take fewer, larger slices (one below 8 Mi), since
  each slice costs ~25 small kernels. (Autograd of the torch composite would materialise x.float(), the
  float32 GroupNorm output and their gradients at full size.) The closed form is
  mathematically the gradient autograd computes; only float32 rounding differs. The forward
  kernel is pluggable: :func:`forward_stats_torch` computes the same ``(y, mean, rstd)`` in
  torch, so CPU tests run exactly the backward code that CUDA runs.
* ``"torch"``: ``silu(group_norm(x.float()).type(x.dtype))``: bit-identical to the reference,
  and a form ``torch.compile`` fuses (inductor splits large reductions itself). Its backward is
  autograd's.
* ``"auto"``: Triton for CUDA tensors when triton imports and we are not being compiled,
  otherwise torch (so eager CPU, and anything compiled, keeps the composite).

``ndhwc_backward`` picks the torch form's backward on channels-last inputs: ``"autograd"`` (what
autograd derives from the NDHWC forward) or ``"closed_form"`` (:mod:`optim.groupnorm_ndhwc`: one
reduction and one pointwise pass for inductor, without a float32 intermediate).

Example:
    >>> fuse_groupnorm(model, impl="auto")
    {'fused_silu': 17, 'plain': 2}
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from optim.base import Capabilities, Recipe, RecipeConflictError
from optim.channels_last import is_only_channels_last_3d
from optim.groupnorm_ndhwc import _acc_dtype, group_norm_act_channels_last, group_norm_act_ndhwc_closed_form

IMPLS = ("auto", "triton", "torch")
NDHWC_BACKWARDS = ("autograd", "closed_form")  # the torch form's backward on channels-last inputs
ACTS = (None, "silu")
BACKWARD_CHUNKS = 8  # the backward's float32 temporaries cover at most ceil(G / 8) groups at a time
# ...but a slice is not made smaller than this many elements: small activations (low resolutions,
# attention) are done in one piece, since each slice costs ~25 small kernel launches
MIN_CHUNK_ELEMENTS = 1 << 22


def check_impl(impl: str, ndhwc_backward: str = "autograd") -> None:
    """The one validation of the options, shared by the recipe, its module and its functional twin."""
    if impl not in IMPLS:
        raise RecipeConflictError(f"fused_groupnorm impl must be one of {IMPLS}, got {impl!r}")
    if ndhwc_backward not in NDHWC_BACKWARDS:
        raise RecipeConflictError(f"fused_groupnorm ndhwc_backward must be one of {NDHWC_BACKWARDS}, "
                                  f"got {ndhwc_backward!r}")


@functools.cache
def triton_available() -> bool:
    """Whether :mod:`optim.triton_groupnorm` imports (triton installed; CPU wheels have none)."""
    try:
        import optim.triton_groupnorm  # noqa: F401
    except ImportError:
        return False
    return True


def group_norm_act_torch(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None,
                         bias: torch.Tensor | None, eps: float, silu: bool,
                         ndhwc_backward: str = "autograd") -> torch.Tensor:
    """Reference maths: GroupNorm32 (fp32 statistics, cast back to x's dtype), then SiLU.

    NCDHW inputs take ``F.group_norm`` (bit-identical to Med-DDPM's GroupNorm32); channels-last-3D
    inputs take :func:`group_norm_act_channels_last`, so that compiled code can stay channels-last,
    with autograd's backward or (``ndhwc_backward="closed_form"``) :mod:`optim.groupnorm_ndhwc`'s.
    """
    if is_only_channels_last_3d(x):
        form = group_norm_act_ndhwc_closed_form if ndhwc_backward == "closed_form" else group_norm_act_channels_last
        return form(x, num_groups, weight, bias, eps, silu)
    y = F.group_norm(x.float(), num_groups, weight, bias, eps).type(x.dtype)
    return F.silu(y) if silu else y


def forward_stats_torch(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None,
                        bias: torch.Tensor | None, eps: float, silu: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward kernel in torch: ``(y, mean, rstd)``, y bit-identical to :func:`group_norm_act_torch`
    (float64 inputs stay float64, so gradcheck can run).

    ``native_group_norm`` is the op ``F.group_norm`` runs; it also returns the (N, G) statistics.
    As ``F.group_norm`` does, its input is made contiguous in the layout the device's kernel takes:
    the CPU kernel reads channels-last, the CUDA one only NCDHW (a channels_last_3d input fails there).
    """
    n, c = x.shape[:2]
    xa = x.to(_acc_dtype(x.dtype))
    xa = xa if xa.device.type == "cpu" else xa.contiguous()
    y, mean, rstd = torch.native_group_norm(xa, weight, bias, n, c, math.prod(x.shape[2:]), num_groups, eps)
    y = y.type(x.dtype)
    return (F.silu(y) if silu else y), mean, rstd


def forward_stats_triton(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None,
                         bias: torch.Tensor | None, eps: float, silu: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward kernel in Triton (CUDA): ``(y, mean, rstd)`` as the split-reduction kernel used them."""
    from optim.triton_groupnorm import group_norm_act_triton

    return group_norm_act_triton(x, num_groups, weight, bias, eps, silu, x.dtype, return_stats=True)


ForwardKernel = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
FORWARD_KERNELS: dict[str, ForwardKernel] = {"torch": forward_stats_torch, "triton": forward_stats_triton}


def group_chunks(num_groups: int, chunks: int = BACKWARD_CHUNKS, numel: int | None = None,
                 min_chunk_elements: int = MIN_CHUNK_ELEMENTS) -> list[tuple[int, int]]:
    """``[(g0, g1), ...]`` covering the groups in order, each of at most ceil(num_groups / chunks).

    With ``numel`` (the activation's size), fewer slices are made when ``chunks`` slices would
    be smaller than ``min_chunk_elements``: one slice for a tensor below that size.
    """
    if chunks < 1:
        raise ValueError(f"backward chunks must be >= 1, got {chunks}")
    if numel is not None and min_chunk_elements > 0:
        chunks = max(1, min(chunks, numel // min_chunk_elements))
    step = -(-num_groups // chunks)
    return [(g0, min(g0 + step, num_groups)) for g0 in range(0, num_groups, step)]


def group_norm_act_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                            bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor,
                            num_groups: int, silu: bool, needs: tuple[bool, ...] = (True, True, True),
                            chunks: int = BACKWARD_CHUNKS, min_chunk_elements: int = MIN_CHUNK_ELEMENTS
                            ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Closed-form GroupNorm(+SiLU) backward, one slice of ceil(G / chunks) groups at a time
    (fewer, larger slices for tensors under ``chunks * min_chunk_elements``: :func:`group_chunks`).

    For sample n, group g (M = (C/G)·S elements; channel c of the group; mu, rstd its statistics;
    g the incoming gradient):

        xhat  = (x - mu) * rstd                 y = xhat * w_c + b_c
        gy    = g * s * (1 + y * (1 - s)),  s = sigmoid(y)      (with SiLU; else gy = g)
        db_c  = sum_{n,s} gy                    dw_c = sum_{n,s} gy * xhat
        gxhat = gy * w_c
        dx    = rstd * (gxhat - mean_M(gxhat) - xhat * mean_M(gxhat * xhat))

    With A_nc = sum_s gy and B_nc = sum_s gy * xhat: db = sum_n A, dw = sum_n B,
    mean_M(gxhat) = sum_c w_c A_nc / M and mean_M(gxhat * xhat) = sum_c w_c B_nc / M. This is the
    exact gradient of GroupNorm (biased variance) followed by SiLU, evaluated in float32 (float64
    for float64 inputs). A slice holds at most three float32 tensors of its groups (xhat, gy and
    one product), never a float32 copy of the whole of x.

    Returns ``(dx, dw, db)`` (``None`` where ``needs`` says not wanted or the parameter is None):
    dx in x's dtype and strides (``empty_like``: NCDHW, channels_last_3d, any dense layout), dw
    and db in the parameters' dtypes.
    """
    need_x, need_w, need_b = needs[:3]
    n, c, *spatial = x.shape
    cg = c // num_groups
    acc = _acc_dtype(x.dtype)
    mean4 = mean.to(acc).reshape(n, num_groups, 1, 1)
    rstd4 = rstd.to(acc).reshape(n, num_groups, 1, 1)
    w3 = weight.to(acc).view(num_groups, cg, 1) if weight is not None else None
    b3 = bias.to(acc).view(num_groups, cg, 1) if bias is not None else None
    dx = torch.empty_like(x) if need_x else None
    dw = torch.empty(num_groups, cg, dtype=acc, device=x.device) if need_w and weight is not None else None
    db = torch.empty(num_groups, cg, dtype=acc, device=x.device) if need_b and bias is not None else None
    for g0, g1 in group_chunks(num_groups, chunks, x.numel(), min_chunk_elements):
        c0, c1 = g0 * cg, g1 * cg
        # (n, groups, cg, S): views for NCDHW and channels-last; chunk-sized copies for odd strides
        xc = x[:, c0:c1].reshape(n, g1 - g0, cg, -1)
        gc = grad[:, c0:c1].reshape(n, g1 - g0, cg, -1)
        wc = w3[g0:g1] if w3 is not None else None
        rs = rstd4[:, g0:g1]
        xhat = (xc - mean4[:, g0:g1]).mul_(rs)  # type promotion makes a fresh acc-dtype tensor
        if silu:
            if wc is not None and b3 is not None:
                y = torch.addcmul(b3[g0:g1], xhat, wc)
            else:
                y = xhat * wc if wc is not None else xhat.clone()
                if b3 is not None:
                    y.add_(b3[g0:g1])
            s = torch.sigmoid(y)
            gy = y.addcmul_(y, s, value=-1).add_(1).mul_(s).mul_(gc)  # g * s * (1 + y * (1 - s))
            del s, y
        else:
            gy = gc.to(acc, copy=True)
        a = gy.sum(3)  # A: (n, groups, cg)
        if db is not None:
            db[g0:g1] = a.sum(0)
        if dw is not None or need_x:
            bsum = (gy * xhat).sum(3)  # B
            if dw is not None:
                dw[g0:g1] = bsum.sum(0)
        if need_x:
            if wc is not None:
                a, bsum = a * wc[..., 0], bsum * wc[..., 0]
                gy.mul_(wc)  # gxhat
            m = cg * xc.shape[3]
            mean_gxhat = (a.sum(2) / m)[..., None, None]
            mean_gxhat_xhat = (bsum.sum(2) / m)[..., None, None]
            gy.sub_(mean_gxhat).sub_(xhat.mul_(mean_gxhat_xhat)).mul_(rs)
            dx[:, c0:c1].copy_(gy.reshape(n, c1 - c0, *spatial))
        del xhat, gy  # free this slice before the next one is allocated
    return (dx,
            dw.view(c).to(weight.dtype) if dw is not None else None,
            db.view(c).to(bias.dtype) if db is not None else None)


class _GroupNormActFn(torch.autograd.Function):
    """``act(GroupNorm32(x))``: a pluggable forward kernel, the lean closed-form backward.

    Saves x (its own dtype), weight, bias and the (N, G) mean / rstd: no float32 copy of x.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                num_groups: int, eps: float, silu: bool, kernel: str | ForwardKernel,
                chunks: int, min_chunk_elements: int) -> torch.Tensor:
        run = FORWARD_KERNELS[kernel] if isinstance(kernel, str) else kernel
        y, mean, rstd = run(x, num_groups, weight, bias, eps, silu)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.config = (num_groups, silu, chunks, min_chunk_elements)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, bias, mean, rstd = ctx.saved_tensors
        num_groups, silu, chunks, min_chunk_elements = ctx.config
        grads = group_norm_act_backward(grad, x, weight, bias, mean, rstd, num_groups, silu,
                                        ctx.needs_input_grad[:3], chunks, min_chunk_elements)
        return (*grads, None, None, None, None, None, None)


def group_norm_act_lean(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None,
                        bias: torch.Tensor | None, eps: float, silu: bool,
                        kernel: str | ForwardKernel = "triton", chunks: int = BACKWARD_CHUNKS,
                        min_chunk_elements: int = MIN_CHUNK_ELEMENTS) -> torch.Tensor:
    """``act(GroupNorm32(x))`` through ``_GroupNormActFn``.

    Args:
        kernel: ``"triton"``, ``"torch"`` (keys of ``FORWARD_KERNELS``) or a callable with
            :func:`forward_stats_torch`'s signature returning ``(y, mean, rstd)``.
        chunks, min_chunk_elements: the backward processes ceil(num_groups / chunks) groups at a
            time, in fewer slices when those would hold under ``min_chunk_elements`` elements
            (``min_chunk_elements=0``: always ``chunks`` slices, as the tests use).
    """
    if x.shape[1] % num_groups:
        raise ValueError(f"GroupNorm: {x.shape[1]} channels not divisible by {num_groups} groups")
    return _GroupNormActFn.apply(x, weight, bias, num_groups, eps, silu, kernel, chunks, min_chunk_elements)


class FusedGroupNormAct(nn.GroupNorm):
    """``act(GroupNorm32(x))`` in one op; same parameters (and keys) as the GroupNorm it replaces.

    Args:
        num_groups, num_channels, eps, affine: as ``nn.GroupNorm``.
        act: ``"silu"`` or ``None``.
        impl: ``"auto"``, ``"triton"`` or ``"torch"`` (see the module docstring).
        ndhwc_backward: the torch form's backward on channels-last inputs, ``"autograd"`` or
            ``"closed_form"`` (:mod:`optim.groupnorm_ndhwc`).
    """

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 act: str | None = "silu", impl: str = "auto", ndhwc_backward: str = "autograd",
                 **factory: Any) -> None:
        if act not in ACTS:
            raise RecipeConflictError(f"FusedGroupNormAct: act must be in {ACTS}, got act={act!r}")
        check_impl(impl, ndhwc_backward)
        super().__init__(num_groups, num_channels, eps, affine, **factory)
        self.act, self.impl, self.ndhwc_backward = act, impl, ndhwc_backward
        # resolved here, once: a cached function called inside forward makes Dynamo warn when it traces it
        self.triton = impl != "torch" and triton_available()

    @classmethod
    def from_groupnorm(cls, norm: nn.GroupNorm, act: str | None, impl: str,
                       ndhwc_backward: str = "autograd") -> FusedGroupNormAct:
        """Wrap an existing GroupNorm, sharing its Parameters (so an optimiser keeps working)."""
        fused = cls(norm.num_groups, norm.num_channels, norm.eps, affine=False, act=act, impl=impl,
                    ndhwc_backward=ndhwc_backward)
        fused.affine, fused.weight, fused.bias = norm.affine, norm.weight, norm.bias
        return fused

    def resolved_impl(self, x: torch.Tensor) -> str:
        """``impl``, with ``auto`` resolved for ``x``: Triton for CUDA tensors when installed and not compiling."""
        if self.impl != "auto":
            return self.impl
        return "triton" if self.triton and x.is_cuda and not torch.compiler.is_compiling() else "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        silu = self.act == "silu"
        if self.resolved_impl(x) == "triton":
            return group_norm_act_lean(x, self.num_groups, self.weight, self.bias, self.eps, silu, "triton")
        return group_norm_act_torch(x, self.num_groups, self.weight, self.bias, self.eps, silu, self.ndhwc_backward)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, act={self.act}, impl={self.impl}, ndhwc_backward={self.ndhwc_backward}"


def _is_plain_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.GroupNorm) and not isinstance(module, FusedGroupNormAct)


def fuse_groupnorm(model: nn.Module, impl: str = "auto", ndhwc_backward: str = "autograd") -> dict[str, int]:
    """Functional twin: rewrite every GroupNorm (+ following SiLU) in place; returns counts."""
    check_impl(impl, ndhwc_backward)
    counts = {"fused_silu": 0, "plain": 0}
    for seq in [m for m in model.modules() if isinstance(m, nn.Sequential)]:
        for i in range(len(seq) - 1):
            if _is_plain_norm(seq[i]) and isinstance(seq[i + 1], nn.SiLU):
                seq[i] = FusedGroupNormAct.from_groupnorm(seq[i], "silu", impl, ndhwc_backward)
                seq[i + 1] = nn.Identity()
                counts["fused_silu"] += 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_plain_norm(child):
                setattr(parent, name, FusedGroupNormAct.from_groupnorm(child, None, impl, ndhwc_backward))
                counts["plain"] += 1
    return counts


class FusedGroupNorm(Recipe):
    """GroupNorm32 + SiLU fused (Triton on CUDA, torch form elsewhere); fp32 statistics."""

    name = "fused_groupnorm"

    def __init__(self, impl: str = "auto", ndhwc_backward: str = "autograd") -> None:
        check_impl(impl, ndhwc_backward)
        self.impl, self.ndhwc_backward = impl, ndhwc_backward
        self.counts: dict[str, int] = {}
        # The closed form reads five buffers; at inductor's default realize_reads_threshold (4) inductor writes
        # its recomputed pre-activation out in float32, at 6 it stays inline (tests/optim/test_groupnorm_ndhwc.py).
        inductor = {"realize_reads_threshold": 6} if ndhwc_backward == "closed_form" else {}
        self.capabilities = Capabilities(
            exact=False, tolerance={"rtol": 1e-5, "atol": 1e-6}, stage=10, inductor=inductor,
            devices=("cuda",) if impl == "triton" else None, modules=("triton",) if impl == "triton" else (),
            requirement="fused_groupnorm impl=triton",
            fix="use impl=auto (Triton on CUDA when installed, the torch form elsewhere)")

    def prepare_model(self, model: nn.Module) -> nn.Module:
        self.counts = fuse_groupnorm(model, self.impl, self.ndhwc_backward)
        return model

    def options(self) -> dict[str, Any]:
        return {"impl": self.impl, "ndhwc_backward": self.ndhwc_backward}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "replaced": self.counts, "triton_available": triton_available()}
