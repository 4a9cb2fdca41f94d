"""Give every convolution's backward its output gradient dense in the layout the kernel wants.

cuDNN's convolution backward needs ``grad_output`` dense in the convolution's memory format; when
it is not, ``aten::cudnn_convolution_backward`` copies it first (``grad_output.contiguous(fmt)``),
inside the extern call, where inductor cannot fuse that copy with anything. In Med-DDPM's training
step two kinds of gradients arrive strided:

* the decoder concatenates the upsampled features with the encoder's skip, ``cat([h, skip], 1)``;
  the gradient of ``h`` is the channel slice ``g[:, :C_h]`` of the concatenation's gradient, which
  in NDHWC is C_h of every C channels (not dense), and it flows straight into the convolutions
  that produced ``h`` (the previous block's last convolution and its skip projection, or the
  upsampling's convolution);
* the attention block's 1-D q/k/v and output convolutions see (B, C, T) views of NDHWC tensors.

The H200 profiles of the channels-last train step (``bench/results/h200/tuning/``) show such
gradients in about a third of its ``convolution_backward`` calls, each copied before the kernel.

This recipe registers a forward hook on every ``nn.Conv1d``/``nn.Conv3d`` that passes the output
through :class:`DenseGrad`: the identity in the forward, and in the backward
``g.contiguous(memory_format=fmt)``, with ``fmt`` the layout the convolution's backward asks for
(:func:`conv_memory_format`: channels_last_3d when the input or the weight is NDHWC). Eagerly this is the same copy
in another place. Under ``torch.compile`` the copy is part of the AOT backward graph, so inductor
can write the dense gradient directly from the kernel that produces it (for the concatenation,
the two halves of the GroupNorm backward's output) instead of writing the strided tensor and
copying it afterwards. Values are unchanged: a copy is exact.

Example:
    >>> use_dense_conv_grads(model)      # Med-DDPM whole-head: every Conv3d and the attention Conv1ds
    ['input_blocks.0.0', ...]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from optim.base import Capabilities, Recipe
from optim.channels_last import is_only_channels_last_3d

CONVS = (nn.Conv1d, nn.Conv3d)


class DenseGrad(torch.autograd.Function):
    """Identity forward; the backward returns the incoming gradient dense in ``memory_format``."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
        ctx.memory_format = memory_format
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.contiguous(memory_format=ctx.memory_format), None


def conv_memory_format(x: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    """The layout a convolution's backward wants its gradients in: channels_last_3d when its input or
    its weight is stored NDHWC (``cudnn_conv_suggest_memory_format``'s rule), else contiguous."""
    if x.dim() == 5 and (is_only_channels_last_3d(x) or is_only_channels_last_3d(weight)):
        return torch.channels_last_3d
    return torch.contiguous_format


def _dense_grad_hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    return DenseGrad.apply(output, conv_memory_format(args[0], module.weight))


def use_dense_conv_grads(model: nn.Module) -> list[str]:
    """Functional twin: hook every ``Conv1d``/``Conv3d``; returns the hooked modules' names.

    The hook is a module-level function, so ``copy.deepcopy`` (an EMA copy) keeps it. Modules that
    already carry it are skipped, so applying the twin twice hooks nothing twice.
    """
    names = []
    for name, module in model.named_modules():
        if isinstance(module, CONVS) and _dense_grad_hook not in module._forward_hooks.values():
            module.register_forward_hook(_dense_grad_hook)
            names.append(name)
    return names


class DenseConvGrads(Recipe):
    """Convolution backward gets dense output gradients (the copy moves into the compiled graph)."""

    name = "dense_conv_grads"
    capabilities = Capabilities(stage=10)

    def __init__(self) -> None:
        self.hooked: list[str] = []

    def prepare_model(self, model: nn.Module) -> nn.Module:
        self.hooked = use_dense_conv_grads(model)
        return model

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "hooked_convs": len(self.hooked)}
