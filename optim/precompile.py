"""A compiled forward kept in a file: ``torch.compile(...).aot_compile``, saved by one process, loaded by the next.

A warm ``torch.compile`` start hits inductor's caches but still runs Dynamo: it traces the network's Python again
and rebuilds its guards before the first call, seconds for the whole-head U-Net (more on a slow host CPU).
``aot_compile`` keeps Dynamo's result too (graph, guards, compiled code) in one file, so a later process loads it
and calls it without tracing. The compile recipes use it with ``aot=true`` when the command gives them a file
(the command's compile cache, :mod:`med_ddpm.compile_cache`).

``aot_compile`` is experimental in torch and needs a graph without breaks (``fullgraph``). So any failure to build,
save or load the file is one warning that names the file, and the forward is then compiled lazily as without
``aot``; a call whose inputs fail the saved guards (another shape, grad mode or autocast state) takes the lazy path
too. The network is passed to the saved function at each call, so the live model and its EMA copy share one file.

Example:
    >>> forward = Precompiled(model.forward, {"mode": "default"}, Path("cache/sample.aot"))
    >>> y = forward(x, t)        # first call: load the file, or compile ahead of time and save it
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from optim.forward_override import overrides

log = logging.getLogger("optim.precompile")


def precompiled_forward(model: torch.nn.Module) -> Precompiled | None:
    """The :class:`Precompiled` behind ``model``'s forward (a compile recipe with ``aot`` installed it), or None."""
    for override in overrides(model):
        fn = getattr(override.fn, "compiled_forward", override.fn)  # reduce-overhead wraps it (optim.compile)
        if isinstance(fn, Precompiled):
            return fn
    return None


class Precompiled:
    """``forward`` (a bound method of the network) compiled ahead of time into ``path``, else lazily.

    Attributes:
        status: ``pending`` until the first call, then what it did: ``loaded`` the file, ``saved`` a new one, or
            ``lazy`` (no file could be used: every call is compiled by ``torch.compile`` as without ``aot``).
        lazy_calls: calls that took the lazy ``torch.compile`` path (guards failed, or no file could be used).
        seconds: what the first call spent loading the file, or compiling and saving it. Dynamo's own time counters
            (``torch._dynamo.utils.calculate_time_spent``) do not see ``aot_compile``, so this is its only record.
    """

    def __init__(self, forward: Callable[..., Any], compile_kwargs: Mapping[str, Any], path: Path) -> None:
        self.forward, self.compile_kwargs, self.path = forward, dict(compile_kwargs), Path(path)
        self.lazy = torch.compile(forward, **self.compile_kwargs)  # compiles on its first call only
        self.compiled: Any = None
        self.status, self.lazy_calls, self.seconds = "pending", 0, 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.status == "pending":
            start = time.perf_counter()
            self.compiled = self._load(args, kwargs)
            self.seconds = time.perf_counter() - start
        module = getattr(self.forward, "__self__", None)
        if self.compiled is not None and self.compiled.guard_check(module, *args, **kwargs):
            return self.compiled(module, *args, **kwargs)
        self.lazy_calls += 1
        return self.lazy(*args, **kwargs)

    def _load(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The saved function, or a new one built from this call's inputs and saved; None (lazy) on any failure."""
        if not inspect.ismethod(self.forward):
            return self._give_up(f"{type(self.forward).__name__} is not a module's bound forward")
        try:
            if self.path.exists():
                try:
                    compiled, self.status = self._read(), "loaded"
                except Exception as err:  # a file of another torch, GPU or code: build it again
                    log.warning("%s: could not load (%s); compiling it again", self.path, _reason(err))
                    compiled, self.status = self._build(args, kwargs), "saved"
            else:
                compiled, self.status = self._build(args, kwargs), "saved"
            compiled.disable_guard_check()  # __call__ checks the guards once, to choose the path
        except Exception as err:  # aot_compile is experimental: any failure leaves the lazy compile
            return self._give_up(_reason(err))
        log.info("ahead-of-time compiled forward %s: %s", self.status, self.path)
        return compiled

    def _read(self) -> Any:
        with self.path.open("rb") as f:
            return torch.compiler.load_compiled_function(f)

    def _build(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with torch._dynamo.config.patch(enable_aot_compile=True):
            compiled = torch.compile(self.forward, **{**self.compile_kwargs, "fullgraph": True}).aot_compile((args, kwargs))
        compiled.save_compiled_function(str(self.path))  # written to a temporary file, then renamed
        return compiled

    def _give_up(self, reason: str) -> None:
        log.warning("%s: no ahead-of-time compiled forward (%s); compiling it lazily", self.path, reason)
        self.status = "lazy"
        return None


def _reason(err: BaseException) -> str:
    """The exception's type and first line, for a one-line warning."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first}"[:300]
