"""DDIM: the few-step sampler of Song et al. 2021, deterministic at η = 0."""

from __future__ import annotations

import math
from collections.abc import Sequence

from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.samplers.base import FewStepSampler, StepOutput


class DDIMSampler(FewStepSampler):
    """DDIM (Song et al. 2021, eq. 12), with σ_t(η) of eq. 16; η = 0 is the deterministic ODE sampler.

    x_{t'} = √ᾱ_{t'}·x̂₀ + √(1 − ᾱ_{t'} − σ²)·ε + σ·z,  σ = η·√((1−ᾱ_{t'})/(1−ᾱ_t))·√(1 − ᾱ_t/ᾱ_{t'}),
    with t' the next grid point (ᾱ_{t'} = 1 after the last). The direction term uses the model's
    ε, not the ε implied by the clipped x̂₀, like MONAI's and the original DDIM code. With
    η = 1 on all T steps, σ² is DDPM's β̃_t and the step is DDPM's up to the clipping.
    """

    def __init__(
        self, schedule: NoiseSchedule, eta: float = 0.0, clip_denoised: bool = True, spacing: str = "trailing",
        timesteps: Sequence[int] | None = None,
    ):
        if eta < 0:
            raise ValueError(f"sampler.eta must be >= 0; got {eta}")
        self.eta = float(eta)
        self.stochastic = self.eta > 0
        super().__init__(schedule, clip_denoised, spacing, timesteps)

    def noise_std(self, k: int) -> float:
        a_t, a_prev = self.abar[k], self.abar[k + 1]
        return self.eta * math.sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))  # eq. 16

    def step(self, model_output, t, x_t, *, noise=None, generator=None) -> StepOutput:
        k = self._index(t)
        a_prev = self.abar[k + 1]
        pred_x0 = self._x0(x_t, model_output, k)
        std = self.noise_std(k)
        prev = math.sqrt(a_prev) * pred_x0 + math.sqrt(max(1 - a_prev - std**2, 0.0)) * model_output
        if std > 0:
            noise = self._fresh_noise(noise, x_t, generator)
            prev = prev + std * noise
        return StepOutput(prev, pred_x0)
