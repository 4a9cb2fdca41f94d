"""The attention kernel protocol shared by the model and the attention recipes.

The U-Net's attention block owns the projections (qkv, proj_out) and delegates the
softmax(q kᵀ / √d) v product to an :class:`AttentionCore` submodule. Recipes swap that
submodule (e.g. for a ``scaled_dot_product_attention`` one) by ``isinstance`` without
knowing anything else about the model, which keeps ``optim`` independent of ``med_ddpm``.

Example:
    >>> core = AttentionCore()
    >>> q = k = v = torch.randn(2, 1, 64, 32)   # (B, heads, T, ch)
    >>> core(q, k, v).shape
    torch.Size([2, 1, 64, 32])
"""

from __future__ import annotations

import torch
from torch import nn


class AttentionCore(nn.Module):
    """Med-DDPM's reference attention product (guided-diffusion ``QKVAttentionLegacy``).

    q and k are each scaled by ch^(-1/4) before the product (more stable in fp16 than one
    1/√ch on the logits), the softmax runs in float32 and is cast back, as in the original.
    Inputs and output are (B, heads, T, ch).
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scale = q.shape[-1] ** -0.25
        weight = (q * scale) @ (k * scale).transpose(-1, -2)  # (B, h, T, T)
        weight = torch.softmax(weight.float(), dim=-1).type(weight.dtype)
        return weight @ v
