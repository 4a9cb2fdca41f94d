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

The recipe reaches the loop through one hook, :meth:`optim.Recipe.optimizer_options`: the loop
builds ``torch.optim.Adam(params, lr=..., **stack.optimizer_options())``. Nothing else changes:
the forward, the loss and the gradients are those of the baseline; the update differs from
``foreach`` only in float32 rounding (the same formula, evaluated in another order).

Example:
    >>> opt = torch.optim.Adam(model.parameters(), lr=1e-5, **fused_adam_options())
"""

from __future__ import annotations

from typing import Any

from optim.base import DeviceInfo, Recipe


def fused_adam_options() -> dict[str, Any]:
    """Functional twin: the ``torch.optim.Adam`` keyword arguments that select the fused kernel."""
    return {"fused": True}


class FusedAdam(Recipe):
    """``torch.optim.Adam(..., fused=True)``: the whole update in one kernel (CUDA, and CPU since torch 2.4)."""

    name = "fused_adam"
    exact = False
    tolerance = {"rtol": 1e-6, "atol": 1e-9}
    stage = 70  # touches no model: the optimiser is built after every model recipe

    def optimizer_options(self) -> dict[str, Any]:
        return fused_adam_options()

    def supported(self, device: DeviceInfo | Any) -> tuple[bool, str]:
        """Fused Adam has CUDA and CPU kernels (float16/bfloat16/float32/float64 parameters)."""
        info = DeviceInfo.of(device)
        if info.type in ("cuda", "cpu"):
            return True, ""
        return False, f"fused Adam has no kernel for device type {info.type!r} (CUDA and CPU only)"
