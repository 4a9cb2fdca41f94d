"""The recipe contract, parametrised over every file in configs/recipe/ with no special cases.

For each recipe config: it composes and instantiates to an ``optim.Recipe`` named by its config and
declaring :class:`optim.Capabilities` (a compiler not in the stack's eager form); ``supported()`` on CPU and on fake V100/H200 descriptors is
``(True, "")`` or ``(False, "<reason>; <fix>")`` and the stack refuses with
``recipe '<name>' is unsupported on this device: <reason>; <fix>``; the training loop's gradient
accumulation is refused exactly for a graph-capturing recipe; where supported on this machine, a
training step (forward, L1 loss, backward, Adam) on the tiny real UNet3D matches the strict-FP32
baseline within the declared tolerance (bit-exact when ``exact``, or when the recipe declares itself inert on
a CPU), ``session()`` restores every
observable global, and ``describe()`` (recipe and stack) is JSON-serialisable.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import LR, RECIPE_DIR, assert_close, tiny_batch, tiny_unet, train_step
from omegaconf import OmegaConf

from optim import Capabilities, DeviceInfo, Recipe, RecipeConflictError, RecipeStack, UnsupportedRecipeError

DEVICES = [DeviceInfo("cpu"), DeviceInfo("cuda", (7, 0), "Tesla V100"), DeviceInfo("cuda", (9, 0), "H200")]


def _params():
    for path in sorted(RECIPE_DIR.glob("*.yaml")):
        recipe, stack = load_stack(path)  # slow: it compiles here (a refused recipe runs no step)
        slow = recipe.capabilities.slow_first_call and stack.supported("cpu")[0]
        yield pytest.param(path, id=path.stem, marks=[pytest.mark.slow] if slow else [])


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
def baseline(torch_threads):
    x, t, target = tiny_batch()
    return train_step(RecipeStack([]), tiny_unet(), x, t, target)


@pytest.mark.parametrize("path", list(_params()))
def test_recipe_contract(path: Path, baseline) -> None:
    recipe, stack = load_stack(path)
    assert recipe.name == path.stem and isinstance(recipe.capabilities, Capabilities)
    assert type(recipe)(**recipe.options()).name == path.stem, "built in Python, the recipe has its config's name"
    json.dumps(recipe.describe())
    # the eager form (a job too small to compile) keeps what pays without a compiler, never a compiler itself
    assert stack.eager().names == ([path.stem] if recipe.capabilities.pays_eagerly else [])
    assert not (recipe.capabilities.slow_first_call and recipe.capabilities.pays_eagerly)

    for device in DEVICES:  # supported() answers "<reason>; <fix>", and the stack refuses with it by name
        ok, reason = recipe.supported(device)
        assert isinstance(ok, bool) and isinstance(reason, str) and ok == (not reason)
        if not ok:
            assert "; " in reason, f"{path.stem}: a refusal says how to fix it: {reason!r}"
            assert stack.supported(device) == (False, f"recipe {path.stem!r} is unsupported on this device: {reason}")
            with pytest.raises(UnsupportedRecipeError, match=re.escape(f"recipe {path.stem!r} is unsupported")):
                stack.require(device)

    stack.require_training(1)  # the training loop's micro-batches: one always works; more unless graphs replay
    if recipe.capabilities.captures_graphs:
        with pytest.raises(RecipeConflictError, match=f"recipe {path.stem!r} cannot train with train.grad_accum=2"):
            stack.require_training(2)
    else:
        stack.require_training(2)

    ok, reason = stack.supported("cpu")
    if not ok:
        with pytest.raises(UnsupportedRecipeError):
            stack.require("cpu")
        return

    before = observable_globals()
    result = train_step(stack, tiny_unet(), *tiny_batch())
    assert observable_globals() == before, "session() did not restore the process globals"

    # a recipe inert on this device (acts_on leaves it out) must compute exactly what the baseline computes
    exact, tol = recipe.capabilities.exact or bool(stack.inert("cpu")), recipe.capabilities.tolerance
    assert_close("forward", result.output, baseline.output, exact, tol)
    assert_close("loss", result.loss, baseline.loss, exact, tol)
    # One gradient vector: a conv bias feeding a GroupNorm has a ~0 gradient, so per-tensor
    # relative error would measure noise; the step's gradient as a whole is what matters.
    flat = [torch.cat([g[n].flatten() for n in baseline.grads]) for g in (result.grads, baseline.grads)]
    assert_close("gradient", *flat, exact, tol)
    # Adam's first step from identical weights moves each by lr * g / (|g| + eps) (bias-corrected moments g and g^2),
    # about lr whatever the gradient's size: an approximate recipe may flip it where the gradient is near 0, so its
    # weights are not compared with the baseline's; its update must be exactly Adam's on the gradient it computed.
    start, eps = tiny_unet().state_dict(), stack.optimizer_options().get("eps", 1e-8)
    for name, param in baseline.params.items():
        if exact:
            assert_close(f"param {name}", result.params[name], param, exact, tol)
        else:
            grad = result.grads[name]
            update = result.params[name] - start[name]
            torch.testing.assert_close(update, -LR * grad / (grad.abs() + eps), rtol=1e-4, atol=LR * 1e-4,
                                       msg=lambda m, name=name: f"param {name}: not Adam's step on its gradient: {m}")
    json.dumps(stack.describe())


@pytest.mark.parametrize("name", ["amp_fp16", "compile_cudagraphs"])
def test_gpu_only_recipes_are_refused_on_a_cpu_as_their_cards_say(name: str) -> None:
    """float16 CPU autocast runs about 100x slower than float32, and inductor on a CPU has no CUDA graphs: both
    would time or train silently without what the recipe promises, so both are refused with a fix."""
    ok, reason = load_stack(RECIPE_DIR / f"{name}.yaml")[1].supported("cpu")
    assert not ok and reason.startswith(f"recipe {name!r} is unsupported on this device: ") and "not cpu; " in reason
