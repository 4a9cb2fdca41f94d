"""Every sampler by its config name (``configs/sampler/<name>.yaml``), and building one from a config node.

The table is the one place that names the samplers: a new sampler adds its module and one line here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from med_ddpm.config_checks import ConfigError, as_config_error, is_int
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.samplers.base import Sampler, check_options
from med_ddpm.samplers.ddim import DDIMSampler
from med_ddpm.samplers.ddpm import DDPMSampler
from med_ddpm.samplers.deis import DEISSampler
from med_ddpm.samplers.dpm_solver import DPMSolverPPSampler
from med_ddpm.samplers.restart_sampler import RestartSampler
from med_ddpm.samplers.sa_solver import SASolverSampler

SAMPLERS: dict[str, type[Sampler]] = {
    "ddpm": DDPMSampler,
    "ddim": DDIMSampler,
    "dpm_solver_pp": DPMSolverPPSampler,
    "deis": DEISSampler,
    "restart": RestartSampler,
    "sa_solver": SASolverSampler,
}


def build_sampler(name: str, schedule: NoiseSchedule, steps: int | None = None, **kwargs) -> Sampler:
    """Sampler by config name, with its timesteps set (``steps`` defaults to T, or to the length of an
    explicit ``timesteps`` grid)."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; known: {sorted(SAMPLERS)}")
    check_options(name, SAMPLERS[name], kwargs)
    sampler = SAMPLERS[name](schedule, **kwargs)  # its timesteps are set: T steps or the explicit grid
    if steps is not None:
        sampler.set_timesteps(steps)
    return sampler


def sampler_options(node: Mapping[str, Any]) -> dict[str, Any]:
    """A ``sampler`` config node's own options: everything but ``name``, ``steps`` and ``_target_``."""
    return {k: v for k, v in node.items() if k not in ("name", "steps", "_target_")}


def sampler_from_config(node: Mapping[str, Any], schedule: NoiseSchedule) -> Sampler:
    """A sampler from a ``sampler`` config node (``name``, ``steps`` and its own keys), timesteps set."""
    extra = sampler_options(node)
    return build_sampler(node["name"], schedule, node.get("steps"), **extra)


def check_sampler(sampler: DictConfig, diffusion: DictConfig, *, steps: bool = True) -> None:
    """Build the ``sampler`` node against the ``diffusion`` schedule: its steps and options are checked
    by the samplers' own constructors, and a refusal names the node and its config file.

    ``steps=False`` (med_ddpm.sample) checks only that ``sampler.steps`` is an integer: its range is that of the
    checkpoint's own schedule, checked when the checkpoint is loaded."""
    count = sampler.get("steps")
    if count is not None and not is_int(count):
        raise ConfigError(f"sampler.steps={count!r}: must be an integer (the number of sampling steps); "
                          "pass sampler.steps=N, e.g. sampler.steps=50")
    with as_config_error("sampler", f"see configs/sampler/{sampler.get('name')}.yaml for its options",
                         errors=(ValueError, TypeError)):
        sampler_from_config(sampler if steps else OmegaConf.merge(sampler, {"steps": None}),
                            NoiseSchedule.from_config(diffusion))
