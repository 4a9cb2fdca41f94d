"""Reverse-process samplers: the contract and the sampling loop (:mod:`.base`), one module per sampler family,
the table of names the configs use (:mod:`.registry`) and the Align-Your-Steps step search (:mod:`.search`)."""

from med_ddpm.samplers.base import (
    SPACINGS,
    FewStepSampler,
    Sampler,
    StepOutput,
    make_timesteps,
    model_input,
    sample,
)
from med_ddpm.samplers.ddim import DDIMSampler
from med_ddpm.samplers.ddpm import DDPMSampler
from med_ddpm.samplers.deis import DEISSampler
from med_ddpm.samplers.dpm_solver import DPMSolverPPSampler
from med_ddpm.samplers.registry import (
    SAMPLERS,
    build_sampler,
    check_sampler,
    sampler_from_config,
    sampler_options,
)
from med_ddpm.samplers.restart_sampler import RestartSampler
from med_ddpm.samplers.sa_solver import SASolverSampler

__all__ = [
    "SAMPLERS", "SPACINGS", "DDIMSampler", "DDPMSampler", "DEISSampler", "DPMSolverPPSampler", "FewStepSampler",
    "RestartSampler", "SASolverSampler", "Sampler", "StepOutput", "build_sampler", "check_sampler", "make_timesteps",
    "model_input", "sample", "sampler_from_config", "sampler_options",
]
