"""Activation checkpointing of the U-Net's blocks: recompute activations in backward, keep memory.

Blocks are selected generically by the class attribute ``checkpoint_group`` that the model's
blocks carry (``"attention"``, ``"resblocks"``, ``"upsample"``), so ``optim`` needs no import of
the model. Level ``all`` takes every group, including the decoder's upsampling (trilinear ×2
then a conv, which would otherwise keep the 8×-sized interpolated tensor for its backward).
``use_reentrant=False`` is the variant that saves and restores autocast state for the
recomputation (the original Med-DDPM's hand-written checkpoint drops autocast and crashes
under AMP) and supports keyword arguments and inputs that do not require grad, such as
``ResBlock.forward(x, emb)``. Checkpointing is skipped when autograd is off (sampling).

Example:
    >>> apply_checkpointing(model, "all")    # BraTS 192x192x144 under 16 GiB: configs/experiment/brats.yaml's memory stack
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from optim.base import Capabilities, Recipe, RecipeConflictError
from optim.forward_override import override_forward

LEVELS = {"attention": ("attention",), "resblocks": ("resblocks",),
          "all": ("attention", "resblocks", "upsample")}


def check_level(level: str) -> tuple[str, ...]:
    """The one validation of ``level`` (recipe and functional twin); returns its groups."""
    if level not in LEVELS:
        raise RecipeConflictError(f"checkpointing level must be one of {sorted(LEVELS)}, got {level!r}")
    return LEVELS[level]


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def apply_checkpointing(model: nn.Module, level: str = "all") -> list[str]:
    """Functional twin: checkpoint every block whose ``checkpoint_group`` is in ``level``.

    Returns the names of the wrapped modules (state-dict keys are unchanged).
    """
    groups = check_level(level)
    wrapped = []
    for name, module in model.named_modules():
        if getattr(type(module), "checkpoint_group", None) in groups:
            override_forward(module, _checkpointed)
            wrapped.append(name)
    return wrapped


class Checkpointing(Recipe):
    """Trade compute for memory: recompute the selected blocks' activations during backward.

    Bit-exact: the recomputation runs the same kernels on the same inputs.
    """

    name = "checkpointing"
    capabilities = Capabilities(stage=20)

    def __init__(self, level: str = "all") -> None:
        check_level(level)
        self.level = level
        self.wrapped: list[str] = []

    def prepare_model(self, model: nn.Module) -> nn.Module:
        self.wrapped = apply_checkpointing(model, self.level)
        return model

    def options(self) -> dict[str, Any]:
        return {"level": self.level}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "checkpointed_modules": len(self.wrapped)}
