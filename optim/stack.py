"""``RecipeStack``: the one object train, sample and bench call; validates, orders, composes.

Everything the stack decides comes from each recipe's :class:`optim.Capabilities`; no recipe is
special-cased:

* order: sorted by ``stage``: flags (tf32, cudnn_benchmark), model surgery, checkpointing, memory
  format, AMP, compile, and last the optimiser's options. So the memory format is set before
  compile and compile sees the final model. ``session()``s enter in that order and exit in reverse.
* conflicts, refused up front with an error naming both recipes: two recipes of one ``kind`` (two
  AMPs, ``compile`` with ``compile_cudagraphs``); two recipes that each bring a loss guard, or one
  that does with a loss-scaling recipe; two recipes that set one flag, inductor or Adam option
  differently.
* the session: the strict-FP32 flags, every recipe's ``flags``, every recipe's ``inductor`` config,
  then each recipe's own ``session()``; all restored on exit.

The empty stack is the STRICT FP32 baseline: cuDNN conv TF32 is on by default in PyTorch, so
``RecipeStack([]).session()`` sets ``cudnn.conv`` and ``cuda.matmul`` fp32 precision to
``"ieee"`` (new API only), and every stack starts from that baseline before its own recipes.

Example:
    >>> stack = RecipeStack.from_config(cfg.get("recipe"))
    >>> stack.require(device)
    >>> with stack.session():
    ...     model = stack.prepare_model(model)
    ...     with stack.forward_context():
    ...         loss = diffusion_loss(model, schedule, stack.prepare_input(x0), stack.prepare_input(cond))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from optim.amp import NonFiniteGuard
from optim.base import DeviceInfo, Recipe, RecipeConflictError, UnsupportedRecipeError
from optim.flags import STRICT_FP32, effective_flags, set_flags


def _kinds(recipes: list[Recipe]) -> None:
    """Refuse two recipes of one kind (or one recipe twice), naming both."""
    seen: dict[str, Recipe] = {}
    for recipe in recipes:
        kind = recipe.capabilities.kind or recipe.name
        if kind in seen:
            raise RecipeConflictError(f"recipes {seen[kind].name!r} and {recipe.name!r} cannot be combined "
                                      f"(at most one {kind!r} recipe per stack); keep one of them in recipe=[...]")
        seen[kind] = recipe


def _loss_guard(recipes: list[Recipe]) -> Any:
    """A recipe's own non-finite guard (built once), else the host guard.

    Refused with a loss-scaling recipe (fp16's GradScaler owns fused Adam's ``found_inf``) and when two recipes
    each bring a guard (the loop asks one guard; picking either would silently drop the other's skip logic)."""
    guarded = [(r, g) for r in recipes if (g := r.loss_guard()) is not None]
    if len(guarded) > 1:
        raise RecipeConflictError(f"recipes {guarded[0][0].name!r} and {guarded[1][0].name!r} cannot be combined: "
                                  "each brings its own non-finite-loss guard and the training loop asks only one; "
                                  "keep one of them in recipe=[...]")
    scaled = [r for r in recipes if r.capabilities.scales_loss]
    if guarded and scaled:
        raise RecipeConflictError(
            f"recipes {guarded[0][0].name!r} and {scaled[0].name!r} cannot be combined: the loss scaler sets fused "
            f"Adam's found_inf itself; use {guarded[0][0].name}'s host guard with {scaled[0].name}")
    return guarded[0][1] if guarded else NonFiniteGuard()


def _merged(recipes: list[Recipe], values: Callable[[Recipe], Mapping[str, Any]], whose: str) -> dict[str, Any]:
    """Union of every recipe's ``values``; two recipes that set one key differently are refused."""
    options: dict[str, tuple[Any, Recipe]] = {}
    for recipe in recipes:
        for key, value in values(recipe).items():
            if key in options and options[key][0] != value:
                raise RecipeConflictError(f"recipes {options[key][1].name!r} and {recipe.name!r} cannot be combined: "
                                          f"they set {whose} {key} to {options[key][0]!r} and {value!r}")
            options[key] = value, recipe
    return {key: value for key, (value, _) in options.items()}


class RecipeStack:
    """An ordered, validated list of recipes with the :class:`optim.Recipe` hooks composed.

    Args:
        recipes: recipe instances in any order; they are sorted by stage (stable).
    """

    def __init__(self, recipes: Iterable[Recipe] = ()) -> None:
        recipes = list(recipes)
        bad = [r for r in recipes if not isinstance(r, Recipe)]
        if bad:
            raise TypeError(f"RecipeStack takes optim.Recipe instances, got {bad!r}")
        _kinds(recipes)
        self.recipes: list[Recipe] = sorted(recipes, key=lambda r: r.capabilities.stage)
        self.flags = {**STRICT_FP32, **_merged(self.recipes, lambda r: r.capabilities.flags, "the flag")}
        self.inductor = _merged(self.recipes, lambda r: r.capabilities.inductor, "inductor's")
        self.guard = _loss_guard(self.recipes)

    @classmethod
    def from_config(cls, node: Mapping[str, Any] | None) -> RecipeStack:
        """Instantiate every child node that has a ``_target_`` (the Hydra ``recipe`` group), named by its key.

        ``None`` or ``{}`` (``recipe=[]``) gives the strict-FP32 baseline.
        """
        from hydra.utils import instantiate

        recipes = []
        for key, child in (node or {}).items():
            if not isinstance(child, Mapping) or "_target_" not in child:
                raise RecipeConflictError(f"recipe config node {key!r} has no _target_: {child!r}")
            recipe = instantiate(child)
            if not isinstance(recipe, Recipe):
                raise TypeError(f"recipe config {key!r} built {type(recipe).__name__}, not an optim.Recipe")
            recipe.name = str(key)
            recipes.append(recipe)
        return cls(recipes)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.recipes]

    @property
    def exact(self) -> bool:
        """True when every recipe is bit-exact (the empty stack is)."""
        return all(r.capabilities.exact for r in self.recipes)

    @property
    def slow_first_call(self) -> bool:
        """True when a recipe's first call compiles (the bench reports that call as compile time)."""
        return any(r.capabilities.slow_first_call for r in self.recipes)

    def eager(self) -> RecipeStack:
        """The stack a job runs without compiling: its recipes that pay without a compiler
        (:attr:`optim.Capabilities.pays_eagerly`), the same instances."""
        return RecipeStack(r for r in self.recipes if r.capabilities.pays_eagerly)

    def supported(self, device: DeviceInfo | torch.device | str | None) -> tuple[bool, str]:
        """``(False, "recipe '<name>' is unsupported on this device: <reason>; <fix>")`` for the first recipe
        the device cannot run."""
        info = DeviceInfo.of(device)
        for recipe in self.recipes:
            ok, reason = recipe.supported(info)
            if not ok:
                return False, f"recipe {recipe.name!r} is unsupported on this device: {reason}"
        return True, ""

    def inert(self, device: DeviceInfo | torch.device | str | None) -> list[str]:
        """The recipes that run on ``device`` but change nothing there (their ``acts_on`` leaves it out)."""
        info = DeviceInfo.of(device)
        return [r.name for r in self.recipes if r.capabilities.inert_on(info)]

    def require(self, device: DeviceInfo | torch.device | str | None) -> None:
        """Raise :class:`UnsupportedRecipeError` with the recipe's reason when unsupported."""
        ok, reason = self.supported(device)
        if not ok:
            raise UnsupportedRecipeError(reason)

    def require_training(self, grad_accum: int) -> None:
        """Refuse (:class:`RecipeConflictError`) a graph-capturing recipe with ``grad_accum`` > 1.

        CUDA-graph trees reuse a replay's memory on the next replay, so a later micro-batch overwrites what an
        earlier one's backward still needs (PyTorch issue 169545 raises; issue 96693 reports gradients
        accumulated wrongly with no error)."""
        graphs = [r for r in self.recipes if r.capabilities.captures_graphs]
        if graphs and grad_accum > 1:
            raise RecipeConflictError(
                f"recipe {graphs[0].name!r} cannot train with train.grad_accum={grad_accum}: its CUDA graphs reuse a "
                "replay's memory on the next replay, so gradients cannot be accumulated over micro-batches (PyTorch "
                "issue 169545); use train.grad_accum=1 with a larger train.batch_size, or the compile recipe")

    def session_flags(self) -> dict[str, Any]:
        """The global flags a session of this stack sets: the strict baseline, then each recipe's."""
        return dict(self.flags)

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Strict-FP32 and the recipes' flags, their inductor config, then each recipe's session; all restored."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(set_flags(self.flags))
            if self.inductor:
                from torch._inductor import config as inductor_config

                stack.enter_context(inductor_config.patch(self.inductor))
            for recipe in self.recipes:
                stack.enter_context(recipe.session())
            yield

    def prepare_model(self, model: nn.Module) -> nn.Module:
        for recipe in self.recipes:
            model = recipe.prepare_model(model)
        return model

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        for recipe in self.recipes:
            x = recipe.prepare_input(x)
        return x

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for recipe in self.recipes:
                stack.enter_context(recipe.forward_context())
            yield

    def grad_scaler(self, device_type: str = "cuda") -> torch.amp.GradScaler:
        """A loss scaler, enabled when a recipe scales the loss (one code path in the loop, as nanoGPT)."""
        scaled = any(r.capabilities.scales_loss for r in self.recipes)
        return torch.amp.GradScaler(device_type, enabled=scaled)

    def optimizer_options(self) -> dict[str, Any]:
        """Every recipe's ``torch.optim.Adam`` keyword arguments; two recipes may not set one differently."""
        return _merged(self.recipes, lambda r: r.optimizer_options(), "Adam's")

    def inductor_options(self) -> dict[str, Any]:
        """The inductor config the session sets (every recipe's declared ``inductor``)."""
        return dict(self.inductor)

    def finite_or_skip(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Non-finite-loss guard for the training loop: run backward and the optimiser step?

        The default guard reads the loss on the host; a recipe's :meth:`optim.Recipe.loss_guard`
        replaces it (``fused_adam(guard=device)`` always says yes and lets the optimiser skip
        on the GPU, so it needs ``optimizer``). Skips are counted in ``describe()``.
        """
        return self.guard(loss, optimizer)

    def describe(self) -> dict[str, Any]:
        """JSON-able: the ordered recipes actually applied, backend flags, skipped steps.

        ``effective_flags`` are the values in force *now*: call it inside ``session()`` (as the
        loop does) to record what the kernels ran with; ``session_sets`` is what the session sets.
        """
        return {
            "recipes": [r.describe() for r in self.recipes],
            "order": self.names,
            "exact": self.exact,
            "slow_first_call": self.slow_first_call,
            "session_sets": self.session_flags(),
            "inductor": self.inductor_options(),
            "effective_flags": effective_flags(),
            "optimizer_options": self.optimizer_options(),
            "skipped_steps": self.guard.skipped,
        }

    def __repr__(self) -> str:
        return f"RecipeStack({self.recipes!r})"
