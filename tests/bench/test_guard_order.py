"""bench.guard_order on the tiny CPU model: every guard variant timed on one model, one JSON."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from bench import guard_order
from bench.scenarios import READ_LOSS, SCENARIOS
from med_ddpm.diffusion import NoiseSchedule
from optim import DeviceFiniteGuard, FusedAdam, RecipeStack

SMOKE = ["experiment=bench_smoke", "bench=train_step"]


@pytest.mark.parametrize(("stack", "variants"), [("[]", READ_LOSS), ("[fused_adam]", (*READ_LOSS, "on_device"))])
def test_guard_order_times_every_variant_interleaved(tmp_path, stack, variants):
    overrides = [*SMOKE, f"recipe={stack}"]
    guard_order.main(["--out", str(tmp_path), "--blocks", "2", "--iters", "2", "--warmup", "0", *overrides])
    result = json.loads((tmp_path / guard_order.RESULT_FILE).read_text())
    assert list(result["variants"]) == list(variants) and result["overrides"] == overrides
    for timings in result["variants"].values():
        assert len(timings["samples"]) == 4 and len(timings["block_medians_ms"]) == 2
        assert timings["p10"] <= timings["median"] <= timings["p90"]
    assert result["describe"]["skipped_steps"] == 0 and result["env"]["device"] == "cpu"


def test_guard_order_refuses_another_scenario(tmp_path):
    with pytest.raises(SystemExit, match="denoise_step"):
        guard_order.main(["--out", str(tmp_path), "experiment=bench_smoke", "bench=denoise_step"])


class EpsConv(nn.Module):
    """The smallest ε-network: cat[x_t, mask] -> ε, ignoring t."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 1, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


@pytest.mark.parametrize(("read_loss", "guard", "recipes"), [
    ("before_backward", None, []), ("after_backward", None, []), ("before_backward", DeviceFiniteGuard, [FusedAdam()])])
def test_every_guard_skips_a_nan_step_without_touching_the_weights(read_loss, guard, recipes):
    """A NaN input: the host guard (asked before or after backward) skips Adam; the device guard lets fused Adam
    skip its own update. Either way the weights and Adam's state stay as they were."""
    net = EpsConv()
    before = [p.detach().clone() for p in net.parameters()]
    x0, stack = torch.full((1, 1, 4, 4, 4), float("nan")), RecipeStack(recipes)
    check = guard() if guard else None
    step = SCENARIOS["train_step"](net, NoiseSchedule.from_config({"timesteps": 10}), stack, x0,
                                   torch.zeros_like(x0), {"seed": 0, "diffusion": {}}, read_loss, check)
    assert torch.isnan(step())
    assert (check or stack.guard).skipped == 1 and all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_an_unknown_read_loss_is_refused():
    with pytest.raises(ValueError, match="read_loss"):
        SCENARIOS["train_step"](None, None, None, torch.zeros(1), None, {}, "sometime")
