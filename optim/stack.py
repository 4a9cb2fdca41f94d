"""``RecipeStack``: the one object train, sample and bench call; validates, orders, composes.

Ordering rules (plain data, like composer's passes), applied by sorting on ``Recipe.stage``:
model surgery (attention, GroupNorm) -> checkpointing -> memory format -> AMP -> compile ->
CUDA graphs. So the memory format is set before compile, compile sees the final model, and
CUDA graphs capture the compiled forward. ``session()``s enter in that order and exit in
reverse (composer's FILO rule).

Conflicts are rejected up front with an error naming both recipes: two AMP recipes, two of
the same recipe, ``cuda_graphs`` with ``compile(mode="reduce-overhead")`` (both capture graphs).

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

from optim.amp import Amp, NonFiniteGuard
from optim.base import DeviceInfo, Recipe, RecipeConflictError, UnsupportedRecipeError
from optim.channels_last import ChannelsLast3d
from optim.compile import Compile
from optim.cuda_graphs import CudaGraphs
from optim.flags import STRICT_FP32, effective_flags, set_flags


def _conflicts(recipes: list[Recipe]) -> None:
    """Raise :class:`RecipeConflictError` naming both recipes of the first incompatible pair."""
    for i, a in enumerate(recipes):
        for b in recipes[i + 1:]:
            if a.name == b.name or b.name in a.conflicts or a.name in b.conflicts:
                raise RecipeConflictError(f"recipes {a!r} and {b!r} cannot be combined "
                                          f"(at most one {a.name!r} per stack)")
    graphs = [r for r in recipes if isinstance(r, CudaGraphs)]
    overhead = [r for r in recipes if isinstance(r, Compile) and r.mode == "reduce-overhead"]
    if graphs and overhead:
        raise RecipeConflictError(
            f"recipes {overhead[0]!r} and {graphs[0]!r} cannot be combined: compile mode "
            "'reduce-overhead' already captures CUDA graphs; use compile mode 'default' or "
            "'max-autotune' with cuda_graphs, or drop cuda_graphs")


def _loss_guard(recipes: list[Recipe]) -> Any:
    """A recipe's own non-finite guard (built once), else the host guard.

    Refused with fp16's GradScaler (it owns fused Adam's ``found_inf``) and when two recipes each bring a guard
    (the loop asks one guard; picking either would silently drop the other's skip logic)."""
    guarded = [(r, g) for r in recipes if (g := r.loss_guard()) is not None]
    if len(guarded) > 1:
        raise RecipeConflictError(f"recipes {guarded[0][0]!r} and {guarded[1][0]!r} cannot be combined: each brings "
                                  "its own non-finite-loss guard and the training loop asks only one")
    scaled = [r for r in recipes if isinstance(r, Amp) and r.dtype == torch.float16]
    if guarded and scaled:
        raise RecipeConflictError(
            f"recipes {guarded[0][0]!r} and {scaled[0]!r} cannot be combined: fp16's GradScaler sets fused Adam's "
            "found_inf itself; use the host guard with amp_fp16")
    return guarded[0][1] if guarded else NonFiniteGuard()


def _merged(recipes: list[Recipe], hook: str, whose: str) -> dict[str, Any]:
    """Union of every recipe's ``hook()`` dict; two recipes that set one key differently are refused."""
    options: dict[str, tuple[Any, Recipe]] = {}
    for recipe in recipes:
        for key, value in getattr(recipe, hook)().items():
            if key in options and options[key][0] != value:
                raise RecipeConflictError(f"recipes {options[key][1]!r} and {recipe!r} cannot be combined: "
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
        _conflicts(recipes)
        self.recipes: list[Recipe] = sorted(recipes, key=lambda r: r.stage)
        requests = self.inductor_options()
        for r in self.recipes:
            if isinstance(r, Compile):
                r.request_inductor(requests)
        self.guard = _loss_guard(self.recipes)
        self._notes: list[str] = []
        if any(isinstance(r, Compile) for r in self.recipes):
            for r in self.recipes:
                if isinstance(r, ChannelsLast3d) and r.audit:
                    r.audit = False
                    self._notes.append("channels_last_3d layout audit off: torch.compile would trace its hooks")

    @classmethod
    def from_config(cls, node: Mapping[str, Any] | None) -> RecipeStack:
        """Instantiate every child node that has a ``_target_`` (the Hydra ``recipe`` group).

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
            recipes.append(recipe)
        return cls(recipes)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.recipes]

    @property
    def exact(self) -> bool:
        """True when every recipe is bit-exact (the empty stack is)."""
        return all(r.exact for r in self.recipes)

    def supported(self, device: DeviceInfo | torch.device | str | None) -> tuple[bool, str]:
        """``(False, "<name>: <reason>")`` for the first recipe the device cannot run."""
        info = DeviceInfo.of(device)
        for recipe in self.recipes:
            ok, reason = recipe.supported(info)
            if not ok:
                return False, f"recipe {recipe.name!r} is unsupported on this device: {reason}"
        return True, ""

    def require(self, device: DeviceInfo | torch.device | str | None) -> None:
        """Raise :class:`UnsupportedRecipeError` with the recipe's reason when unsupported."""
        ok, reason = self.supported(device)
        if not ok:
            raise UnsupportedRecipeError(reason)

    def require_training(self, grad_accum: int) -> None:
        """Raise :class:`RecipeConflictError` with the reason of the first recipe the training loop cannot run
        with ``grad_accum`` micro-batches per step."""
        for recipe in self.recipes:
            ok, reason = recipe.supports_training(grad_accum)
            if not ok:
                raise RecipeConflictError(f"recipe {recipe.name!r} cannot train with train.grad_accum={grad_accum}: "
                                          f"{reason}")

    def session_flags(self) -> dict[str, Any]:
        """The global flags a session of this stack sets: the strict baseline, then each recipe's."""
        flags = dict(STRICT_FP32)
        for recipe in self.recipes:
            flags.update(recipe.flags())
        return flags

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Strict-FP32 flags, then each recipe's session in order; all restored on exit."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(set_flags(STRICT_FP32))
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
        """The fp16 recipe's scaler, else a disabled one (one code path in the loop, as nanoGPT)."""
        for recipe in self.recipes:
            scaler = recipe.grad_scaler(device_type)
            if scaler is not None:
                return scaler
        return torch.amp.GradScaler(device_type, enabled=False)

    def optimizer_options(self) -> dict[str, Any]:
        """Every recipe's ``torch.optim.Adam`` keyword arguments; two recipes may not set one differently."""
        return _merged(self.recipes, "optimizer_options", "Adam's")

    def inductor_options(self) -> dict[str, Any]:
        """Every recipe's requested inductor config (what the stack hands to its ``compile`` recipes)."""
        return _merged(self.recipes, "inductor_options", "inductor's")

    def finite_or_skip(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Non-finite-loss guard for the training loop: run backward and the optimiser step?

        The default guard reads the loss on the host; a recipe's :meth:`optim.Recipe.loss_guard`
        replaces it (``fused_adam(guard=device)`` always says yes and lets the optimiser skip
        on the GPU, so it needs ``optimizer``). Skips are counted in ``describe()``.
        """
        return self.guard(loss, optimizer)

    def measure_first_call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` once, timing it as compile time when a compile recipe is present."""
        compiles = [r for r in self.recipes if isinstance(r, Compile)]
        return compiles[0].measure_first_call(fn, *args, **kwargs) if compiles else fn(*args, **kwargs)

    def describe(self) -> dict[str, Any]:
        """JSON-able: the ordered recipes actually applied, backend flags, skipped steps.

        ``effective_flags`` are the values in force *now*: call it inside ``session()`` (as the
        loop does) to record what the kernels ran with; ``session_sets`` is what the session sets.
        """
        return {
            "recipes": [r.describe() for r in self.recipes],
            "order": self.names,
            "exact": self.exact,
            "session_sets": self.session_flags(),
            "effective_flags": effective_flags(),
            "optimizer_options": self.optimizer_options(),
            "skipped_steps": self.guard.skipped,
            "notes": list(self._notes),
        }

    def __repr__(self) -> str:
        return f"RecipeStack({self.recipes!r})"
