"""torch's out-of-the-box numerics: the ones the original Med-DDPM code runs with.

PyTorch ships cuDNN convolutions with TF32 on, matmuls in IEEE fp32 and ``cudnn.benchmark`` off. The original
Med-DDPM sets none of these, so its published speed is this configuration, not the project's strict-FP32
baseline (which turns conv TF32 off). As a recipe it is a second measured baseline: every speed-up can be read
against what a user of the original code sees, in the same run.

Only the ``fp32_precision`` API is written (as :mod:`optim.tf32` does); the values are set explicitly rather than
left to torch, so a process that changed them earlier still measures the defaults.

Example:
    >>> with torch_defaults_enabled():
    ...     y = model(x)          # convs may use TF32 on an A100/H100/H200; matmuls stay IEEE fp32
"""

from __future__ import annotations

import contextlib
from typing import Any

from optim.base import Capabilities, Recipe
from optim.flags import set_flags

TORCH_DEFAULTS: dict[str, Any] = {"cudnn.conv.fp32_precision": "tf32", "cuda.matmul.fp32_precision": "ieee",
                                  "cudnn.benchmark": False}


def torch_defaults_enabled() -> contextlib.AbstractContextManager[None]:
    """Functional twin: torch's default conv/matmul precision and cuDNN algorithm choice for the block, restored
    on exit."""
    return set_flags(TORCH_DEFAULTS)


class TorchDefaults(Recipe):
    """torch's default numerics for the session: conv TF32 on, matmul IEEE, ``cudnn.benchmark`` off.

    Any GPU runs it: below compute capability 8.0 cuDNN has no TF32 and the convolutions stay IEEE fp32, which is
    what torch's defaults give there too. On CPU no kernel reads the flags (inert).
    """

    name = "torch_defaults"
    capabilities = Capabilities(exact=False, tolerance={"rtol": 2e-2, "atol": 1e-4}, flags=TORCH_DEFAULTS,
                                acts_on=("cuda",))
