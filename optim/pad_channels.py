"""Narrow 3-D convolutions computed with their output channels zero-padded to a multiple of 8.

Med-DDPM ends with a full-resolution convolution to very few channels: 64 -> 1 for the whole-head
network (the ε of one image channel), 64 -> 4 for BraTS. cuDNN's bf16 NDHWC kernels work in
channel multiples of 8, so with one output channel it picks a slow kernel and converts layouts
around it: in the H200 profile of the channels-last compiled forward, the output convolution
launches a 0.25 ms ``nchwToNhwc`` conversion, and ``bench.micro`` times the convolution at
1.15 ms as it is against 0.82 ms with its weight padded to 8 output channels (128³, bf16,
bench/results/h200/tuning/). In training, that convolution's weight gradient (1.75 ms in the
NCDHW compiled train-step profile) may gain too. Neither has been measured inside the network yet.

The recipe replaces such a convolution's forward (the module, its Parameters and its state-dict
keys are unchanged): weight and bias are zero-padded along the output-channel axis, the
convolution runs, and the real channels are sliced out and made dense in the convolution's output
layout. The padded channels are exact zeros times the input and are thrown away, so each real
channel is the same sum; only cuDNN's choice of algorithm (and so its summation order) can differ.

Example:
    >>> pad_conv_out_channels(model)           # Med-DDPM: the output convolution
    ['out.2']
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from optim.base import Recipe, RecipeConflictError
from optim.channels_last import is_channels_last_3d
from optim.forward_override import override_forward

MULTIPLE = 8  # cuDNN's NDHWC channel granule for 16-bit types (16 bytes)


def check_multiple(multiple: int) -> None:
    """The one validation of ``multiple``, shared by the recipe and its functional twin."""
    if not isinstance(multiple, int) or multiple < 2:
        raise RecipeConflictError(f"pad_conv_channels multiple must be an integer >= 2, got {multiple!r}")


def pad_dim(t: torch.Tensor, dim: int, multiple: int = MULTIPLE) -> torch.Tensor:
    """``t`` zero-padded at the end of ``dim`` to a multiple of ``multiple``; an NDHWC 5-D tensor stays NDHWC."""
    extra = -t.shape[dim] % multiple
    if not extra:
        return t
    padded = F.pad(t, [0, 0] * (t.dim() - dim - 1) + [0, extra])
    return padded.contiguous(memory_format=torch.channels_last_3d) if is_channels_last_3d(t) else padded


def padded_conv_forward(x: torch.Tensor, conv: nn.Conv3d, multiple: int) -> torch.Tensor:
    """``conv(x)`` computed with ``multiple``-padded output channels, real channels returned dense."""
    bias = pad_dim(conv.bias, 0, multiple) if conv.bias is not None else None
    return first_channels(conv._conv_forward(x, pad_dim(conv.weight, 0, multiple), bias), conv.out_channels)


def first_channels(y: torch.Tensor, n: int) -> torch.Tensor:
    """``y[:, :n]`` made dense in y's layout order (in NDHWC the slice takes every C-th element)."""
    return torch.clone(y[:, :n], memory_format=torch.preserve_format)


def _padded(original: Any, conv: nn.Conv3d, multiple: int) -> Any:
    """The override factory (deep-copyable: ``conv`` is rebound to the copy by deepcopy's memo)."""
    return functools.partial(padded_conv_forward, conv=conv, multiple=multiple)


def pad_conv_out_channels(model: nn.Module, multiple: int = MULTIPLE) -> list[str]:
    """Functional twin: pad every ungrouped ``Conv3d`` whose output channels are not a multiple of
    ``multiple``; returns the padded modules' names (state-dict keys unchanged)."""
    check_multiple(multiple)
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv3d) and module.groups == 1 and module.out_channels % multiple:
            override_forward(module, functools.partial(_padded, conv=module, multiple=multiple))
            names.append(name)
    return names


class PadConvChannels(Recipe):
    """Compute narrow 3-D convolutions (Med-DDPM's output conv) with 8-aligned output channels."""

    name = "pad_conv_channels"
    exact = False
    tolerance = {"rtol": 1e-5, "atol": 1e-6}
    stage = 10

    def __init__(self, multiple: int = MULTIPLE) -> None:
        check_multiple(multiple)
        self.multiple = multiple
        self.padded: list[str] = []

    def prepare_model(self, model: nn.Module) -> nn.Module:
        self.padded = pad_conv_out_channels(model, self.multiple)
        return model

    def options(self) -> dict[str, Any]:
        return {"multiple": self.multiple}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "padded_convs": self.padded}
