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
