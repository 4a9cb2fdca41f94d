"""GroupNorm + SiLU fused into one module, with a batch-1-friendly Triton kernel on CUDA.

Med-DDPM normalises with ``GroupNorm32`` (statistics in float32, cast back) and almost always
follows it with SiLU: ``Sequential(GroupNorm32, SiLU, ...)``. At batch 1 PyTorch's GroupNorm
statistics kernel runs only N x G = 32 blocks and dominates the step (issue 8's profile: ~46 %
of GPU time in bf16). This recipe rewrites the model generically:

* in every ``nn.Sequential``, a (``nn.GroupNorm`` subclass, ``nn.SiLU``) pair becomes
  (``FusedGroupNormAct(act="silu")``, ``nn.Identity()``) at the same indices;
* any other ``nn.GroupNorm`` becomes ``FusedGroupNormAct(act=None)``.

``FusedGroupNormAct`` *is* an ``nn.GroupNorm`` holding the same ``weight``/``bias`` Parameters,
so state-dict keys and the optimiser's parameters are unchanged.

Implementations (``impl``):

* ``"triton"``: :mod:`optim.triton_groupnorm` (split-reduction Welford statistics, then one
  normalise + affine + SiLU + cast pass, NCDHW and channels-last-3D without copies). Backward is
  a torch recomputation (composite ops under autograd), so training works.
* ``"torch"``: ``silu(group_norm(x.float()).type(x.dtype))``: bit-identical to the reference,
  and a form ``torch.compile`` fuses (inductor splits large reductions itself).
* ``"auto"``: Triton for CUDA tensors when triton imports and we are not being compiled,
  otherwise torch.

Example:
    >>> fuse_groupnorm(model, impl="auto")
    {'fused_silu': 17, 'plain': 2}
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from optim.base import Recipe, RecipeConflictError

IMPLS = ("auto", "triton", "torch")
ACTS = (None, "silu")


@functools.cache
def triton_available() -> bool:
    """Whether :mod:`optim.triton_groupnorm` imports (triton installed; CPU wheels have none)."""
    try:
        import optim.triton_groupnorm  # noqa: F401
    except ImportError:
        return False
    return True


def group_norm_act_torch(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None,
                         bias: torch.Tensor | None, eps: float, silu: bool) -> torch.Tensor:
    """Reference maths: GroupNorm32 (fp32 statistics, cast back to x's dtype), then SiLU."""
    y = F.group_norm(x.float(), num_groups, weight, bias, eps).type(x.dtype)
    return F.silu(y) if silu else y


class _TritonGroupNormAct(torch.autograd.Function):
    """Triton forward; backward recomputes the torch form and differentiates it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                num_groups: int, eps: float, silu: bool) -> torch.Tensor:
        from optim.triton_groupnorm import group_norm_act_triton

        ctx.save_for_backward(x, weight, bias)
        ctx.config = (num_groups, eps, silu)
        return group_norm_act_triton(x, num_groups, weight, bias, eps, silu, x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(n) if t is not None else None for t, n in zip(saved, needs)]
            y = group_norm_act_torch(*leaves[:1], ctx.config[0], *leaves[1:], *ctx.config[1:])
            wanted = [t for t, n in zip(leaves, needs) if n]
            grads = iter(torch.autograd.grad(y, wanted, grad))
        return (*(next(grads) if n else None for n in needs), None, None, None)


class FusedGroupNormAct(nn.GroupNorm):
    """``act(GroupNorm32(x))`` in one op; same parameters (and keys) as the GroupNorm it replaces.

    Args:
        num_groups, num_channels, eps, affine: as ``nn.GroupNorm``.
        act: ``"silu"`` or ``None``.
        impl: ``"auto"``, ``"triton"`` or ``"torch"`` (see the module docstring).
    """

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 act: str | None = "silu", impl: str = "auto", **factory: Any) -> None:
        if act not in ACTS or impl not in IMPLS:
            raise RecipeConflictError(f"FusedGroupNormAct: act must be in {ACTS} and impl in {IMPLS}, "
                                      f"got act={act!r}, impl={impl!r}")
        super().__init__(num_groups, num_channels, eps, affine, **factory)
        self.act, self.impl = act, impl

    @classmethod
    def from_groupnorm(cls, norm: nn.GroupNorm, act: str | None, impl: str) -> FusedGroupNormAct:
        """Wrap an existing GroupNorm, sharing its Parameters (so an optimiser keeps working)."""
        fused = cls(norm.num_groups, norm.num_channels, norm.eps, affine=False, act=act, impl=impl)
        fused.affine, fused.weight, fused.bias = norm.affine, norm.weight, norm.bias
        return fused

    def resolved_impl(self, x: torch.Tensor) -> str:
        if self.impl != "auto":
            return self.impl
        use_triton = x.is_cuda and triton_available() and not torch.compiler.is_compiling()
        return "triton" if use_triton else "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        silu = self.act == "silu"
        if self.resolved_impl(x) == "triton":
            return _TritonGroupNormAct.apply(x, self.weight, self.bias, self.num_groups, self.eps, silu)
        return group_norm_act_torch(x, self.num_groups, self.weight, self.bias, self.eps, silu)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, act={self.act}, impl={self.impl}"


def _is_plain_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.GroupNorm) and not isinstance(module, FusedGroupNormAct)


def fuse_groupnorm(model: nn.Module, impl: str = "auto") -> dict[str, int]:
    """Functional twin: rewrite every GroupNorm (+ following SiLU) in place; returns counts."""
    if impl not in IMPLS:
        raise RecipeConflictError(f"fused_groupnorm impl must be one of {IMPLS}, got {impl!r}")
    counts = {"fused_silu": 0, "plain": 0}
    for seq in [m for m in model.modules() if isinstance(m, nn.Sequential)]:
        for i in range(len(seq) - 1):
            if _is_plain_norm(seq[i]) and isinstance(seq[i + 1], nn.SiLU):
                seq[i] = FusedGroupNormAct.from_groupnorm(seq[i], "silu", impl)
                seq[i + 1] = nn.Identity()
                counts["fused_silu"] += 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_plain_norm(child):
                setattr(parent, name, FusedGroupNormAct.from_groupnorm(child, None, impl))
                counts["plain"] += 1
    return counts


class FusedGroupNorm(Recipe):
    """GroupNorm32 + SiLU fused (Triton on CUDA, torch form elsewhere); fp32 statistics."""

    name = "fused_groupnorm"
    exact = False
    tolerance = {"rtol": 1e-5, "atol": 1e-6}
    stage = 10

    def __init__(self, impl: str = "auto") -> None:
        if impl not in IMPLS:
            raise RecipeConflictError(f"fused_groupnorm impl must be one of {IMPLS}, got {impl!r}")
        self.impl = impl
        self.counts: dict[str, int] = {}

    def prepare_model(self, model: nn.Module) -> nn.Module:
        self.counts = fuse_groupnorm(model, self.impl)
        return model

    def supported(self, device: Any) -> tuple[bool, str]:
        if self.impl == "triton" and not triton_available():
            return False, "fused_groupnorm impl=triton needs the triton package (not installed here)"
        return True, ""

    def options(self) -> dict[str, Any]:
        return {"impl": self.impl}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "replaced": self.counts, "triton_available": triton_available()}
