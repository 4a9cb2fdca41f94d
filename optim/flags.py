"""Process-global backend flags: set them, restore them exactly, and report their effective values.

Only the *new* precision API (``torch.backends.{cuda.matmul,cudnn.conv}.fp32_precision``,
PyTorch >= 2.9) is ever written. Mixing it with the legacy ``allow_tf32`` flags makes torch raise
("you have used mix of the legacy and new APIs"), so this module never reads or writes them.

Precision settings form a tree (``generic -> cuda -> {matmul, conv, rnn}``); a node set to
``"none"`` inherits its parent's value, and an all-``"none"`` chain means IEEE fp32. The
*effective* value is what :func:`effective_precision` resolves.

Example:
    >>> with set_flags({"cudnn.conv.fp32_precision": "ieee"}):
    ...     effective_precision("cuda", "conv")
    'ieee'
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch._functorch.config


def _precision(backend: str, op: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    return (lambda: torch._C._get_fp32_precision_getter(backend, op),
            lambda value: torch._C._set_fp32_precision_setter(backend, op, value))


def _attr(module: Any, name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    return (lambda: getattr(module, name), lambda value: setattr(module, name, value))


# Every global a recipe may touch, by a stable dotted name (also the key in describe()).
FLAGS: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
    "fp32_precision": _precision("generic", "all"),
    "cuda.fp32_precision": _precision("cuda", "all"),
    "cuda.matmul.fp32_precision": _precision("cuda", "matmul"),
    "cudnn.conv.fp32_precision": _precision("cuda", "conv"),
    "cudnn.benchmark": _attr(torch.backends.cudnn, "benchmark"),
    "cudnn.benchmark_limit": _attr(torch.backends.cudnn, "benchmark_limit"),
    "cudnn.deterministic": _attr(torch.backends.cudnn, "deterministic"),
    # AOTAutograd's cache refuses graphs with a custom autograd.Function unless this is on (torch's default: off)
    "functorch.autograd_cache_allow_custom_autograd_functions":
        _attr(torch._functorch.config, "autograd_cache_allow_custom_autograd_functions"),
}


def get_flags(names: list[str] | None = None) -> dict[str, Any]:
    """Current raw values of the named flags (all of :data:`FLAGS` by default)."""
    return {name: FLAGS[name][0]() for name in (names or FLAGS)}


@contextlib.contextmanager
def set_flags(values: Mapping[str, Any]) -> Iterator[None]:
    """Set flags for the duration of the block and restore the previous raw values on exit.

    Restores even when the body raises, in reverse order of setting.
    """
    unknown = set(values) - set(FLAGS)
    if unknown:
        raise KeyError(f"unknown backend flag(s) {sorted(unknown)}; known: {sorted(FLAGS)}")
    previous = get_flags(list(values))
    try:
        for name, value in values.items():
            FLAGS[name][1](value)
        yield
    finally:
        for name in reversed(list(values)):
            FLAGS[name][1](previous[name])


def effective_precision(backend: str, op: str) -> str:
    """Resolve ``"none"`` up the precision tree (leaf -> backend "all" -> generic "all")."""
    for key in ((backend, op), (backend, "all"), ("generic", "all")):
        value = torch._C._get_fp32_precision_getter(*key)
        if value != "none":
            return value
    return "ieee"


def effective_flags() -> dict[str, Any]:
    """What kernels will actually do: resolved precisions plus cuDNN algorithm flags."""
    return {
        "cuda.matmul.fp32_precision": effective_precision("cuda", "matmul"),
        "cudnn.conv.fp32_precision": effective_precision("cuda", "conv"),
        "cudnn.benchmark": bool(torch.backends.cudnn.benchmark),
        "cudnn.benchmark_limit": torch.backends.cudnn.benchmark_limit,
        "cudnn.deterministic": bool(torch.backends.cudnn.deterministic),
    }


STRICT_FP32 = {"cuda.matmul.fp32_precision": "ieee", "cudnn.conv.fp32_precision": "ieee"}
"""The baseline: cuDNN conv TF32 is ON by default in PyTorch, so "no recipe" must turn it off."""
