"""Attention through ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels).

The reference :class:`optim.attention.AttentionCore` materialises the (T x T) weight matrix:
at 16³ tokens (the 128³ model's attention level) that is 4096² per head, written and read
twice. SDPA's flash and memory-efficient kernels never materialise it.

Layout: Med-DDPM's q, k, v are transposes of the qkv convolution's (B, 3C, T) output, so their
channel axis has stride T. Flash, memory-efficient and cuDNN attention need stride 1 there; without
a copy PyTorch falls back to the math kernel, which upcasts bf16 to float32 (a float32 SIMT GEMM of
the logits in the H200 profile bench/results/h200/tuning/profile_channels_last_compiled_d08bb6f/).
``forward`` copies each to stride 1 first (three 4096 x 192 copies).

Equivalence: the reference scales q and k each by ch^(-1/4), i.e. the logits by 1/√ch, which
is SDPA's ``scale``; the reference softmax runs in fp32, and flash/mem-efficient kernels also
accumulate the softmax in fp32 (online softmax), so the results agree to rounding.

Example:
    >>> use_sdpa_attention(model, backends=("flash", "efficient"))
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from optim.attention import AttentionCore
from optim.base import Capabilities, Recipe, RecipeConflictError

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def _resolve(backends: tuple[str, ...] | list[str] | None) -> list[SDPBackend] | None:
    """The one validation of ``backends`` (recipe, functional twin and core): names -> SDPBackends."""
    if not backends:
        return None
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise RecipeConflictError(f"unknown SDPA backend(s) {unknown}; choose from {sorted(BACKENDS)}")
    return [BACKENDS[b] for b in backends]


class SdpaAttentionCore(AttentionCore):
    """Drop-in :class:`AttentionCore` computing softmax(q kᵀ / √ch) v with SDPA.

    Args:
        backends: SDPA backends to allow, by name (``None``: PyTorch's own choice).
    """

    def __init__(self, backends: tuple[str, ...] | list[str] | None = None) -> None:
        super().__init__()
        self.backends = tuple(backends) if backends else None
        self._kernels = _resolve(self.backends)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5  # = (ch^-1/4)^2 of the reference
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        context = sdpa_kernel(self._kernels) if self._kernels else contextlib.nullcontext()
        with context:
            return F.scaled_dot_product_attention(q, k, v, scale=scale)

    def extra_repr(self) -> str:
        return f"backends={self.backends}"


def use_sdpa_attention(model: nn.Module, backends: tuple[str, ...] | list[str] | None = None) -> int:
    """Functional twin: swap every reference ``AttentionCore`` in ``model``; returns how many.

    Parameter-free, so state-dict keys are unchanged.
    """
    _resolve(backends)
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is AttentionCore:
                setattr(parent, name, SdpaAttentionCore(backends))
                swapped += 1
    return swapped


class SdpaAttention(Recipe):
    """Replace the reference attention product with ``scaled_dot_product_attention``."""

    name = "sdpa_attention"
    capabilities = Capabilities(exact=False, tolerance={"rtol": 1e-5, "atol": 1e-6}, stage=10)

    def __init__(self, backends: list[str] | None = None) -> None:
        self.backends = list(backends) if backends else None
        _resolve(self.backends)
        self.swapped = 0

    def prepare_model(self, model: nn.Module) -> nn.Module:
        self.swapped = use_sdpa_attention(model, self.backends)
        return model

    def options(self) -> dict[str, Any]:
        return {"backends": self.backends}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "swapped_modules": self.swapped}
