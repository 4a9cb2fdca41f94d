"""``torch.compile`` of the model's forward, in place (state-dict keys unchanged).

``torch.compile(model)`` returns a wrapper whose state-dict keys gain an ``_orig_mod.`` prefix;
compiling the instance's forward instead keeps Med-DDPM's key names, so checkpoints written
with or without the recipe are interchangeable. Compilation is lazy: the first call pays it,
so callers time that call separately (``slow_first_call``: the bench reports it as ``first_call_s``), and the session
ends with ``torch.compiler.reset()`` so a Hydra multirun's next job starts from a clean cache. The session lets
AOTAutograd's cache keep graphs with custom autograd Functions (:data:`CACHE_FLAGS`), so a warm start of a training
step loads its joint graph instead of tracing it again.

Modes: ``default`` (inductor kernels) and ``reduce-overhead`` (the same kernels replayed as CUDA-graph
trees: recipe ``compile_cudagraphs``). The max-autotune modes are not offered: their compile of the
whole-head network did not finish (docs/recipes.md, Removed recipes).

Example:
    >>> model = compile_model(model, mode="reduce-overhead")
    >>> y = model(x, t)          # first call compiles
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from optim.base import Capabilities, Recipe, RecipeConflictError
from optim.channels_last import is_only_channels_last_3d
from optim.forward_override import override_forward
from optim.precompile import Precompiled

MODES = ("default", "reduce-overhead")
# Let AOTAutograd's cache keep graphs that hold a custom autograd.Function (gather_upsample, dense_conv_grads):
# torch keeps them out by default, and a warm start then traces and partitions the joint training graph again.
# The Function's forward and backward are traced into the graph, so its key covers them (pytorch#149751).
CACHE_FLAGS = {"functorch.autograd_cache_allow_custom_autograd_functions": True}
LAYOUT_OPTIMIZATION = ("auto", True, False)


def check_mode(mode: str, layout_optimization: str | bool = "auto", inductor: Mapping[str, Any] | None = None,
               backend: str = "inductor") -> None:
    """The one validation of the options, shared by the recipe and its functional twin."""
    if mode not in MODES:
        raise RecipeConflictError(f"compile mode must be one of {MODES}, got {mode!r}")
    if layout_optimization not in LAYOUT_OPTIMIZATION:
        raise RecipeConflictError(f"compile layout_optimization must be one of {LAYOUT_OPTIMIZATION}, "
                                  f"got {layout_optimization!r}")
    unknown = sorted(set(inductor) - set(torch._inductor.list_options())) if inductor else []  # imports inductor
    if unknown:
        raise RecipeConflictError(f"compile inductor options {unknown} are not inductor config names "
                                  "(torch._inductor.list_options())")
    if inductor and backend != "inductor":
        raise RecipeConflictError(f"compile inductor options {sorted(inductor)} need backend 'inductor', got {backend!r}")
    if "layout_optimization" in (inductor or {}):
        raise RecipeConflictError("set compile's layout_optimization option, not inductor.layout_optimization")


def has_channels_last_3d_weights(model: nn.Module) -> bool:
    """Whether some 5-D parameter (a 3-D conv kernel larger than 1x1x1) is stored NDHWC."""
    return any(is_only_channels_last_3d(p) for p in model.parameters())


def inductor_layout_optimization(model: nn.Module, setting: str | bool) -> bool | None:
    """Resolve ``layout_optimization``: ``None`` keeps inductor's own choice.

    Why ``auto`` turns it off for an NDHWC model: inductor's layout optimisation only handles 2-D
    convolutions. When its heuristic switches it on for a graph, it also drops the constraint that
    keeps every convolution's inputs in their eager (traced) strides, but for 3-D convolutions it
    puts no channels-last preference in its place. Pointwise results (the autocast weight cast,
    GroupNorm + SiLU) then default to NCDHW, and cuDNN, whose bf16 kernels are NDHWC, converts
    around every convolution (seen in the H200 profiles under bench/results/h200/tuning/). With it
    off, the traced channels-last strides are kept and the conversions are gone.
    """
    if setting == "auto":
        return False if has_channels_last_3d_weights(model) else None
    return bool(setting)


def compile_options(mode: str, backend: str, layout_optimization: bool | None,
                    inductor: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``torch.compile`` keyword arguments: ``mode``, or the mode's inductor options plus the
    layout setting and any extra ``inductor`` config (``torch.compile`` refuses ``mode`` and
    ``options`` together)."""
    extra = {} if layout_optimization is None else {"layout_optimization": layout_optimization}
    extra.update(inductor or {})
    if not extra or backend != "inductor":
        return {"mode": mode}
    return {"options": {**torch._inductor.list_mode_options(mode), **extra}}


