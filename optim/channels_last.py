"""Channels-last 3-D memory format (NDHWC) for the model and its 5-D inputs, with a layout audit.

cuDNN's fastest 3-D convolutions are NDHWC, but a layout only pays off when it survives
end to end: every op that falls back to NCDHW (GroupNorm has no channels-last-3D kernel,
trilinear upsampling is slow in that layout) adds two copies. The audit records, for one
forward pass, which modules returned a 5-D tensor that is no longer channels-last, so a
benchmark can show *where* the layout is lost instead of only that it got slower.

Example:
    >>> model = to_channels_last_3d(model)
    >>> x = to_channels_last_3d(x)
    >>> is_channels_last_3d(model(x, t))
    True
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

from optim.base import Capabilities, Recipe

T = TypeVar("T", nn.Module, torch.Tensor)


def is_channels_last_3d(x: torch.Tensor) -> bool:
    """Whether a 5-D tensor is dense in NDHWC order (checked from strides, as composer does in 2-D)."""
    return x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d)


def is_only_channels_last_3d(x: torch.Tensor) -> bool:
    """Whether ``x`` is stored NDHWC and not also NCDHW (C = 1, S = 1 or a 1x1x1 kernel are both):
    the tensors for which choosing the channels-last code path changes anything."""
    return is_channels_last_3d(x) and not x.is_contiguous()


def to_channels_last_3d(obj: T) -> T:
    """Functional twin: a module's 5-D parameters/buffers, or a 5-D tensor, to ``channels_last_3d``.

    Tensors that are not 5-D (time steps, 1-D conv weights) are returned unchanged.
    """
    if isinstance(obj, nn.Module):
        return obj.to(memory_format=torch.channels_last_3d)
    return obj.contiguous(memory_format=torch.channels_last_3d) if obj.dim() == 5 else obj


class LayoutAudit:
    """Forward hooks on every leaf module, recording in the first forward the outputs that lost NDHWC.

    After that forward the hooks return at once. They are never removed and do nothing while
    ``torch.compile`` traces them, so a compiled forward's hook dicts stay as traced (no recompile);
    under compile the audit sees no module and reports ``checked_5d_outputs`` 0.
    """

    def __init__(self, model: nn.Module) -> None:
        self.lost: list[dict[str, str]] = []
        self.checked = 0
        self.done = False
        for name, module in model.named_modules():
            if not list(module.children()):
                module.register_forward_hook(self._hook(name))
        model.register_forward_hook(self._finish)

    def _hook(self, name: str):
        def record(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if torch.compiler.is_compiling() or self.done:
                return
            if isinstance(output, torch.Tensor) and output.dim() == 5:
                self.checked += 1
                if not is_channels_last_3d(output):
                    self.lost.append({"module": name, "type": type(module).__name__})
        return record

    def _finish(self, *_: Any) -> None:
        self.done = True

    def report(self) -> dict[str, Any]:
        return {"done": self.done, "checked_5d_outputs": self.checked, "lost_layout": self.lost}


class ChannelsLast3d(Recipe):
    """Model and 5-D inputs in ``torch.channels_last_3d``; optional one-forward layout audit.

    Mathematically equivalent, but different kernels sum in different orders, so it is not
    bit-exact.
    """

    name = "channels_last_3d"
    capabilities = Capabilities(exact=False, tolerance={"rtol": 1e-5, "atol": 1e-6}, stage=30, pays_eagerly=False)

    def __init__(self, audit: bool = True) -> None:
        self.audit = audit
        self._audit: LayoutAudit | None = None

    def prepare_model(self, model: nn.Module) -> nn.Module:
        model = to_channels_last_3d(model)
        if self.audit:
            self._audit = LayoutAudit(model)
        return model

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        return to_channels_last_3d(x)

    def options(self) -> dict[str, Any]:
        return {"audit": self.audit}

    def describe(self) -> dict[str, Any]:
        audit = self._audit.report() if self._audit else None
        return {**super().describe(), "layout_audit": audit}
