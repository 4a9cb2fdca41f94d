"""The training side of the diffusion maths: the noise schedule and the ε-prediction loss.

``NoiseSchedule`` keeps exactly the 13 float32 buffers the original ``GaussianDiffusion``
keeps (same names, same values: computed in numpy float64, then cast), so an original
state dict loads into it strictly and golden values match bit for bit.

Example:
    >>> schedule = NoiseSchedule(timesteps=250)
    >>> x_t = schedule.add_noise(x0, torch.randn_like(x0), t)
    >>> loss = diffusion_loss(net, schedule, x0, cond)   # L1 on ε, Med-DDPM's loss
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

BUFFER_NAMES = (
    "betas",
    "alphas_cumprod",
    "alphas_cumprod_prev",
    "sqrt_alphas_cumprod",
    "sqrt_one_minus_alphas_cumprod",
    "log_one_minus_alphas_cumprod",
    "sqrt_recip_alphas_cumprod",
    "sqrt_recipm1_alphas_cumprod",
    "posterior_variance",
    "posterior_log_variance_clipped",
    "posterior_mean_coef1",
    "posterior_mean_coef2",
    "posterior_mean_coef3",
)


def cosine_betas(timesteps: int, s: float = 0.008, max_beta: float = 0.999) -> np.ndarray:
    """Nichol & Dhariwal (2021) eq. 17: ᾱ(t) = cos²(((t/T) + s)/(1 + s) · π/2) / ᾱ(0), in float64.

    Written as Med-DDPM writes it (x = linspace(0, n, n) with n = T + 1, so x/n = i/T);
    β_t = 1 − ᾱ_{t+1}/ᾱ_t clipped to [0, max_beta]: the last β is exactly 0.999.
    """
    n = timesteps + 1
    x = np.linspace(0, n, n)
    alphas_cumprod = np.cos(((x / n) + s) / (1 + s) * math.pi * 0.5) ** 2
    alphas_cumprod = alphas_cumprod / alphas_cumprod[0]
    betas = 1 - (alphas_cumprod[1:] / alphas_cumprod[:-1])
    return np.clip(betas, a_min=0, a_max=max_beta)


def linear_betas(timesteps: int, beta_start: float = 1e-4, beta_end: float = 2e-2) -> np.ndarray:
    """Ho et al. (2020) linear schedule, scaled to ``timesteps`` like guided-diffusion."""
    scale = 1000 / timesteps
    return np.linspace(scale * beta_start, scale * beta_end, timesteps, dtype=np.float64)


SCHEDULES = {"cosine": cosine_betas, "linear": linear_betas}


def schedule_arrays(betas: np.ndarray) -> dict[str, np.ndarray]:
    """All 13 buffers of the original in float64 (Ho et al. 2020, eqs. 4, 6, 7)."""
    alphas = 1.0 - betas
    ac = np.cumprod(alphas, axis=0)
    ac_prev = np.append(1.0, ac[:-1])
    post_var = betas * (1.0 - ac_prev) / (1.0 - ac)  # eq. 7, β̃_t
    coef2 = (1.0 - ac_prev) * np.sqrt(alphas) / (1.0 - ac)
    return {
        "betas": betas,
        "alphas_cumprod": ac,
        "alphas_cumprod_prev": ac_prev,
        "sqrt_alphas_cumprod": np.sqrt(ac),
        "sqrt_one_minus_alphas_cumprod": np.sqrt(1.0 - ac),
        "log_one_minus_alphas_cumprod": np.log(1.0 - ac),
        "sqrt_recip_alphas_cumprod": np.sqrt(1.0 / ac),
        "sqrt_recipm1_alphas_cumprod": np.sqrt(1.0 / ac - 1),
        "posterior_variance": post_var,
        # log(max(var, 1e-20)): −46.05 at t = 0 (guided-diffusion copies var[1] instead).
        "posterior_log_variance_clipped": np.log(np.maximum(post_var, 1e-20)),
        "posterior_mean_coef1": betas * np.sqrt(ac_prev) / (1.0 - ac),
        "posterior_mean_coef2": coef2,
        "posterior_mean_coef3": 1.0 - coef2,  # only ever multiplied by 0, kept for strict loading
    }


def extract(buffer: torch.Tensor, t: torch.Tensor, ndim: int) -> torch.Tensor:
    """Gather ``buffer[t]`` and shape it (B, 1, 1, ...) to broadcast over a ``ndim`` tensor."""
    return buffer.gather(-1, t).reshape(t.shape[0], *((1,) * (ndim - 1)))


class NoiseSchedule(nn.Module):
    """The forward process q(x_t | x_0) and the posterior q(x_{t−1} | x_t, x_0) coefficients.

    Buffers are float32, like the original's; coefficients are gathered from them and
    multiplied in float32, which is what makes the golden trajectory reproducible.
    """

    def __init__(self, timesteps: int = 250, schedule: str = "cosine", cosine_s: float = 0.008):
        super().__init__()
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown beta schedule {schedule!r}; known: {sorted(SCHEDULES)}")
        betas = cosine_betas(timesteps, cosine_s) if schedule == "cosine" else SCHEDULES[schedule](timesteps)
        self.schedule = schedule
        self.cosine_s = cosine_s
        for name, value in schedule_arrays(betas).items():
            self.register_buffer(name, torch.tensor(value, dtype=torch.float32))

    @classmethod
    def from_config(cls, node: Mapping[str, Any] | None) -> NoiseSchedule:
        """From a ``diffusion`` config node (``timesteps``, ``schedule``, ``cosine_s``; Med-DDPM's defaults)."""
        node = node or {}
        return cls(node.get("timesteps", 250), node.get("schedule", "cosine"), node.get("cosine_s", 0.008))

    @property
    def num_train_timesteps(self) -> int:
        return int(self.betas.shape[0])

    @property
    def config(self) -> dict:
        return {"timesteps": self.num_train_timesteps, "schedule": self.schedule, "cosine_s": self.cosine_s}

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """q_sample, Ho et al. (2020) eq. 4: x_t = √ᾱ_t·x₀ + √(1−ᾱ_t)·ε."""
        return (
            extract(self.sqrt_alphas_cumprod, t, x0.dim()) * x0
            + extract(self.sqrt_one_minus_alphas_cumprod, t, x0.dim()) * noise
        )

    def predict_x0(self, x_t: torch.Tensor, t: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """x̂₀ = √(1/ᾱ_t)·x_t − √(1/ᾱ_t − 1)·ε (eq. 4 solved for x₀)."""
        return (
            extract(self.sqrt_recip_alphas_cumprod, t, x_t.dim()) * x_t
            - extract(self.sqrt_recipm1_alphas_cumprod, t, x_t.dim()) * eps
        )

    def posterior_mean(self, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """μ̃_t(x_t, x₀) = coef1·x₀ + coef2·x_t (Ho et al. 2020, eq. 7)."""
        return (
            extract(self.posterior_mean_coef1, t, x_t.dim()) * x0
            + extract(self.posterior_mean_coef2, t, x_t.dim()) * x_t
        )


LOSSES = {"l1": F.l1_loss, "l2": F.mse_loss}


def diffusion_loss(
    model: nn.Module,
    schedule: NoiseSchedule,
    x_start: torch.Tensor,
    cond: torch.Tensor,
    *,
    t: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    loss_type: str = "l1",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """ε-prediction loss with concat conditioning (Med-DDPM ``p_losses``).

    loss = mean |ε − ε_θ(cat[x_t, cond], t)| over all elements; t ~ U{0, T−1} and ε ~ N(0, I)
    per sample when not given (drawn in float32 on x_start's device).
    """
    if loss_type not in LOSSES:
        raise ValueError(f"unknown loss_type {loss_type!r}; known: {sorted(LOSSES)}")
    b, device = x_start.shape[0], x_start.device
    if t is None:
        t = torch.randint(0, schedule.num_train_timesteps, (b,), device=device, generator=generator)
    if noise is None:
        noise = torch.randn(x_start.shape, device=device, generator=generator, dtype=torch.float32)
    x_noisy = schedule.add_noise(x_start, noise, t)
    eps = model(torch.cat([x_noisy, cond], dim=1), t)
    return LOSSES[loss_type](eps.float(), noise.float())
