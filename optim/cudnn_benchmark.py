"""cuDNN benchmark mode: time every conv algorithm on first use of a shape and keep the fastest.

Pays a one-off autotuning cost per input shape (count it as warm-up), then picks the best
algorithm for the fixed 3-D shapes of this project. Different algorithms sum in different
orders, so results are not bit-identical to the default heuristic choice.

Example:
    >>> with cudnn_benchmark_enabled():
    ...     y = model(x)
"""

from __future__ import annotations

import contextlib
from typing import Any

from optim.base import Recipe
from optim.flags import set_flags


def cudnn_benchmark_enabled(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Functional twin: ``torch.backends.cudnn.benchmark`` for the block, restored on exit."""
    return set_flags({"cudnn.benchmark": enabled})


class CudnnBenchmark(Recipe):
    """Turn on cuDNN autotuning for the session (a no-op on CPU, where cuDNN is unused)."""

    name = "cudnn_benchmark"
    exact = False
    tolerance = {"rtol": 1e-4, "atol": 1e-6}
    stage = 0

    def flags(self) -> dict[str, Any]:
        return {"cudnn.benchmark": True}
