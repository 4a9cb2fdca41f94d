"""SA-Solver (Xue et al. 2023, "SA-Solver: Stochastic Adams Solver for Fast Sampling of Diffusion Models").

A stochastic multistep predictor-corrector in the data-prediction form. The reverse SDEs of a VP diffusion form
a family with noise scale τ (τ = 0: the probability-flow ODE; τ = 1: the reverse SDE that SDE-DPM-Solver++
solves), and for a constant τ on a step from s to t the variation-of-constants solution is (Xue et al., the
data-prediction form; c = 1 + τ² and λ = log α − log σ)

    x_t = (σ_t/σ_s)·e^{−τ²h}·x_s + σ_t·e^{−τ²λ_t}·∫_{cλ_s}^{cλ_t} e^{v}·x̂₀(v/c) dv + σ_t·√(1 − e^{−2τ²h})·ξ,

h = λ_t − λ_s. The integral is taken exactly over the Lagrange polynomial in λ through recent x̂₀
(:func:`med_ddpm.samplers.base.lagrange_exp_weights` on the nodes cλ):

* the predictor (stochastic Adams-Bashforth, ``predictor_order`` nodes) extrapolates the last x̂₀ to step from
  the current point to the next grid point;
* the corrector (stochastic Adams-Moulton, ``corrector_order`` nodes, 0: off) redoes the previous step once the
  model has seen the predicted point, now interpolating with that point's x̂₀, and with the same ξ. It costs no
  model call: the next prediction starts from the corrected point with the x̂₀ the model gave at the predicted
  one (the UniPC trick, Zhao et al. 2023).

With ``predictor_order=1`` and no corrector, τ = 0 is DPM-Solver++(1) and τ = 1 SDE-DPM-Solver++(1), step for
step; with ``predictor_order=3`` it integrates the same quadratic as DPM-Solver++(3M) from the third step on (the
second integrates the line through two x̂₀ exactly, where DPM-Solver++(2M) uses its 1/(2r) form). Fresh noise
washes out the model's ε error at high t as in SDE-DPM-Solver++ (docs/samplers.md), and the corrector raises the
order of each step by one on a smooth problem. The last step goes to σ = 0 and returns x̂₀, as the other few-step solvers do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from med_ddpm.config_checks import check_int_value, check_number_value
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.samplers.base import FewStepSampler, StepOutput, lagrange_exp_weights

MAX_ORDER = 3


class SASolverSampler(FewStepSampler):
    """SA-Solver with a constant noise scale ``tau`` (module docstring for the maths)."""

    sequential = True

    def __init__(self, schedule: NoiseSchedule, tau: float = 1.0, predictor_order: int = 2, corrector_order: int = 2,
                 clip_denoised: bool = True, spacing: str = "trailing", timesteps: Sequence[int] | None = None):
        self.tau = check_number_value("sampler.tau", tau, 0.0, 2.0)
        self.predictor_order = check_int_value("sampler.predictor_order", predictor_order, 1, MAX_ORDER)
        self.corrector_order = check_int_value("sampler.corrector_order", corrector_order, 0, MAX_ORDER,
                                               " (0: no corrector)")
        self.stochastic = self.tau > 0
        super().__init__(schedule, clip_denoised, spacing, timesteps)

    def set_timesteps(self, num_inference_steps: int) -> None:
        super().set_timesteps(num_inference_steps)
        last = num_inference_steps - 1  # step `last` returns x̂₀: no update is built for it
        # step k: predict k -> k+1 extrapolating from x̂₀_k; correct k-1 -> k interpolating up to x̂₀_k
        self._predict = [self._update(k, k + 1, k, min(self.predictor_order, k + 1)) for k in range(last)]
        self._correct = [None, *(self._update(k - 1, k, k, min(self.corrector_order, k + 1))
                                 for k in range(1, last))] if self.corrector_order else []

    def _update(self, s: int, t: int, newest: int, order: int) -> tuple[float, list[float], float]:
        """(decay of x_s, weights of x̂₀ at grid points ``newest``, ``newest`` − 1, ..., noise std) of the step
        from grid point s to t with the polynomial through ``order`` of those x̂₀ (module docstring)."""
        c, tau2 = 1.0 + self.tau**2, self.tau**2
        h = self.lam[t] - self.lam[s]
        nodes = [c * self.lam[newest - j] for j in range(order)]
        weights = lagrange_exp_weights(nodes, c * self.lam[s], c * self.lam[t])
        scale = self.sigma[t] * math.exp(-tau2 * self.lam[t])
        return (self.sigma[t] / self.sigma[s] * math.exp(-tau2 * h), [scale * w for w in weights],
                self.sigma[t] * math.sqrt(-math.expm1(-2 * tau2 * h)))

    def reset_history(self) -> None:
        self._x0s: list[torch.Tensor] = []  # x̂₀ of the steps so far, newest first
        self._previous: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (x before the last step, its ξ)

    def noise_std(self, k: int) -> float:
        return self._predict[k][2] if k < self.num_inference_steps - 1 else 0.0

    @staticmethod
    def _apply(update: tuple[float, list[float], float], x: torch.Tensor, x0s: list[torch.Tensor],
               noise: torch.Tensor | None) -> torch.Tensor:
        decay, weights, std = update
        out = decay * x
        for w, x0 in zip(weights, x0s):
            out = out + w * x0
        return out + std * noise if noise is not None else out

    def step(self, model_output, t, x_t, *, noise=None, generator=None) -> StepOutput:
        k, pred_x0, last = self._multistep_start(model_output, t, x_t)
        if last:
            return StepOutput(pred_x0, pred_x0)
        x0s = [pred_x0, *self._x0s]
        if self._previous is not None and self.corrector_order:  # redo the step that led here, now with x̂₀_k
            x_t = self._apply(self._correct[k], self._previous[0], x0s, self._previous[1])
        xi = self._fresh_noise(noise, x_t, generator) if self.stochastic else None
        prev = self._apply(self._predict[k], x_t, x0s, xi)
        self._x0s, self._previous = x0s[: MAX_ORDER], (x_t, xi)
        return StepOutput(prev, pred_x0)
