"""DDPM's ancestral sampler: every training step, as Med-DDPM samples."""

from __future__ import annotations

import torch

from med_ddpm.config_checks import ConfigError
from med_ddpm.diffusion import extract
from med_ddpm.samplers.base import Sampler, StepOutput


class DDPMSampler(Sampler):
    """Ancestral DDPM (Ho et al. 2020, Alg. 2) exactly as Med-DDPM's ``p_sample``.

    x̂₀ = √(1/ᾱ_t)·x_t − √(1/ᾱ_t − 1)·ε, clamped to [−1, 1]; μ = coef1·x̂₀ + coef2·x_t;
    x_{t−1} = μ + exp(½·log β̃_t)·z for t > 0 and μ at t = 0 (fixed posterior variance).
    DDPM runs every training step; use DDIM / DPM-Solver++ / DEIS for fewer.
    """

    stochastic = True

    def set_timesteps(self, num_inference_steps: int) -> None:
        T = self.schedule.num_train_timesteps
        if num_inference_steps != T:
            raise ConfigError(
                f"sampler.steps={num_inference_steps}: DDPM samples all {T} training steps; "
                f"pass sampler.steps={T}, or sampler=ddim, dpm_solver_pp or deis for fewer steps"
            )
        self.num_inference_steps = T
        self.timesteps = torch.arange(T - 1, -1, -1)

    def step(self, model_output, t, x_t, *, noise=None, generator=None) -> StepOutput:
        tb = self._t_batch(t, x_t)
        pred_x0 = self._pred_x0(x_t, tb, model_output)
        mean = self.schedule.posterior_mean(pred_x0, x_t, tb)
        if int(t) == 0:
            return StepOutput(mean, pred_x0)
        noise = self._fresh_noise(noise, x_t, generator)
        std = torch.exp(0.5 * extract(self.schedule.posterior_log_variance_clipped, tb, x_t.dim()))
        return StepOutput(mean + std * noise, pred_x0)
