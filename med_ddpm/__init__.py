"""Med-DDPM: mask-conditioned 3-D DDPM.

The public API, imported on first use (PEP 562) so that ``import med_ddpm`` and its light submodules
do not pull in torch:

    >>> import med_ddpm
    >>> loaded = med_ddpm.load_checkpoint("ema.pt")          # this project's or an original Med-DDPM file
    >>> sampler = med_ddpm.DDIMSampler(loaded.schedule); sampler.set_timesteps(25)
    >>> x0 = med_ddpm.generate(loaded.model, sampler, cond)   # med_ddpm.samplers.sample

``med_ddpm.sample`` is the sampling command's module (``python -m med_ddpm.sample``), not a function.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {  # name -> (module, name there)
    "load_checkpoint": ("checkpoint", "load_checkpoint"),
    "save_medddpm_checkpoint": ("checkpoint", "save_medddpm_checkpoint"),
    "UNet3D": ("model", "UNet3D"),
    "build_model": ("model", "build_model"),
    "NoiseSchedule": ("diffusion", "NoiseSchedule"),
    "diffusion_loss": ("diffusion", "diffusion_loss"),
    "Sampler": ("samplers", "Sampler"),
    "DDPMSampler": ("samplers", "DDPMSampler"),
    "DDIMSampler": ("samplers", "DDIMSampler"),
    "DPMSolverPPSampler": ("samplers", "DPMSolverPPSampler"),
    "DEISSampler": ("samplers", "DEISSampler"),
    "RestartSampler": ("samplers", "RestartSampler"),
    "SASolverSampler": ("samplers", "SASolverSampler"),
    "build_sampler": ("samplers", "build_sampler"),
    "generate": ("samplers", "sample"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'med_ddpm' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(f"med_ddpm.{module}"), attribute)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
