"""DEIS (tAB-DEIS and iPNDM): multistep exponential integrators on ε."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.samplers.base import FewStepSampler, StepOutput, lagrange_exp_weights

AB_COEFFICIENTS = {1: (1.0,), 2: (3 / 2, -1 / 2), 3: (23 / 12, -16 / 12, 5 / 12)}


class DEISSampler(FewStepSampler):
    """DEIS multistep on ε (Zhang & Chen 2023): ``variant="tab"`` (tAB-DEIS) or ``"ipndm"``.

    The probability-flow ODE in y = x/α, ρ = σ/α is dy/dρ = ε(x, t) (the exponential-integrator
    form of Zhang & Chen, Sec. 3), so y_{t'} = y_t + ∫_{ρ_t}^{ρ_{t'}} ε dρ exactly. Both variants
    replace ε by the polynomial through the last ``order`` predictions: tAB fits it in v = log ρ = −λ and
    integrates exactly (:func:`lagrange_exp_weights`; the discrete schedule has no continuous t,
    so v plays the role of DEIS's t, as in diffusers' "logrho" DEIS); iPNDM uses the fixed
    equal-step Adams–Bashforth weights times Δρ. Lower orders warm the history up, and the
    last step (to ρ = 0) is first order, i.e. x̂₀. With clipping, ε is replaced by the ε implied
    by the clipped x̂₀, so history and output agree.
    """

    sequential = True

    def __init__(
        self,
        schedule: NoiseSchedule,
        order: int = 3,
        variant: str = "tab",
        clip_denoised: bool = True,
        spacing: str = "trailing",
        timesteps: Sequence[int] | None = None,
    ):
        if order not in AB_COEFFICIENTS:
            raise ValueError(f"sampler.order for deis must be in {sorted(AB_COEFFICIENTS)}; got {order}")
        if variant not in ("tab", "ipndm"):
            raise ValueError(f"sampler.variant for deis must be 'tab' or 'ipndm'; got {variant!r}")
        self.order, self.variant = order, variant
        super().__init__(schedule, clip_denoised, spacing, timesteps)

    def set_timesteps(self, num_inference_steps: int) -> None:
        super().set_timesteps(num_inference_steps)
        rho = [s / a for s, a in zip(self.sigma, self.alpha)]
        v = [math.log(r) if r > 0 else -math.inf for r in rho]
        self._weights = []  # x-space weights α_{t'}·w_j of ε_{k−j}
        for k in range(num_inference_steps - 1):
            q = min(self.order, k + 1)
            if self.variant == "tab":
                w = lagrange_exp_weights(v[k - q + 1 : k + 1][::-1], v[k], v[k + 1])
            else:
                w = [(rho[k + 1] - rho[k]) * c for c in AB_COEFFICIENTS[q]]
            self._weights.append([self.alpha[k + 1] * w_j for w_j in w])

    def reset_history(self) -> None:
        self._eps: list[torch.Tensor] = []  # newest first

    def step(self, model_output, t, x_t, *, noise=None, generator=None) -> StepOutput:
        k, pred_x0, last = self._multistep_start(model_output, t, x_t)
        if last:  # ρ_{t'} = 0: y_{t'} = y_t − ρ_t·ε = x̂₀
            return StepOutput(pred_x0, pred_x0)
        eps = (x_t - self.alpha[k] * pred_x0) / self.sigma[k] if self.clip_denoised else model_output
        self._eps = [eps, *self._eps][: self.order]
        prev = (self.alpha[k + 1] / self.alpha[k]) * x_t
        for w_j, eps_j in zip(self._weights[k], self._eps):
            prev = prev + w_j * eps_j
        return StepOutput(prev, pred_x0)
