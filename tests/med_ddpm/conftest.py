"""The samplers' closed-form toy problem, shared by the sampler tests.

x₀ ~ N(μ, s²) in 1-D. The exact ε-predictor is analytic, ε*(x_t, t) = √(1−ᾱ)(x_t − √ᾱ·μ)/(ᾱ·s² + 1 − ᾱ), and
the probability-flow ODE is affine: x_t = √ᾱ_t·μ + √(ᾱ_t·s² + 1 − ᾱ_t)·z keeps z fixed. So the exact endpoint of
every deterministic sampler is known in closed form, and no network is needed.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.samplers import build_sampler

CONFIGS = Path(__file__).parents[2] / "configs" / "sampler"
TOY_DATA = (0.2, 0.3)  # μ, s of the toy data distribution N(μ, s²) in the distribution tests
T = 250


@pytest.fixture(scope="module")
def schedule() -> NoiseSchedule:
    return NoiseSchedule(T)


class GaussianToy:
    """x₀ ~ N(μ, s²): the exact ε-predictor and the exact ODE map, in float64."""

    def __init__(self, schedule: NoiseSchedule, mu: float, s: float):
        self.abar = schedule.alphas_cumprod.double()
        self.mu, self.s = mu, s

    def eps(self, x: torch.Tensor, t: int) -> torch.Tensor:
        a = float(self.abar[t])
        return math.sqrt(1 - a) * (x - math.sqrt(a) * self.mu) / (a * self.s**2 + 1 - a)

    def ode_endpoint(self, x_start: torch.Tensor, t_start: int, t_last: int) -> torch.Tensor:
        """Exact ODE solution from t_start to t_last, then x̂₀ = E[x₀ | x_{t_last}] (the final step)."""
        a0, a1, mu, s2 = float(self.abar[t_start]), float(self.abar[t_last]), self.mu, self.s**2
        z = (x_start - math.sqrt(a0) * mu) / math.sqrt(a0 * s2 + 1 - a0)
        x_last = math.sqrt(a1) * mu + math.sqrt(a1 * s2 + 1 - a1) * z
        return mu + s2 * math.sqrt(a1) / (a1 * s2 + 1 - a1) * (x_last - math.sqrt(a1) * mu)

    def run(self, sampler, x: torch.Tensor, noise: list[torch.Tensor] | None = None) -> torch.Tensor:
        for k, t in enumerate(sampler.timesteps.tolist()):
            z = noise[k] if noise is not None else None
            x = sampler.step(self.eps(x, t), t, x, noise=z).prev_sample
        return x


def ode_error(schedule, name: str, steps: int, x_T: torch.Tensor, toy: GaussianToy, **kw) -> float:
    sampler = build_sampler(name, schedule, steps, clip_denoised=False, spacing="linspace", **kw)
    x0 = toy.run(sampler, x_T)
    ref = toy.ode_endpoint(x_T, int(sampler.timesteps[0]), int(sampler.timesteps[-1]))
    return float((x0 - ref).abs().max())


def toy_moments(schedule, name: str, steps: int, seeds: int = 4, **kw) -> tuple[float, float]:
    """(mean − μ, std/s − 1) of a sampler on N(μ, s²) with exact ε, 4096 samples per seed, averaged."""
    mu, s = TOY_DATA
    toy = GaussianToy(schedule, mu, s)
    errors = []
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        sampler = build_sampler(name, schedule, steps, **kw)
        x_T = torch.randn(4096, generator=gen, dtype=torch.float64)
        noise = list(torch.randn(len(sampler.timesteps), 4096, generator=gen, dtype=torch.float64))
        x0 = toy.run(sampler, x_T, noise)
        errors.append((float(x0.mean()) - mu, float(x0.std()) / s - 1))
    return tuple(float(np.mean(e)) for e in zip(*errors))


def sde_moments(schedule, steps: int, seeds: int = 4, **kw) -> tuple[float, float]:
    """:func:`toy_moments` of SDE-DPM-Solver++."""
    return toy_moments(schedule, "dpm_solver_pp", steps, seeds, variant="sde", **kw)
