"""Restart sampling (Xu et al. 2023, "Restart Sampling for Improving Generative Processes", Alg. 1).

A few-step sampler (DDIM, DPM-Solver++ or DEIS: the *base*) runs its main pass from T−1 down. When it
reaches ``t_min`` the chain jumps back up to ``t_max`` through the forward process and solves down the
interval again with ``restart_steps`` steps, ``restarts`` times, then finishes the main pass from
``t_min``. The jump's fresh noise contracts the error the chain has accumulated (Xu et al., Thm. 1), so a
deterministic solver gets the error-washing of a stochastic one where it is cheap.

The jump needs no model call: it is part of the step that lands on ``t_min``, which therefore returns
x at ``t_max``, the next point of :attr:`RestartSampler.timesteps`. So ``timesteps`` lists exactly the model
calls (``steps + restarts × restart_steps``), :func:`med_ddpm.samplers.base.sample` runs it unchanged, and each
step takes one noise field z like every stochastic sampler (the quality gate's fixed per-step noise works
as is). Example::

    sampler = build_sampler("restart", schedule, 13, t_min=57, t_max=150, restarts=2, restart_steps=6)
    len(sampler.timesteps)   # 25 model calls
"""

from __future__ import annotations

import math
from typing import Any

import torch

from med_ddpm.config_checks import ConfigError, check_int_value, check_one_of
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.samplers.base import FewStepSampler, Sampler, StepOutput, check_options
from med_ddpm.samplers.ddim import DDIMSampler
from med_ddpm.samplers.deis import DEISSampler
from med_ddpm.samplers.dpm_solver import DPMSolverPPSampler

BASES: dict[str, type[FewStepSampler]] = {"ddim": DDIMSampler, "dpm_solver_pp": DPMSolverPPSampler, "deis": DEISSampler}


def segment_grid(t_max: int, t_min: int, steps: int) -> list[int]:
    """``steps`` evenly spaced points from ``t_max`` down, then ``t_min``, where the last step lands."""
    return [t_min + round((t_max - t_min) * (steps - i) / steps) for i in range(steps)] + [t_min]


class RestartSampler(Sampler):
    """Restart sampling over a base few-step sampler (module docstring).

    The jump from t_min to t_max is q(x_{t_max} | x_{t_min}) (Ho et al. 2020, eq. 4 composed):
    x_{t_max} = r·x_{t_min} + √(1 − r²)·z with r = √(ᾱ_{t_max}/ᾱ_{t_min}) (Xu et al. 2023, Alg. 1, "Restart
    forward"). When the step that lands on t_min is itself stochastic, x_{t_min} = m + s·z₁, the two Gaussian
    transitions compose into one, x_{t_max} = r·m + √(r²s² + 1 − r²)·z: one noise field per model call.
    Each restart solves t_max → t_min on :func:`segment_grid` from a fresh chain; the main pass resumes at
    t_min with its multistep history reset (the x there is no longer the one its history led to).
    ``steps`` (:meth:`set_timesteps`) is the main pass; ``t_min`` must be one of its grid points.
    """

    stochastic = True

    def __init__(self, schedule: NoiseSchedule, *, t_min: int, t_max: int, restarts: int = 2, restart_steps: int = 6,
                 base: str = "dpm_solver_pp", **base_options: Any):
        T = schedule.num_train_timesteps
        check_one_of("sampler.base", base, tuple(BASES))
        check_int_value("sampler.t_min", t_min, 0, T - 2)
        check_int_value("sampler.t_max", t_max, 1, T - 1)
        check_int_value("sampler.restarts", restarts, 0)
        check_int_value("sampler.restart_steps", restart_steps, 1)
        if t_min >= t_max:
            raise ConfigError(f"sampler.t_min={t_min}: must be below sampler.t_max={t_max} (the restart interval "
                              f"[t_min, t_max]); pass sampler.t_min < sampler.t_max")
        if restart_steps > t_max - t_min:
            raise ConfigError(f"sampler.restart_steps={restart_steps}: more steps than the {t_max - t_min} training "
                              f"steps in [t_min, t_max]; pass sampler.restart_steps <= {t_max - t_min}")
        super().__init__(schedule, base_options.get("clip_denoised", True))
        self.base, self.t_min, self.t_max = base, t_min, t_max
        self.restarts, self.restart_steps = restarts, restart_steps
        ac = schedule.alphas_cumprod.detach().double().cpu()
        self.ratio = float(ac[t_max] / ac[t_min])  # r² = ᾱ_{t_max}/ᾱ_{t_min}
        check_options(base, BASES[base], base_options)
        self.main: FewStepSampler = BASES[base](schedule, **base_options)
        segment_options = {k: v for k, v in base_options.items() if k not in ("spacing", "timesteps")}
        self.segment: FewStepSampler = BASES[base](
            schedule, timesteps=segment_grid(t_max, t_min, restart_steps), **segment_options)
        self.set_timesteps(self.main.num_inference_steps)

    def set_timesteps(self, num_inference_steps: int) -> None:
        """The main pass of ``num_inference_steps`` model calls with the restarts spliced in at t_min."""
        self.main.set_timesteps(num_inference_steps)
        grid = self.main.timesteps.tolist()
        if self.t_min not in grid[1:]:
            raise ConfigError(f"sampler.t_min={self.t_min}: not a point of the main pass's grid {grid[1:]} (its "
                              f"first point excluded); pass one of them")
        j, n = grid.index(self.t_min), self.restart_steps
        # (sampler, its position k, jump after the step)
        plan = [(self.main, k, self.restarts > 0 and k == j - 1) for k in range(j)]
        for r in range(self.restarts):
            plan += [(self.segment, i, r < self.restarts - 1 and i == n - 1) for i in range(n)]
        self._resume = len(plan)
        plan += [(self.main, k, False) for k in range(j, num_inference_steps)]
        self._plan = plan
        self.timesteps = torch.tensor([int(s.timesteps[k]) for s, k, _ in plan], dtype=torch.int64)
        self.num_inference_steps = num_inference_steps
        self._next = 0
        self.segment.set_timesteps(n + 1)

    def step(self, model_output, t, x_t, *, noise=None, generator=None) -> StepOutput:
        pos = self._next
        if int(t) != int(self.timesteps[pos]):
            raise ValueError(f"RestartSampler expected timestep {int(self.timesteps[pos])} next (call {pos}), "
                             f"got {int(t)}; call set_timesteps() to restart the chain")
        self._next = (pos + 1) % len(self._plan)
        owner, k, jump = self._plan[pos]
        if pos == self._resume and self.restarts > 0:
            self.main.reset_history()
        if not jump:
            return owner.step(model_output, t, x_t, noise=noise, generator=generator)
        z = self._fresh_noise(noise, x_t, generator)
        s = owner.noise_std(k)
        out = owner.step(model_output, t, x_t, noise=torch.zeros_like(x_t) if s > 0 else None)
        self.segment.rewind()  # a fresh chain from t_max
        jumped = math.sqrt(self.ratio) * out.prev_sample + math.sqrt(self.ratio * s**2 + 1 - self.ratio) * z
        return StepOutput(jumped, out.pred_x0)
