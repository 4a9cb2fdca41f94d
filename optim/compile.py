"""``torch.compile`` of the model's forward, in place (state-dict keys unchanged).

``torch.compile(model)`` returns a wrapper whose state-dict keys gain an ``_orig_mod.`` prefix;
compiling the instance's forward instead keeps Med-DDPM's key names, so checkpoints written
with or without the recipe are interchangeable. Compilation is lazy: the first call pays it,
so callers time that call separately (:meth:`Compile.measure_first_call`), and the session
ends with ``torch.compiler.reset()`` so a Hydra multirun's next job starts from a clean cache.

Example:
    >>> model = compile_model(model, mode="max-autotune")
    >>> y = model(x, t)          # first call compiles
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from optim.base import Recipe, RecipeConflictError
from optim.forward_override import override_forward

MODES = ("default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead")


def check_mode(mode: str) -> None:
    """The one validation of ``mode``, shared by the recipe and its functional twin."""
    if mode not in MODES:
        raise RecipeConflictError(f"compile mode must be one of {MODES}, got {mode!r}")


def _compiled(forward: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    compiled = torch.compile(forward, **options)
    if options.get("mode") != "reduce-overhead":
        return compiled

    @functools.wraps(forward)
    def graphed(*args: Any, **kwargs: Any) -> Any:
        # Inductor's CUDA-graph trees reuse output memory on the next replay. Samplers keep past
        # eps (DEIS/iPNDM, DPM-Solver++ history) across calls, so each call is marked as a new
        # step and its output cloned (one volume-sized copy, ~0.1 % of a 128^3 step).
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(*args, **kwargs)
        return out.clone() if isinstance(out, torch.Tensor) else out

    return graphed


def compile_model(model: nn.Module, mode: str = "default", fullgraph: bool = False,
                  dynamic: bool = False, backend: str = "inductor") -> nn.Module:
    """Functional twin: compile ``model.forward`` in place and return the same module."""
    check_mode(mode)
    override_forward(model, functools.partial(_compiled, mode=mode, fullgraph=fullgraph,
                                              dynamic=dynamic, backend=backend))
    return model


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Compile(Recipe):
    """``torch.compile`` the forward (inductor; ``dynamic=False`` since volume shapes are fixed).

    Runs last in ``prepare_model`` so it sees the final layout, modules and wrappers.
    """

    name = "compile"
    exact = False
    tolerance = {"rtol": 1e-4, "atol": 1e-5}
    stage = 50
    slow_first_call = True

    def __init__(self, mode: str = "default", fullgraph: bool = False, dynamic: bool = False,
                 backend: str = "inductor") -> None:
        check_mode(mode)
        self.mode, self.fullgraph, self.dynamic, self.backend = mode, fullgraph, dynamic, backend
        self.first_call_s: float | None = None
        self.prepared_at: float | None = None

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        try:
            yield
        finally:
            torch.compiler.reset()

    def prepare_model(self, model: nn.Module) -> nn.Module:
        self.prepared_at = time.time()
        return compile_model(model, self.mode, self.fullgraph, self.dynamic, self.backend)

    def measure_first_call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` once (normally the first forward/train step), recording its wall time.

        The recorded ``first_call_s`` (compile + one step, device-synchronised) is reported by
        ``describe()``, apart from the steady-state timings.
        """
        _synchronize()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        _synchronize()
        self.first_call_s = time.perf_counter() - start
        return out

    def options(self) -> dict[str, Any]:
        return {"mode": self.mode, "fullgraph": self.fullgraph, "dynamic": self.dynamic,
                "backend": self.backend}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "first_call_s": self.first_call_s}
