"""TF32 tensor-core maths for fp32 convolutions and matmuls (Ampere and newer).

TF32 keeps fp32's range but rounds the mantissa to 10 bits inside the tensor-core product,
which is why it is *approximate*: expect ~1e-3 relative error per conv, not bit-equality.

Example:
    >>> with tf32_enabled():
    ...     y = model(x)          # convs/matmuls may use TF32 on an A100/H100/H200
"""

from __future__ import annotations

import contextlib
from typing import Any

from optim.base import Capabilities, Recipe
from optim.flags import set_flags

TF32 = {"cuda.matmul.fp32_precision": "tf32", "cudnn.conv.fp32_precision": "tf32"}


def tf32_flags(conv: bool = True, matmul: bool = True) -> dict[str, str]:
    """The ``fp32_precision`` flags (new API only) that let fp32 conv and/or matmul use TF32."""
    return {k: v for k, v in TF32.items() if (conv if "conv" in k else matmul)}


def tf32_enabled(conv: bool = True, matmul: bool = True) -> contextlib.AbstractContextManager[None]:
    """Functional twin: a context in which fp32 conv and/or matmul may use TF32, restored on exit."""
    return set_flags(tf32_flags(conv, matmul))


class Tf32(Recipe):
    """Allow TF32 for fp32 conv and matmul for the session.

    On CPU the flags are set but no kernel reads them, so it is a supported no-op (one code
    path for tests and sweeps); on CUDA below compute capability 8.0 it is unsupported.
    """

    name = "tf32"

    def __init__(self, conv: bool = True, matmul: bool = True) -> None:
        self.conv, self.matmul = conv, matmul
        self.capabilities = Capabilities(exact=False, tolerance={"rtol": 2e-2, "atol": 1e-4},
                                         flags=tf32_flags(conv, matmul),
                                         acts_on=("cuda",), min_cuda_capability=8, requirement="TF32", fix="drop tf32 on this GPU")

    def options(self) -> dict[str, Any]:
        return {"conv": self.conv, "matmul": self.matmul}
