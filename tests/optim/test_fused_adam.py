"""fused_adam: the loop's Adam gets ``fused=True`` through the stack, and nowhere else changes;
``guard=device`` skips a non-finite step inside the fused kernel exactly as the host guard skips it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import LR, TINY, tiny_batch, tiny_unet

from optim import (
    Amp,
    DeviceInfo,
    FusedAdam,
    Recipe,
    RecipeConflictError,
    RecipeStack,
    fused_adam_options,
    skip_update_if_non_finite,
)


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
    with pytest.raises(RecipeConflictError, match="recipes 'foreach_adam' and 'fused_adam' cannot be combined: they set Adam's fused to False and True"):
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


class _PointwiseNet(torch.nn.Module):
    """Two linear layers over the channels: on CUDA its cuBLAS kernels are run-to-run deterministic, which
    the tiny UNet is not (two host-guard runs of it differ by 2e-3 after 5 steps on an H200, with cuDNN's
    deterministic mode too; presumably atomics in a backward kernel, not traced to one)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(TINY["in_channels"], 32), torch.nn.SiLU(),
                                       torch.nn.Linear(32, TINY["out_channels"]))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(x.movedim(1, -1)).movedim(-1, 1)


NETS = {"cpu": tiny_unet, "cuda": _PointwiseNet}


class _GuardedRecipe(Recipe):
    """A second recipe with a guard of its own (none ships today), to check that two are refused."""

    name = "guarded"

    def loss_guard(self) -> object:
        return object()


def _guarded_run(guard: str, bad_steps: set[int], steps: int = 4,
                 device: str = "cpu") -> tuple[torch.nn.Module, dict, int]:
    """``steps`` L1 + fused-Adam steps of the device's net through the stack's guard, NaN inputs at
    ``bad_steps``; the loop as med_ddpm.train runs it (backward and step only when the guard says so)."""
    stack, model = RecipeStack([FusedAdam(guard=guard)]), NETS[device]().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=LR, **stack.optimizer_options())
    x, t, target = tiny_batch(device=device)
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = F.l1_loss(model(x * float("nan") if i in bad_steps else x, t), target)
        if stack.finite_or_skip(loss, opt):
            loss.backward()
            opt.step()
    return model, opt.state_dict(), stack.guard.skipped


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_device_guard_skips_exactly_as_the_host_guard(device: str) -> None:
    """Steps 1 and 2 of 5 non-finite: the host guard skips backward and Adam; the device guard runs both and
    fused Adam leaves weights, moments and the step count alone. The two runs end bit-identical."""
    host, host_state, host_skipped = _guarded_run("host", {1, 2}, steps=5, device=device)
    again = _guarded_run("host", {1, 2}, steps=5, device=device)[0]  # the net itself is deterministic
    assert all(torch.equal(p, q) for p, q in zip(host.parameters(), again.parameters(), strict=True))
    device_run, device_state, device_skipped = _guarded_run("device", {1, 2}, steps=5, device=device)
    assert host_skipped == device_skipped == 2
    for p, q in zip(host.parameters(), device_run.parameters(), strict=True):
        assert torch.equal(p, q)
    for a, b in zip(host_state["state"].values(), device_state["state"].values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert float(device_state["state"][0]["step"]) == 3
    clean, _, _ = _guarded_run("device", set(), steps=5, device=device)  # the skips did change something
    assert not all(torch.equal(p, q) for p, q in zip(clean.parameters(), device_run.parameters(), strict=True))


def test_device_guard_ors_micro_batches_and_disarms_after_the_step() -> None:
    """Gradient accumulation: one non-finite micro-batch skips the step; the post-step hook disarms the flag."""
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([param], lr=0.1, fused=True)
    skip_update_if_non_finite(opt, torch.tensor(float("inf")))
    assert float(skip_update_if_non_finite(opt, torch.tensor(1.0))) == 1.0
    stack = RecipeStack([FusedAdam(guard="device")])
    assert stack.finite_or_skip(torch.tensor(float("nan")), opt) and stack.finite_or_skip(torch.tensor(2.0), opt)
    param.grad = torch.ones(3)
    opt.step()
    assert torch.equal(param, torch.ones(3)) and not hasattr(opt, "found_inf") and stack.guard.skipped == 1
    assert stack.finite_or_skip(torch.tensor(2.0), opt)
    opt.step()
    assert not torch.equal(param, torch.ones(3)) and stack.guard.skipped == 1
    stack.guard.skipped = 5  # resume restores a checkpoint's count
    stack.finite_or_skip(torch.tensor(float("nan")), opt)
    opt.step()
    assert stack.guard.skipped == 6


def test_device_guard_refusals_are_named() -> None:
    stack = RecipeStack([FusedAdam(guard="device")])
    with pytest.raises(ValueError, match="needs the loop's fused Adam"):
        stack.finite_or_skip(torch.tensor(1.0))
    with pytest.raises(ValueError, match="needs the loop's fused Adam"):
        stack.finite_or_skip(torch.tensor(1.0), torch.optim.Adam([torch.nn.Parameter(torch.ones(1))]))
    with pytest.raises(RecipeConflictError, match="recipes 'fused_adam' and 'amp_fp16' cannot be combined: the loss "
                                                  "scaler sets fused Adam's found_inf"):
        RecipeStack([FusedAdam(guard="device"), Amp("float16")])
    RecipeStack([FusedAdam(guard="device"), Amp("bfloat16")])
    with pytest.raises(RecipeConflictError, match="each brings its own non-finite-loss guard"):
        RecipeStack([FusedAdam(guard="device"), _GuardedRecipe()])
    with pytest.raises(RecipeConflictError, match="guard must be one of"):
        FusedAdam(guard="gpu")
    assert FusedAdam().describe()["guard"] == "host"
