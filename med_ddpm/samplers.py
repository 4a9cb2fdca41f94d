"""Reverse-process samplers (diffusers-style contract) and the one sampling loop.

A sampler turns the network's ε prediction at step t into x_{t−1}; it never sees the
network. :func:`sample` is the only place where network and sampler meet.

Contract (shared by every sampler, so tests and bench treat them alike)::

    sampler.set_timesteps(n)                 # choose n reverse steps
    for t in sampler.timesteps:              # descending training timesteps
        out = sampler.step(eps, t, x_t, noise=z)   # -> StepOutput(prev_sample, pred_x0)

Example:
    >>> sampler = DDPMSampler(NoiseSchedule(250))
    >>> x0 = sample(net, sampler, cond, generator=torch.Generator().manual_seed(0))
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from med_ddpm.diffusion import NoiseSchedule, extract
from med_ddpm.errors import ConfigError


@dataclass
class StepOutput:
    """What a reverse step returns: x_{t−1} and the clipped x̂₀ estimate it used."""

    prev_sample: torch.Tensor
    pred_x0: torch.Tensor


class Sampler:
    """Base of the reverse-process samplers over a trained :class:`NoiseSchedule`.

    Subclasses implement :meth:`set_timesteps` and :meth:`step`. ``stochastic`` says whether
    a step consumes fresh noise (ancestral samplers) so a caller can supply it.
    """

    stochastic: bool = False

    def __init__(self, schedule: NoiseSchedule, clip_denoised: bool = True):
        self.schedule = schedule
        self.clip_denoised = clip_denoised
        self.timesteps = torch.arange(schedule.num_train_timesteps - 1, -1, -1)
        self.num_inference_steps = schedule.num_train_timesteps

    def set_timesteps(self, num_inference_steps: int) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def step(
        self,
        model_output: torch.Tensor,
        t: int | torch.Tensor,
        x_t: torch.Tensor,
        *,
        noise: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> StepOutput:  # pragma: no cover - interface
        raise NotImplementedError

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Forward process q(x_t | x₀), so a caller can start a chain mid-way (e.g. SDEdit)."""
        return self.schedule.add_noise(x0, noise, t)

    @staticmethod
    def _fresh_noise(noise: torch.Tensor | None, x_t: torch.Tensor,
                     generator: torch.Generator | None) -> torch.Tensor:
        """The caller's step noise z, or a fresh N(0, I) draw like x_t from ``generator``."""
        if noise is not None:
            return noise
        return torch.randn(x_t.shape, generator=generator, device=x_t.device, dtype=x_t.dtype)

    def _t_batch(self, t: int | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.full((x.shape[0],), int(t), device=x.device, dtype=torch.long)

    def _pred_x0(self, x_t: torch.Tensor, tb: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        x0 = self.schedule.predict_x0(x_t, tb, eps)
        return x0.clamp(-1.0, 1.0) if self.clip_denoised else x0


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


SPACINGS = ("linspace", "leading", "trailing", "quadratic")


def strictly_descending(ts: np.ndarray, num_train_timesteps: int) -> np.ndarray:
    """Rounded grid points made strictly descending within [0, T−1], each moved as little as needed.

    Where points are denser than the training steps (``quadratic`` near t = 0), collisions are
    pushed up one step at a time from the end, then capped from the top; with n ≤ T this always
    gives n distinct steps, and n = T gives T−1, ..., 0.
    """
    ts = ts.astype(np.int64)
    for k in range(len(ts) - 2, -1, -1):
        ts[k] = max(ts[k], ts[k + 1] + 1)
    ts[0] = min(ts[0], num_train_timesteps - 1)
    for k in range(1, len(ts)):
        ts[k] = min(ts[k], ts[k - 1] - 1)
    return ts


def make_timesteps(
    num_train_timesteps: int, num_inference_steps: int, spacing: str = "trailing"
) -> torch.Tensor:
    """``num_inference_steps`` descending int64 training timesteps for a few-step sampler.

    Every sampler's last step goes from the last grid point to clean data (ᾱ = 1), returning x̂₀.

    - ``trailing`` (default): round(T·(n−i)/n) − 1, i = 0..n−1 (Lin et al. 2024, Table 2): evenly
      spaced, starts at T−1, where the cosine schedule's ᾱ is ~4e-8 (x_T ~ N(0, I) really lives
      there), ends at T/n − 1. It skips the steep λ(t) near t = 0 (λ jumps 4.27 → 1.78 over
      t = 0..24), where multistep extrapolation overshoots at few steps. The price: the final x̂₀
      is a posterior mean at t = T/n − 1 (t = 4 at 50 steps), a little smoother than a sample.
    - ``linspace``: round(linspace(T−1, 0, n)), the grid MONAI's DDIM ``set_timesteps`` builds.
    - ``leading``: (0, T//n, 2·T//n, ...) reversed, DDIM's original grid; never visits T−1.
    - ``quadratic``: round(linspace(√(T−1), 0, n)²), made distinct (:func:`strictly_descending`):
      DDIM's "quad" and DPM-Solver's "time_quadratic" grids. Starts at T−1 like ``trailing`` but
      puts more of its steps at low noise and ends at t = 0, so the last x̂₀ is not a posterior mean at
      t = T/n − 1. (Uniform-λ grids are no option for this cosine schedule: its clipped last
      step has λ = −8.5 against −5.1 one step earlier, so they spend several steps at t ≥ 246.)

    For n = T all four are T−1, ..., 0. For n dividing T, ``trailing`` and ``leading`` are
    evenly spaced by T//n, the step MONAI's DDIM ``step`` assumes.
    """
    T, n = num_train_timesteps, num_inference_steps
    if not 1 <= n <= T:
        raise ConfigError(f"sampler.steps={n}: must be in [1, {T}] (the training timesteps); "
                          f"pass sampler.steps=N with 1 <= N <= {T}")
    if spacing == "linspace":
        ts = np.linspace(T - 1, 0, n).round()
    elif spacing == "leading":
        ts = (np.arange(n) * (T // n))[::-1]
    elif spacing == "trailing":
        ts = np.round(np.arange(n, 0, -1) * T / n) - 1
    elif spacing == "quadratic":
        ts = strictly_descending(np.round(np.linspace(math.sqrt(T - 1), 0.0, n) ** 2), T)
    else:
        raise ValueError(f"unknown timestep spacing {spacing!r}; known: {list(SPACINGS)}")
    return torch.from_numpy(ts.astype(np.int64).copy())


def explicit_timesteps(timesteps: Sequence[Any], num_train_timesteps: int) -> torch.Tensor:
    """A user's own grid (``sampler.timesteps=[249, 200, ...]``), e.g. one searched by
    ``med_ddpm.step_search``: integers, strictly decreasing, within [0, T−1]."""
    T, ts = num_train_timesteps, list(timesteps)
    ints = all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in ts)
    if not ts or not ints or any(a <= b for a, b in zip(ts, ts[1:])) or ts[0] > T - 1 or ts[-1] < 0:
        raise ConfigError(f"sampler.timesteps={ts}: must be strictly decreasing integers in [0, {T - 1}]; "
                          f"pass e.g. sampler.timesteps=[{T - 1},{T // 2},0], or sampler.timesteps=null for the spacing")
    return torch.tensor(ts, dtype=torch.int64)


class FewStepSampler(Sampler):
    """Base of the samplers that skip training steps (DDIM, DPM-Solver++, DEIS, SA-Solver).

    ``set_timesteps`` builds float64 tables of ᾱ on the grid, with ᾱ = 1 (clean data) appended
    as the target of the last step, so step k maps x at ``timesteps[k]`` to x at the next grid
    point. Coefficients are Python floats, computed once in float64 from the float32 buffers,
    and applied to float32 tensors: no device syncs in ``step`` and no 1/α_t ~ 5e3 blow-up of
    float32 rounding at t = T−1. Multistep history lives here and is reset by ``set_timesteps``.
    """

    sequential: bool = False  # multistep solvers must see the grid in order

    def __init__(self, schedule: NoiseSchedule, clip_denoised: bool = True, spacing: str = "trailing",
                 timesteps: Sequence[int] | None = None):
        super().__init__(schedule, clip_denoised)
        self.spacing = spacing
        T = schedule.num_train_timesteps
        self.explicit = None if timesteps is None else explicit_timesteps(timesteps, T)
        self.set_timesteps(T if self.explicit is None else len(self.explicit))

    def set_timesteps(self, num_inference_steps: int) -> None:
        """The grid of ``num_inference_steps`` points: the explicit ``timesteps`` if given (then its
        length must be ``num_inference_steps``), else ``make_timesteps`` with this sampler's spacing."""
        T = self.schedule.num_train_timesteps
        if self.explicit is None:
            self.timesteps = make_timesteps(T, num_inference_steps, self.spacing)
        elif num_inference_steps == len(self.explicit):
            self.timesteps = self.explicit
        else:
            raise ConfigError(f"sampler.steps={num_inference_steps}: sampler.timesteps lists {len(self.explicit)} "
                              f"steps; pass sampler.steps={len(self.explicit)}")
        self.num_inference_steps = num_inference_steps
        ac = self.schedule.alphas_cumprod.detach().double().cpu()
        self.abar = [float(ac[t]) for t in self.timesteps] + [1.0]
        self.alpha = [math.sqrt(a) for a in self.abar]  # α_t = √ᾱ_t
        self.sigma = [math.sqrt(1.0 - a) for a in self.abar]  # σ_t = √(1 − ᾱ_t)
        self.lam = [0.5 * (math.log(a) - math.log1p(-a)) if a < 1 else math.inf for a in self.abar]  # λ = log α/σ
        self._position = {int(t): k for k, t in enumerate(self.timesteps)}
        self.rewind()

    def rewind(self) -> None:
        """Start a new chain on the same grid: the first timestep next, no multistep state."""
        self._next_k = 0
        self.reset_history()

    def reset_history(self) -> None:
        """Forget multistep state (nothing to forget for one-step samplers)."""

    def noise_std(self, k: int) -> float:
        """Std of the fresh noise step k adds (0: a deterministic step); the step is x' = m + std·z."""
        return 0.0

    def _index(self, t: int | torch.Tensor) -> int:
        """Position k of timestep t on the grid; multistep solvers also check the order."""
        k = self._position.get(int(t))
        if k is None:
            raise ValueError(f"timestep {int(t)} is not on this sampler's grid {self.timesteps.tolist()}")
        if self.sequential and k != self._next_k:
            raise ValueError(
                f"{type(self).__name__} is multistep: expected timestep {int(self.timesteps[self._next_k])} "
                f"next, got {int(t)}; call set_timesteps() to restart the chain"
            )
        self._next_k = (k + 1) % self.num_inference_steps
        return k

    def _x0(self, x_t: torch.Tensor, eps: torch.Tensor, k: int) -> torch.Tensor:
        """x̂₀ = (x_t − σ_t·ε)/α_t (Ho et al. 2020, eq. 4 solved for x₀), clamped to [−1, 1] if asked."""
        x0 = (x_t - self.sigma[k] * eps) / self.alpha[k]
        return x0.clamp(-1.0, 1.0) if self.clip_denoised else x0

    def _multistep_start(self, model_output: torch.Tensor, t: int | torch.Tensor,
                         x_t: torch.Tensor) -> tuple[int, torch.Tensor, bool]:
        """(k, x̂₀, last) of a multistep solver's step: on the last step, to σ = 0 where x_{t'} = x̂₀ (the
        lower-order final step), the history is reset for the next chain."""
        k = self._index(t)
        last = k == self.num_inference_steps - 1
        if last:
            self.reset_history()
        return k, self._x0(x_t, model_output, k), last


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


def lagrange_exp_weights(nodes: Sequence[float], a: float, b: float) -> list[float]:
    """∫_a^b ℓ_j(v)·e^v dv for each Lagrange basis polynomial ℓ_j on ``nodes`` (newest first).

    These are the tAB-DEIS weights in the time variable v = log ρ (ρ = σ/α), where dρ = e^v dv, and the
    DPM-Solver++(3M) weights in v = λ (ODE) or v = 2λ (SDE). Exact for polynomials:
    ∫ p(v)·e^v dv = e^v·Σ_m (−1)^m·p^{(m)}(v).
    """
    weights = []
    for j, v_j in enumerate(nodes):
        others = [v for i, v in enumerate(nodes) if i != j]
        ell = np.poly1d(others, r=True) / np.prod([v_j - v for v in others])

        def antiderivative(v: float, ell=ell) -> float:
            return math.exp(v) * sum((-1) ** m * np.polyder(ell, m)(v) for m in range(ell.order + 1))

        weights.append(float(antiderivative(b) - antiderivative(a)))
    return weights


class DPMSolverPPSampler(FewStepSampler):
    """DPM-Solver++(2M) / (3M), multistep, data prediction (Lu et al. 2022b, Alg. 2) on the trained schedule.

    λ_t = log α_t − log σ_t from the discrete ᾱ; with h = λ_{t'} − λ_t and r = h_prev/h,
    x_{t'} = (σ_{t'}/σ_t)·x_t − α_{t'}·(e^{−h} − 1)·D,  D = (1 + 1/2r)·x̂₀_t − (1/2r)·x̂₀_prev
    (D = x̂₀_t on the first step: DPM-Solver++(1), which equals DDIM η = 0). The last step goes
    to σ = 0, λ = ∞, where the update reduces to x̂₀ (the lower-order final step; 2nd order is
    undefined there). ``clip_denoised`` clamps x̂₀ to [−1, 1] (Med-DDPM's clipping; the paper's
    dynamic thresholding with ratio 1 on data in [−1, 1]).

    ``order=3`` (3M) uses, from the third step on, the exact variation-of-constants form
    (Lu et al. 2022b, eq. 8) x_{t'} = (σ_{t'}/σ_t)·x_t + σ_{t'}·∫_{λ_t}^{λ_{t'}} e^{λ}·x̂₀(λ) dλ with x̂₀(λ)
    the quadratic through the last three x̂₀, integrated exactly (:func:`lagrange_exp_weights`; the
    multistep exponential integrator of DEIS, here on x̂₀ in λ). Steps 1 and 2 are the (1) and (2M) steps.

    ``variant="sde"`` is SDE-DPM-Solver++ (Lu et al. 2022b, Sec. 4 / App. B; diffusers'
    "sde-dpmsolver++"): the exponential integrator of the reverse SDE, with fresh noise z each step,
    x_{t'} = (σ_{t'}/σ_t)·e^{−h}·x_t + α_{t'}·(1 − e^{−2h})·D + σ_{t'}·√(1 − e^{−2h})·z, and for 3M
    2α_{t'}·∫ e^{−2(λ_{t'}−λ)}·x̂₀(λ) dλ = (σ_{t'}²/α_{t'})·∫_{2λ_t}^{2λ_{t'}} e^{v}·x̂₀(v/2) dv in place of the D term.
    Why it exists: the ODE carries the model's ε error, amplified by σ_t/α_t into x̂₀ at high t,
    forward as image content, while fresh noise lets later, more accurate predictions wash it out.
    On the quality model (ε error ~3.5 % at t ≥ 200) the ODE samplers leave voxel noise that even
    250 DDIM η = 0 steps keep, and fail an N = 4 quality gate at 10-100 steps; the SDE 2M variant's
    voxel noise is at DDPM-250's level from 25 steps, and at 100 steps it passes the N = 32 gate
    (docs/quality.md); fewer steps and 3M have no N = 32 verdict (docs/samplers.md).
    """

    sequential = True

    def __init__(self, schedule: NoiseSchedule, order: int = 2, variant: str = "ode",
                 clip_denoised: bool = True, spacing: str = "trailing", timesteps: Sequence[int] | None = None):
        if order not in (1, 2, 3):
            raise ValueError(f"sampler.order for dpm_solver_pp must be 1, 2 or 3; got {order}")
        if variant not in ("ode", "sde"):
            raise ValueError(f"sampler.variant for dpm_solver_pp must be 'ode' or 'sde'; got {variant!r}")
        self.order, self.variant = order, variant
        self.stochastic = variant == "sde"
        super().__init__(schedule, clip_denoised, spacing, timesteps)

    def set_timesteps(self, num_inference_steps: int) -> None:
        super().set_timesteps(num_inference_steps)
        third = range(2, num_inference_steps - 1) if self.order == 3 else ()
        self._third = {k: self._third_order_weights(k) for k in third}

    def _third_order_weights(self, k: int) -> list[float]:
        """x-space weights of x̂₀_k, x̂₀_{k−1}, x̂₀_{k−2} in the 3M step k (class docstring)."""
        nodes = self.lam[k - 2 : k + 1][::-1]
        if self.variant == "ode":
            w = lagrange_exp_weights(nodes, self.lam[k], self.lam[k + 1])
            return [self.sigma[k + 1] * w_j for w_j in w]
        w = lagrange_exp_weights([2 * v for v in nodes], 2 * self.lam[k], 2 * self.lam[k + 1])
        return [self.sigma[k + 1] ** 2 / self.alpha[k + 1] * w_j for w_j in w]

    def reset_history(self) -> None:
        self._x0s: list[torch.Tensor] = []  # x̂₀ of the previous steps, newest first

    def noise_std(self, k: int) -> float:
        if self.variant == "ode" or k == self.num_inference_steps - 1:
            return 0.0
        return self.sigma[k + 1] * math.sqrt(-math.expm1(-2 * (self.lam[k + 1] - self.lam[k])))

    def step(self, model_output, t, x_t, *, noise=None, generator=None) -> StepOutput:
        k, pred_x0, last = self._multistep_start(model_output, t, x_t)
        if last:
            return StepOutput(pred_x0, pred_x0)
        h = self.lam[k + 1] - self.lam[k]
        decay = self.sigma[k + 1] / self.sigma[k] * (1.0 if self.variant == "ode" else math.exp(-h))
        if self.order == 3 and len(self._x0s) >= 2:
            prev = decay * x_t
            for w_j, x0_j in zip(self._third[k], [pred_x0, *self._x0s]):
                prev = prev + w_j * x0_j
        else:
            d = pred_x0
            if self.order >= 2 and self._x0s:
                c = 0.5 * h / (self.lam[k] - self.lam[k - 1])  # 1/(2r)
                d = (1 + c) * pred_x0 - c * self._x0s[0]
            gain = -math.expm1(-h) if self.variant == "ode" else -math.expm1(-2 * h)
            prev = decay * x_t + self.alpha[k + 1] * gain * d
        if self.variant == "sde":
            prev = prev + self.noise_std(k) * self._fresh_noise(noise, x_t, generator)
        self._x0s = [pred_x0, *self._x0s][:2]
        return StepOutput(prev, pred_x0)


# Adams–Bashforth weights for equal steps, newest first (iPNDM's; Zhang & Chen 2023, App.)
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


SAMPLERS: dict[str, type[Sampler]] = {  # med_ddpm.restart adds "restart" (it wraps these), med_ddpm.sa_solver "sa_solver"
    "ddpm": DDPMSampler,
    "ddim": DDIMSampler,
    "dpm_solver_pp": DPMSolverPPSampler,
    "deis": DEISSampler,
}


def check_options(name: str, options: Mapping[str, Any]) -> None:
    """Refuse the options sampler ``name`` does not take, typically set by an experiment for another sampler
    (``experiment=fast_sample`` sets ``sampler.variant``), with the override that drops them. A sampler that
    passes options on (``restart``, to its base) checks them there."""
    params = inspect.signature(SAMPLERS[name]).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(options) - (set(params) - {"schedule"}))
    if unknown:
        raise ValueError(f"{', '.join(f'sampler.{k}' for k in unknown)}: not an option of {name}; drop "
                         f"{'it' if len(unknown) == 1 else 'them'} with {' '.join(f'~sampler.{k}' for k in unknown)}")


def build_sampler(name: str, schedule: NoiseSchedule, steps: int | None = None, **kwargs) -> Sampler:
    """Sampler by config name, with its timesteps set (``steps`` defaults to T, or to the length of an
    explicit ``timesteps`` grid)."""
    import med_ddpm.restart  # noqa: F401  registers "restart" (it imports this module)
    import med_ddpm.sa_solver  # noqa: F401  registers "sa_solver" (likewise)

    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; known: {sorted(SAMPLERS)}")
    check_options(name, kwargs)
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


@torch.no_grad()
def sample(
    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    sampler: Sampler,
    cond: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    x_T: torch.Tensor | None = None,
    step_noise: Sequence[torch.Tensor] | torch.Tensor | None = None,
    progress: bool = True,
    forward_context: Callable[[], AbstractContextManager] | None = None,
    out_channels: int | None = None,
) -> torch.Tensor:
    """Run the reverse chain from x_T ~ N(0, I) to x₀ for mask condition ``cond``.

    Args:
        model: ε-network, called as ``model(cat([x_t, cond], 1), t)``.
        sampler: a :class:`Sampler` with its timesteps set.
        cond: mask channels (B, C_mask, D, H, W), already in the model's layout/device.
        generator: source of x_T and step noise when they are not given.
        x_T: start of the chain; drawn in float32 when None.
        step_noise: ``step_noise[k]`` is the noise for the k-th reverse step (k = 0 is the
            first step, t = T−1); lets tests and the quality gate inject identical noise.
        progress: show a tqdm bar.
        forward_context: context manager factory put around each network call (autocast).
        out_channels: image channels (defaults to ``model.out_channels``).

    Returns:
        x₀ in float32, same layout as ``cond``.
    """
    if x_T is None:
        c = out_channels or model.out_channels
        shape = (cond.shape[0], c, *cond.shape[2:])
        x_T = torch.randn(shape, generator=generator, dtype=torch.float32, device=cond.device)
    x = x_T.to(device=cond.device, dtype=torch.float32)
    ctx = forward_context or nullcontext
    for k, t in enumerate(tqdm(sampler.timesteps.tolist(), desc="sampling", disable=not progress, leave=False)):
        tb = torch.full((x.shape[0],), t, device=x.device, dtype=torch.long)
        with ctx():
            eps = model(torch.cat([x, cond.to(x.dtype)], dim=1), tb)
        noise = None
        if step_noise is not None and sampler.stochastic:
            noise = step_noise[k].to(device=x.device, dtype=torch.float32)
        x = sampler.step(eps.float(), t, x, noise=noise, generator=generator).prev_sample
    return x
