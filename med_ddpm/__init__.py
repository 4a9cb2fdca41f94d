"""Med-DDPM: mask-conditioned 3-D DDPM.

The public API, imported lazily (PEP 562) so that ``import med_ddpm`` and its light submodules
do not pull in torch:

    >>> import med_ddpm
    >>> loaded = med_ddpm.load_checkpoint("ema.pt")          # this project's or an original Med-DDPM file
    >>> sampler = med_ddpm.DDIMSampler(loaded.schedule); sampler.set_timesteps(25)
    >>> x0 = med_ddpm.sample(loaded.model, sampler, cond)
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_EXPORTS = {
    "load_checkpoint": "checkpoint",
    "save_medddpm_checkpoint": "checkpoint",
    "UNet3D": "model",
    "build_model": "model",
    "NoiseSchedule": "diffusion",
    "diffusion_loss": "diffusion",
    "Sampler": "samplers",
    "DDPMSampler": "samplers",
    "DDIMSampler": "samplers",
    "DPMSolverPPSampler": "samplers",
    "DEISSampler": "samplers",
    "RestartSampler": "restart",
    "SASolverSampler": "sa_solver",
    "build_sampler": "samplers",
    "sample": "samplers",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'med_ddpm' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"med_ddpm.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """Importing a submodule sets it as an attribute of its package, so ``import med_ddpm.sample`` (the
    sampling command) would replace the API's ``med_ddpm.sample`` function with that module. The
    package keeps its API names; the command stays ``sys.modules["med_ddpm.sample"]`` (``python -m
    med_ddpm.sample``, ``from med_ddpm.sample import run``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
