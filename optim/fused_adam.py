"""Adam's update as one fused kernel per dtype/device group instead of torch's ``foreach`` ops.

``torch.optim.Adam`` on CUDA defaults to the ``foreach`` implementation: each step of the update
(Kingma & Ba 2015, Algorithm 1: m ← β₁m + (1 − β₁)g, v ← β₂v + (1 − β₂)g², θ ← θ − α·m̂ /
(√v̂ + ε)) is its own multi-tensor kernel, so the four float32 state tensors of every parameter
are read and written several times a step. Med-DDPM's whole-head network has 40.2 M parameters in
246 tensors: one pass over θ, g, m and v (read) and θ, m, v (written) is 1.1 GB, about 0.27 ms at
the H200's copy bandwidth, and the foreach update makes several such passes. ``fused=True``
(``torch._fused_adam_``) does the whole update in one pass. In the compiled training step the
optimizer runs eagerly, after the graphed forward and backward, so its kernels add directly to
the step time.

The recipe reaches the loop through :meth:`optim.Recipe.optimizer_options`: the loop builds
``torch.optim.Adam(params, lr=..., **stack.optimizer_options())``. The forward, the loss and the
gradients are those of the baseline; the update differs from ``foreach`` only in float32 rounding
(the same formula, evaluated in another order).

Option ``guard=device`` also replaces the loop's non-finite-loss guard (:meth:`optim.Recipe.loss_guard`).
The default guard reads the loss on the host once a step, so the GPU waits while the host queues
what follows. The fused kernel takes a ``found_inf`` flag, the one fp16's GradScaler sets: when it
is 1 the kernel leaves weights, moments and the step count as they were. The device guard sets
that flag from the loss on the GPU and lets the loop go on, so nothing waits. A skipped step's
backward still runs (its gradients are discarded).

Example:
    >>> opt = torch.optim.Adam(model.parameters(), lr=1e-5, **fused_adam_options())
    >>> skip_update_if_non_finite(opt, loss)  # guard=device's twin: no host sync
    >>> loss.backward(); opt.step(); del opt.found_inf
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from optim.base import Capabilities, Recipe, RecipeConflictError

GUARDS = ("host", "device")


def fused_adam_options() -> dict[str, Any]:
    """Functional twin: the ``torch.optim.Adam`` keyword arguments that select the fused kernel."""
    return {"fused": True}


def skip_update_if_non_finite(optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> torch.Tensor:
    """Functional twin of ``guard=device``: arm fused Adam's ``found_inf`` when ``loss`` is not finite.

    The flag is OR-ed with one this step already armed (gradient accumulation: one bad micro-batch
    skips the step). No host sync. Under DDP pass the loss averaged over ranks, so that every
    rank skips alike. Returns the armed 0-d float32 flag.
    """
    bad = (~torch.isfinite(loss.detach())).any().to(torch.float32)
    armed = getattr(optimizer, "found_inf", None)
    optimizer.found_inf = bad if armed is None else torch.maximum(armed, bad)
    return optimizer.found_inf


class DeviceFiniteGuard:
    """The loop's non-finite guard without a host sync (the guard protocol of :class:`optim.amp.NonFiniteGuard`).

    Each call arms ``found_inf`` and says "go on"; a step post-hook on the optimiser counts the
    step's flag on the device and disarms it, so the next step starts clean.
    """

    def __init__(self) -> None:
        self._count: torch.Tensor | None = None  # this run's skips, on the device
        self._restored = 0  # a resumed run's earlier skips
        self._hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # optimisers with our post-hook

    def __call__(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer | None = None) -> bool:
        if optimizer is None or not optimizer.defaults.get("fused"):
            raise ValueError("fused_adam(guard=device) needs the loop's fused Adam: call "
                             "stack.finite_or_skip(loss, optimizer) with the optimiser built from stack.optimizer_options()")
        if optimizer not in self._hooked:
            optimizer.register_step_post_hook(self._after_step)
            self._hooked.add(optimizer)
        skip_update_if_non_finite(optimizer, loss)
        return True

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        flag = optimizer.__dict__.pop("found_inf", None)
        if flag is not None:
            self._count = flag if self._count is None else self._count + flag

    @property
    def skipped(self) -> int:
        """Steps whose update was skipped so far (reading it syncs: at log time, not every step)."""
        return self._restored + (0 if self._count is None else int(self._count.item()))

    @skipped.setter
    def skipped(self, count: int) -> None:
        """Resume: go on counting from a checkpoint's count."""
        self._restored, self._count = int(count), None


class FusedAdam(Recipe):
    """``torch.optim.Adam(..., fused=True)``: the whole update in one kernel (CUDA, and CPU since torch 2.4)."""

    name = "fused_adam"
    # stage 70: touches no model, the optimiser is built after every model recipe
    capabilities = Capabilities(exact=False, tolerance={"rtol": 1e-6, "atol": 1e-9}, stage=70,
                                devices=("cpu", "cuda"), requirement="fused Adam",
                                fix="drop fused_adam on this device")

    def __init__(self, guard: str = "host") -> None:
        if guard not in GUARDS:
            raise RecipeConflictError(f"fused_adam guard must be one of {GUARDS}, got {guard!r}")
        self.guard = guard

    def optimizer_options(self) -> dict[str, Any]:
        return fused_adam_options()

    def loss_guard(self) -> DeviceFiniteGuard | None:
        return DeviceFiniteGuard() if self.guard == "device" else None

    def options(self) -> dict[str, Any]:
        return {"guard": self.guard}
