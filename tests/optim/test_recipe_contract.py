"""The recipe contract, parametrised over every file in configs/recipe/ with no special cases.

For each recipe config: it composes and instantiates to an ``optim.Recipe``; ``supported()``
on CPU and on fake V100/H200 descriptors is ``(True, "")`` or ``(False, reason)`` and the stack
refuses with that reason; where supported on this machine, a training step (forward, L1 loss,
backward, Adam) on the tiny real UNet3D matches the strict-FP32 baseline within the recipe's
declared tolerance (bit-exact when ``exact``), ``session()`` restores every observable global,
and ``describe()`` (recipe and stack) is JSON-serialisable.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import LR, RECIPE_DIR, assert_close, tiny_batch, tiny_unet, train_step
from hydra.utils import get_class
from omegaconf import OmegaConf

from optim import DeviceInfo, Recipe, RecipeConflictError, RecipeStack, UnsupportedRecipeError

DEVICES = [DeviceInfo("cpu"), DeviceInfo("cuda", (7, 0), "Tesla V100"), DeviceInfo("cuda", (9, 0), "H200")]


def _params():
    for path in sorted(RECIPE_DIR.glob("*.yaml")):
        node = OmegaConf.load(path)
        cls = get_class(next(iter(node.values()))["_target_"])
        yield pytest.param(path, id=path.stem, marks=[pytest.mark.slow] if cls.slow_first_call else [])


def load_stack(path: Path) -> tuple[Recipe, RecipeStack]:
    node = OmegaConf.load(path)
    assert list(node) == [path.stem], f"{path.name} must nest its content under the key {path.stem!r}"
    stack = RecipeStack.from_config(node)
    assert len(stack.recipes) == 1 and isinstance(stack.recipes[0], Recipe)
    return stack.recipes[0], stack


def observable_globals() -> dict:
    """Every process-global a recipe could plausibly leave behind (a fixed list)."""
    getter = torch._C._get_fp32_precision_getter
    return {
        "fp32.generic": getter("generic", "all"), "fp32.cuda": getter("cuda", "all"),
        "fp32.cuda.matmul": getter("cuda", "matmul"), "fp32.cuda.conv": getter("cuda", "conv"),
        "fp32.cuda.rnn": getter("cuda", "rnn"), "fp32.mkldnn.matmul": getter("mkldnn", "matmul"),
        "fp32.mkldnn.conv": getter("mkldnn", "conv"),
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cudnn.benchmark_limit": torch.backends.cudnn.benchmark_limit, "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.enabled": torch.backends.cudnn.enabled,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "autocast.cpu": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
        "autocast.cuda": (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")),
        "autocast.cache": torch.is_autocast_cache_enabled(),
        "grad_enabled": torch.is_grad_enabled(), "default_dtype": torch.get_default_dtype(),
        "sdp": (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled()),
        "compiling": torch.compiler.is_compiling(),
        # frames dynamo has converted: torch.compiler.reset() clears them, so a recipe that
        # compiles and leaves its cache behind shows up here
        "dynamo_input_codes": len(torch._dynamo.convert_frame.input_codes.seen),
    }


@pytest.fixture(scope="module")
def baseline():
    x, t, target = tiny_batch()
    return train_step(RecipeStack([]), tiny_unet(), x, t, target)


@pytest.mark.parametrize("path", list(_params()))
def test_recipe_contract(path: Path, baseline) -> None:
    recipe, stack = load_stack(path)
    json.dumps(recipe.describe())

    for device in DEVICES:  # supported() answers, and the stack refuses with the same reason
        ok, reason = recipe.supported(device)
        assert isinstance(ok, bool) and isinstance(reason, str) and (ok or reason)
        if not ok:
            with pytest.raises(UnsupportedRecipeError, match=reason.split(";")[0][:40]):
                stack.require(device)

    for grad_accum in (1, 2):  # the training loop's micro-batches: one always works; a refusal says why
        ok, reason = recipe.supports_training(grad_accum)
        assert isinstance(ok, bool) and isinstance(reason, str) and (ok or (reason and grad_accum > 1))
        if not ok:
            with pytest.raises(RecipeConflictError, match=f"cannot train with train.grad_accum={grad_accum}"):
                stack.require_training(grad_accum)

    ok, reason = stack.supported("cpu")
    if not ok:
        with pytest.raises(UnsupportedRecipeError):
            stack.require("cpu")
        return

    before = observable_globals()
    result = train_step(stack, tiny_unet(), *tiny_batch())
    assert observable_globals() == before, "session() did not restore the process globals"

    tol = recipe.tolerance
    assert_close("forward", result.output, baseline.output, recipe.exact, tol)
    assert_close("loss", result.loss, baseline.loss, recipe.exact, tol)
    # One gradient vector: a conv bias feeding a GroupNorm has a ~0 gradient, so per-tensor
    # relative error would measure noise; the step's gradient as a whole is what matters.
    flat = [torch.cat([g[n].flatten() for n in baseline.grads]) for g in (result.grads, baseline.grads)]
    assert_close("gradient", *flat, recipe.exact, tol)
    for name, param in baseline.params.items():
        # Adam moves each weight by ~lr whatever the gradient's size, so near-zero gradients
        # may flip an approximate recipe's update: allow 2 lr beyond the tolerance.
        assert_close(f"param {name}", result.params[name], param, recipe.exact, tol, slack=2 * LR)
    json.dumps(stack.describe())
