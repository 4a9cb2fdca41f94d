"""Shared helpers for the recipe tests: the tiny real UNet3D and the training loop's own step.

The step is :func:`med_ddpm.train.train_step`, used for the baseline and every recipe alike (no
per-recipe branches): session -> prepare_model -> Adam -> prepare_input -> forward_context(forward
+ L1 ε-loss) -> finite guard -> scaler.scale(loss).backward() -> scaler.step -> update.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.model import UNet3D
from med_ddpm.quality.probe import randomize_zero_init
from med_ddpm.train import train_step as med_ddpm_train_step
from med_ddpm.train_state import TrainState
from optim import RecipeStack

REPO = Path(__file__).resolve().parents[2]
RECIPE_DIR = REPO / "configs" / "recipe"
TINY = dict(in_channels=3, out_channels=1, model_channels=32, channel_mult=(1, 2), num_res_blocks=1,
            attention_ds=(2,), num_heads=1, dropout=0.0)
LR = 1e-3


def stack_of(names: list[str] | tuple[str, ...]) -> RecipeStack:
    """The stack ``recipe=[names]`` composes, from the real recipe configs."""
    return RecipeStack.from_config(OmegaConf.merge(*(OmegaConf.load(RECIPE_DIR / f"{n}.yaml") for n in names)))


@dataclass
class StepResult:
    output: torch.Tensor
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]


def tiny_unet(seed: int = 0, **overrides) -> UNet3D:
    torch.manual_seed(seed)
    # a fresh Med-DDPM net predicts exactly 0 (zero-initialised residual branches): re-init them so
    # every recipe's numerics reach the output and the comparison can fail
    return randomize_zero_init(UNet3D(**{**TINY, **overrides}), seed)


def tiny_batch(size: int = 8, batch: int = 2, device: str = "cpu", seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, TINY["in_channels"], size, size, size, generator=g)
    target = torch.randn(batch, TINY["out_channels"], size, size, size, generator=g)
    t = torch.randint(0, 250, (batch,), generator=g)
    return x.to(device), t.to(device), target.to(device)


def train_step(stack: RecipeStack, model: torch.nn.Module, x, t, target) -> StepResult:
    """One step of the training loop's own :func:`med_ddpm.train.train_step` through every stack hook.

    The batch is the image ``target`` with the mask channels of ``x`` (its channels after the image's);
    t and ε are the loop's seeded draws, so ``t`` is not used. Returns the network's output (a forward
    hook), the loss, the gradients the update used and the parameters after it.
    """
    cfg = OmegaConf.create({"seed": 0, "diffusion": {"loss_type": "l1"},
                            "train": {"batch_size": x.shape[0], "grad_accum": 1, "divide_loss_by_batch_size": False,
                                      "ema_every": 1, "ema_start": 0}})
    outputs: list[torch.Tensor] = []
    with stack.session():
        prepared = stack.prepare_model(model)
        hook = prepared.register_forward_hook(lambda _m, _i, out: outputs.append(out.detach().float()))
        state = TrainState(cfg=cfg, device=x.device, net=model, model=prepared, ema=None,
                           schedule=NoiseSchedule(timesteps=250).to(x.device), stack=stack,
                           optimizer=torch.optim.Adam(model.parameters(), lr=LR, **stack.optimizer_options()),
                           scaler=stack.grad_scaler(x.device.type))
        loss = med_ddpm_train_step(state, iter([{"image": target, "cond": x[:, target.shape[1]:]}]))
        hook.remove()
        assert torch.isfinite(loss), f"non-finite loss {loss}"
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        params = {n: p.detach().clone() for n, p in model.state_dict().items()}
    return StepResult(outputs[0], loss.detach(), grads, params)


def scaled_error(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max|a - b|, max|b|): the two numbers the card tolerance is stated in."""
    a, b = a.float(), b.float()
    return (a - b).abs().max().item(), b.abs().max().item()


def assert_close(name: str, a: torch.Tensor, b: torch.Tensor, exact: bool, tol: dict):
    """Bit-equality for exact recipes; else max|a-b| <= atol + rtol * max|b|."""
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} vs baseline {tuple(b.shape)}"
    if exact:
        assert torch.equal(a.float(), b.float()), f"{name}: not bit-exact, max diff {scaled_error(a, b)[0]}"
        return
    err, scale = scaled_error(a, b)
    bound = tol["atol"] + tol["rtol"] * scale
    assert err <= bound, f"{name}: max|diff| {err:.3g} > {bound:.3g} (atol + rtol * {scale:.3g})"


@pytest.fixture(scope="session")
def recipe_files() -> list[Path]:
    files = sorted(RECIPE_DIR.glob("*.yaml"))
    assert files, f"no recipe configs in {RECIPE_DIR}"
    return files


def assert_deepcopy_runs_the_copy(model: torch.nn.Module, x: torch.Tensor) -> None:
    """A forward override must follow ``copy.deepcopy`` (an EMA copy): the zeroed copy computes zeros
    while the original does not (an override still bound to the original would not)."""
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.zero_()
    assert ema(x).abs().max() == 0 and model(x).abs().max() > 0


def output_and_grads(net: torch.nn.Module, x, t, target) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward and L1 backward: the output and every parameter's gradient, in parameter order."""
    y = net(x, t)
    F.l1_loss(y, target).backward()
    return y, [p.grad for p in net.parameters()]


def float32_buffers(codes: list[str], device: str, at_least: int) -> list[str]:
    """Shapes of the float32 buffers of ``at_least`` elements or more that inductor's generated
    ``codes`` allocate on ``device`` ("cpu" or "cuda"): the intermediates a compiled graph writes."""
    shapes = re.findall(rf"empty_strided_{device}\(\((.*?)\), \(.*?\), torch\.float32\)", "\n".join(codes))
    return [s for s in shapes if math.prod(int(v) for v in s.replace(" ", "").split(",") if v) >= at_least]

