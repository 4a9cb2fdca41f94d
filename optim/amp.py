"""Automatic mixed precision (bf16 / fp16 autocast) for forward + loss, plus the non-finite guard.

Autocast wraps only the forward pass and the loss (torchbench, nanoGPT): backward runs in the
dtypes autocast recorded and the optimiser updates fp32 master weights. fp16's narrow range
needs a ``GradScaler``; bf16 has fp32's range and needs none. A non-finite loss (overflow,
a bad batch) must skip the step rather than poison the weights and the EMA, so the training
loop asks :func:`finite_or_skip` (or the stack's counting guard) before ``backward``.

``fp32_modules`` keeps named modules out of autocast (an fp32 island, inputs cast up). The one that matters
for a diffusion denoiser is the first convolution, which reads x_t: at small t, x_t = sqrt(abar) x0 +
sqrt(1 - abar) eps (DDPM eq. 4) carries eps at an amplitude of about 0.014 (cosine schedule, T = 250, t = 0),
below bf16's 8-bit mantissa resolution on intensities near 1, so bf16 rounding of x_t erases part of the very
signal the network must read (``python -m bench.precision_attribution``, group ``input_conv``).

Example:
    >>> with autocast_for("bfloat16", "cuda"):
    ...     loss = diffusion_loss(model, schedule, x0, cond)
    >>> if finite_or_skip(loss):
    ...     loss.backward()
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from optim.base import Capabilities, Recipe, RecipeConflictError
from optim.forward_override import override_forward

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``/``"float16"`` (or the torch dtype) -> torch dtype; anything else raises."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise RecipeConflictError(f"amp dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


def autocast_for(dtype: str | torch.dtype, device_type: str = "cuda",
                 cache_enabled: bool = True) -> torch.autocast:
    """Functional twin: the autocast context for ``dtype`` on ``device_type`` (CPU works too)."""
    return torch.autocast(device_type, dtype=resolve_dtype(dtype), cache_enabled=cache_enabled)


def _fp32_island(forward: Callable[..., Any], device_type: str) -> Callable[..., Any]:
    def island(*args: Any, **kwargs: Any) -> Any:
        args = tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
        with torch.autocast(device_type, enabled=False):
            return forward(*args, **kwargs)
    return island


def keep_fp32(model: nn.Module, names: Sequence[str], device_type: str) -> list[str]:
    """Functional twin of ``fp32_modules``: run the named submodules outside autocast; returns the names."""
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise RecipeConflictError(f"amp fp32_modules: the model has no module {name!r} (names as in "
                                      "model.named_modules(), e.g. input_blocks.0.0 for the first convolution)") from None
        override_forward(module, functools.partial(_fp32_island, device_type=device_type))
    return list(names)


def finite_or_skip(loss: torch.Tensor) -> bool:
    """True when the loss is finite; False means: skip backward and the optimiser step.

    Costs one device->host sync per step (the price of not corrupting the weights).
    """
    return bool(torch.isfinite(loss.detach()).all())


class NonFiniteGuard:
    """:func:`finite_or_skip` that counts the steps it told the loop to skip.

    The guard protocol (:class:`optim.fused_adam.DeviceFiniteGuard` is the other guard):
    ``guard(loss, optimizer)`` says whether the loop runs backward and the optimiser step;
    ``skipped`` counts the steps skipped so far. This one reads the loss on the host and ignores
    the optimiser.
    """

    def __init__(self) -> None:
        self.skipped = 0

    def __call__(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer | None = None) -> bool:
        ok = finite_or_skip(loss)
        self.skipped += not ok
        return ok


class Amp(Recipe):
    """Autocast to ``dtype`` around forward + loss; fp16 adds a ``GradScaler``.

    The autocast device follows the model's parameters (recorded by ``prepare_model``), so bf16 runs
    on CPU and CUDA alike. fp16 is refused off CUDA: CPU float16 autocast has no fast kernels.
    """

    CAPABILITIES = {
        torch.bfloat16: Capabilities(exact=False, tolerance={"rtol": 1e-1, "atol": 1e-3}, stage=40, kind="amp",
                                     min_cuda_capability=8, requirement="bfloat16 autocast",
                                     fix="use amp_fp16 on this GPU"),
        torch.float16: Capabilities(exact=False, tolerance={"rtol": 2e-2, "atol": 1e-3}, stage=40, kind="amp",
                                    devices=("cuda",), min_cuda_capability=7, scales_loss=True,
                                    requirement="float16 autocast with tensor cores",
                                    fix="drop it, or use amp_bf16 on a CPU (float16 CPU autocast runs about 100x slower "
                                        "than float32)"),
    }
    NAMES = {torch.bfloat16: "amp_bf16", torch.float16: "amp_fp16"}

    def __init__(self, dtype: str = "bfloat16", cache_enabled: bool = True, fp32_modules: Sequence[str] = ()) -> None:
        self.dtype = resolve_dtype(dtype)
        self.name = self.NAMES[self.dtype]
        self.capabilities = self.CAPABILITIES[self.dtype]
        self.cache_enabled = cache_enabled
        self.fp32_modules = [str(n) for n in fp32_modules]
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"

    def prepare_model(self, model: nn.Module) -> nn.Module:
        param = next(model.parameters(), None)
        if param is not None:
            self.device_type = param.device.type
        keep_fp32(model, self.fp32_modules, self.device_type)
        return model

    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        return autocast_for(self.dtype, self.device_type, self.cache_enabled)

    def options(self) -> dict[str, Any]:
        return {"dtype": str(self.dtype).removeprefix("torch."), "cache_enabled": self.cache_enabled,
                "fp32_modules": self.fp32_modules}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "device_type": self.device_type}