def _compiled(forward: Callable[..., Any], mode: str, backend: str, layout_optimization: bool | None,
              inductor: Mapping[str, Any] | None, aot_file: Path | None = None, **options: Any) -> Callable[..., Any]:
    kwargs = {"backend": backend, **compile_options(mode, backend, layout_optimization, inductor), **options}
    compiled = Precompiled(forward, kwargs, aot_file) if aot_file else torch.compile(forward, **kwargs)
    if mode != "reduce-overhead":
        return compiled

    @functools.wraps(forward)
    def graphed(*args: Any, **kwargs: Any) -> Any:
        # Inductor's CUDA-graph trees reuse output memory on the next replay. Samplers keep past
        # eps (DEIS/iPNDM, DPM-Solver++ history) across calls, so each call is marked as a new
        # step and its output cloned (one volume-sized copy, ~0.1 % of a 128^3 step).
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(*args, **kwargs)
        return out.clone() if isinstance(out, torch.Tensor) else out

    graphed.compiled_forward = compiled  # type: ignore[attr-defined]  # optim.precompile.precompiled_forward finds it
    return graphed


def compile_model(model: nn.Module, mode: str = "default", fullgraph: bool = False,
                  dynamic: bool = False, backend: str = "inductor",
                  layout_optimization: str | bool = "auto", inductor: Mapping[str, Any] | None = None,
                  aot_file: str | Path | None = None) -> nn.Module:
    """Functional twin: compile ``model.forward`` in place and return the same module.

    Call it after any layout change (``to_channels_last_3d``): ``layout_optimization="auto"``
    reads the parameters' layout now. ``inductor``: extra inductor config for this compile only,
    e.g. ``{"coordinate_descent_tuning": True}``. ``aot_file``: keep the compiled forward in this file
    (:mod:`optim.precompile`): the first call saves it, a later process loads it instead of tracing.
    """
    check_mode(mode, layout_optimization, inductor, backend)
    return _install(model, mode, fullgraph, dynamic, backend, inductor_layout_optimization(model, layout_optimization),
                    inductor, Path(aot_file) if aot_file else None)


def _install(model: nn.Module, mode: str, fullgraph: bool, dynamic: bool, backend: str,
             layout: bool | None, inductor: Mapping[str, Any] | None, aot_file: Path | None = None) -> nn.Module:
    """Install the compiled forward, with the layout setting already resolved."""
    override_forward(model, functools.partial(_compiled, mode=mode, fullgraph=fullgraph, dynamic=dynamic,
                                              backend=backend, layout_optimization=layout,
                                              inductor=dict(inductor or {}), aot_file=aot_file))
    return model


class Compile(Recipe):
    """``torch.compile`` the forward (inductor; ``dynamic=False`` since volume shapes are fixed).

    Runs last in ``prepare_model`` so it sees the final layout, modules and wrappers. Mode
    ``reduce-overhead`` replays CUDA-graph trees: CUDA only, and one micro-batch per optimiser step.
    ``aot``: compile ahead of time into :attr:`aot_file`, which the command sets from its compile cache
    (:mod:`optim.precompile`); without a file the forward compiles lazily as with ``aot=false``.
    """

    def __init__(self, mode: str = "default", fullgraph: bool = False, dynamic: bool = False,
                 backend: str = "inductor", layout_optimization: str | bool = "auto",
                 inductor: Mapping[str, Any] | None = None, aot: bool = False) -> None:
        check_mode(mode, layout_optimization, inductor, backend)
        self.mode, self.fullgraph, self.dynamic, self.backend = mode, fullgraph, dynamic, backend
        self.layout_optimization = layout_optimization
        self.inductor = dict(inductor or {})
        self.aot, self.aot_file = bool(aot), None
        self.resolved_layout_optimization: bool | None = None
        graphs = mode == "reduce-overhead"
        self.name = "compile_cudagraphs" if graphs else "compile"
        self.capabilities = Capabilities(
            exact=False, tolerance={"rtol": 1e-4, "atol": 1e-5}, stage=50, kind="compile", slow_first_call=True,
            pays_eagerly=False, captures_graphs=graphs, devices=("cuda",) if graphs else None, flags=CACHE_FLAGS,
            requirement="compile mode reduce-overhead (CUDA-graph trees)",
            fix="use the compile recipe off CUDA (inductor would run there without graphs)")

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        try:
            yield
        finally:
            torch.compiler.reset()

    def prepare_model(self, model: nn.Module) -> nn.Module:
        self.resolved_layout_optimization = inductor_layout_optimization(model, self.layout_optimization)
        return _install(model, self.mode, self.fullgraph, self.dynamic, self.backend,
                        self.resolved_layout_optimization, self.inductor, self.aot_file if self.aot else None)

    def options(self) -> dict[str, Any]:
        return {"mode": self.mode, "fullgraph": self.fullgraph, "dynamic": self.dynamic,
                "backend": self.backend, "layout_optimization": self.layout_optimization,
                "inductor": dict(self.inductor), "aot": self.aot}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "inductor_layout_optimization": self.resolved_layout_optimization,
                "aot_file": str(self.aot_file) if self.aot and self.aot_file else None}  # None: compiled lazily
