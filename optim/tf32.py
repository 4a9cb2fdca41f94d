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

import torch

from optim.base import DeviceInfo, Recipe, cuda_capability_at_least
from optim.flags import set_flags

TF32 = {"cuda.matmul.fp32_precision": "tf32", "cudnn.conv.fp32_precision": "tf32"}


def tf32_enabled(conv: bool = True, matmul: bool = True) -> contextlib.AbstractContextManager[None]:
    """Functional twin: a context in which fp32 conv and/or matmul may use TF32.

    Uses the new ``fp32_precision`` API only and restores the previous values on exit.
    """
    return set_flags(Tf32(conv, matmul).flags())


class Tf32(Recipe):
    """Allow TF32 for fp32 conv and matmul for the session.

    On CPU the flags are set but no kernel reads them, so it is a supported no-op (one code
    path for tests and sweeps); on CUDA below compute capability 8.0 it is unsupported.
    """

    name = "tf32"
    exact = False
    tolerance = {"rtol": 2e-2, "atol": 1e-4}
    stage = 0

    def __init__(self, conv: bool = True, matmul: bool = True) -> None:
        self.conv, self.matmul = conv, matmul

    def flags(self) -> dict[str, Any]:
        return {k: v for k, v in TF32.items() if (self.conv if "conv" in k else self.matmul)}

    def supported(self, device: DeviceInfo | torch.device | str | None) -> tuple[bool, str]:
        return cuda_capability_at_least(DeviceInfo.of(device), 8, "TF32")

    def options(self) -> dict[str, Any]:
        return {"conv": self.conv, "matmul": self.matmul}
