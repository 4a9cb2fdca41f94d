"""cuDNN benchmark mode: time every conv algorithm on first use of a shape and keep the fastest.

Pays a one-off autotuning cost per input shape (count it as warm-up), then picks the best
algorithm for the fixed 3-D shapes of this project. Different algorithms sum in different
orders, so results are not bit-identical to the default heuristic choice.

cuDNN's v8 API times only the first ``torch.backends.cudnn.benchmark_limit`` engine configs its
heuristics rank (10 by default). ``limit=0`` times every one: a longer first step, and the only way
to find a faster kernel for a shape the heuristics rank badly.

Example:
    >>> with cudnn_benchmark_enabled():
    ...     y = model(x)
"""

from __future__ import annotations

import contextlib
from typing import Any

from optim.base import Capabilities, Recipe
from optim.flags import set_flags


def _flags(enabled: bool, limit: int | None) -> dict[str, Any]:
    return {"cudnn.benchmark": enabled} | ({} if limit is None else {"cudnn.benchmark_limit": limit})


def cudnn_benchmark_enabled(enabled: bool = True, limit: int | None = None) -> contextlib.AbstractContextManager[None]:
    """Functional twin: ``torch.backends.cudnn.benchmark`` (and ``benchmark_limit``; 0 = every
    engine, None = unchanged) for the block, restored on exit."""
    return set_flags(_flags(enabled, limit))


class CudnnBenchmark(Recipe):
    """Turn on cuDNN autotuning for the session (a no-op on CPU, where cuDNN is unused).

    ``limit``: how many of cuDNN's ranked engine configs to time per shape (0 = all; None keeps
    torch's default of 10).
    """

    name = "cudnn_benchmark"

    def __init__(self, limit: int | None = None) -> None:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"cudnn_benchmark: limit must be a non-negative int or null, got {limit!r}")
        self.limit = limit
        self.capabilities = Capabilities(exact=False, tolerance={"rtol": 1e-4, "atol": 1e-6}, flags=_flags(True, limit),
                                         acts_on=("cuda",), pays_eagerly=False)

    def options(self) -> dict[str, Any]:
        return {"limit": self.limit}
