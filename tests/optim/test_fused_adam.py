"""fused_adam: the loop's Adam gets ``fused=True`` through the stack, and nowhere else changes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import LR, tiny_unet

from optim import DeviceInfo, FusedAdam, Recipe, RecipeConflictError, RecipeStack, fused_adam_options


class _ForeachAdam(Recipe):
    name = "foreach_adam"

    def optimizer_options(self) -> dict[str, Any]:
        return {"fused": False, "foreach": True}


def test_stack_passes_the_fused_kernel_to_adam_and_refuses_a_contradiction() -> None:
    assert RecipeStack([]).optimizer_options() == {}
    stack = RecipeStack([FusedAdam()])
    assert stack.optimizer_options() == fused_adam_options() == {"fused": True}
    assert stack.describe()["optimizer_options"] == {"fused": True}
    opt = torch.optim.Adam(tiny_unet().parameters(), lr=LR, **stack.optimizer_options())
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    with pytest.raises(RecipeConflictError, match="_ForeachAdam.*FusedAdam.*fused to False and True"):
        RecipeStack([FusedAdam(), _ForeachAdam()]).optimizer_options()


def test_fused_update_follows_foreach_over_many_steps() -> None:
    """Twenty steps of the tiny UNet's weights under the same gradients: the fused kernel computes
    Adam's formula, so the two trajectories stay within float32 rounding of each other."""
    models = [tiny_unet(), tiny_unet()]
    opts = [torch.optim.Adam(models[0].parameters(), lr=LR, foreach=True),
            torch.optim.Adam(models[1].parameters(), lr=LR, fused=True)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        for p, q in zip(*(m.parameters() for m in models), strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        for opt in opts:
            opt.step()
    moved = max((p - q).abs().max().item() for p, q in zip(*(m.parameters() for m in models), strict=True))
    assert 0 < moved < 1e-6, moved  # not bit-identical (another evaluation order), but float32-close (3e-8 here)


def test_unsupported_device_type_is_named() -> None:
    ok, reason = FusedAdam().supported(DeviceInfo("mps"))
    assert not ok and "mps" in reason
    assert FusedAdam().supported(DeviceInfo("cuda", (7, 0), "Tesla V100"))[0]
