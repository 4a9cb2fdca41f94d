"""Replace one module instance's ``forward`` without changing its class or its state-dict keys.

Wrapping a module in another (``torch.compile(model)``, a checkpoint wrapper) prefixes every
state-dict key (``_orig_mod.``, ``module.``), which breaks checkpoints written in the original
Med-DDPM key names. Instead the recipes set an instance attribute ``forward`` that calls the
original bound method through a wrapper: ``nn.Module.__call__`` (hooks included) is unchanged.

The override is deep-copyable: ``copy.deepcopy(model)`` (e.g. an EMA copy made after
``prepare_model``) rebinds the copy's override to the *copied* module and rebuilds the wrapper,
instead of silently calling the live model's forward.

Example:
    >>> override_forward(block, functools.partial(checkpointed, use_reentrant=False))
    >>> block.state_dict().keys()   # unchanged
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from torch import nn

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


class ForwardOverride:
    """Callable stored as ``module.forward``: ``wrap(original_forward)``, rebuilt on deepcopy.

    Attributes:
        original: the forward that was replaced (a bound method or another override).
        wrap: a deep-copyable factory (module-level function or ``functools.partial``).
    """

    def __init__(self, original: Callable[..., Any], wrap: Wrap) -> None:
        self.original = original
        self.wrap = wrap
        self.fn = wrap(original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> ForwardOverride:
        # The owning module is already in ``memo`` (deepcopy registers an object before its
        # state), so deep-copying the bound method rebinds it to the copy.
        return ForwardOverride(copy.deepcopy(self.original, memo), copy.deepcopy(self.wrap, memo))

    def __getstate__(self) -> dict[str, Any]:
        return {"original": self.original, "wrap": self.wrap}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["original"], state["wrap"])


def override_forward(module: nn.Module, wrap: Wrap) -> ForwardOverride:
    """Install ``wrap(module.forward)`` as this instance's forward; returns the override."""
    override = ForwardOverride(module.forward, wrap)
    module.forward = override
    return override


def overrides(module: nn.Module) -> list[ForwardOverride]:
    """The chain of overrides on ``module`` (outermost first); empty when none."""
    chain, forward = [], module.__dict__.get("forward")
    while isinstance(forward, ForwardOverride):
        chain.append(forward)
        forward = forward.original
    return chain
