"""SA-Solver (med_ddpm/samplers/sa_solver.py) on the toy problem (conftest.py): its first order, its weights, its corrector."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import GaussianToy, toy_moments

from med_ddpm.config_checks import ConfigError
from med_ddpm.samplers import build_sampler

# --- SA-Solver (med_ddpm/samplers/sa_solver.py) ------------------------------------------------------------


@pytest.mark.parametrize(("tau", "variant"), [(1.0, "sde"), (0.0, "ode")])
def test_sa_solver_first_order_without_corrector_is_dpm_solver_pp_1(schedule, tau, variant):
    """τ = 1 is the reverse SDE SDE-DPM-Solver++ solves, τ = 0 the ODE: at first order and without the corrector
    the two solvers take the same steps, noise included."""
    toy = GaussianToy(schedule, 0.2, 0.3)
    gen = torch.Generator().manual_seed(0)
    x_T = torch.randn(256, generator=gen, dtype=torch.float64)
    noise = list(torch.randn(25, 256, generator=gen, dtype=torch.float64))
    sa = build_sampler("sa_solver", schedule, 25, tau=tau, predictor_order=1, corrector_order=0)
    dpm = build_sampler("dpm_solver_pp", schedule, 25, order=1, variant=variant)
    assert sa.stochastic == dpm.stochastic
    assert float((toy.run(sa, x_T, noise) - toy.run(dpm, x_T, noise)).abs().max()) < 1e-12


def sa_ode_errors(schedule, predictor: int, corrector: int) -> list[float]:
    """Max |x₀ − exact ODE endpoint| of SA-Solver at τ = 0 on the smooth grid 240 → 10, at 20, 40, 80 steps."""
    toy = GaussianToy(schedule, 0.2, 0.5)
    x_T = torch.randn(1024, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    errors = []
    for steps in (20, 40, 80):
        grid = [int(t) for t in np.round(np.linspace(240, 10, steps))]
        sampler = build_sampler("sa_solver", schedule, steps, tau=0.0, predictor_order=predictor,
                                corrector_order=corrector, clip_denoised=False, timesteps=grid)
        errors.append(float((toy.run(sampler, x_T) - toy.ode_endpoint(x_T, 240, 10)).abs().max()))
    return errors


def test_sa_solver_corrector_raises_the_order_by_one(schedule):
    """Measured (errors at 20, 40, 80 steps): predictor 2 alone 3.1e-2, 7.6e-3, 1.8e-3 (×4.1, ×4.3: second order);
    with corrector 2: 2.4e-2, 3.5e-3, 3.3e-4 (×7.0, ×10.4: third order); predictor 3 alone matches
    DPM-Solver++(3M) (4.0e-4 at 80); with corrector 3: 1.3e-4 (×12.5 on the last doubling)."""
    p2, p2c2 = sa_ode_errors(schedule, 2, 0), sa_ode_errors(schedule, 2, 2)
    assert 3.5 < p2[1] / p2[2] < 5 and p2c2[1] / p2c2[2] > 7.5
    assert all(c < p for c, p in zip(p2c2, p2))
    assert sa_ode_errors(schedule, 3, 3)[2] < 0.5 * sa_ode_errors(schedule, 3, 0)[2]


@pytest.mark.parametrize("tau", [1.0, 0.5])
@pytest.mark.parametrize(("steps", "orders", "std_tol"), [(25, (2, 2), 0.02), (50, (3, 3), 0.015)])
def test_sa_solver_keeps_the_distribution(schedule, steps, orders, std_tol, tau):
    """Exact ε, N(μ, s²), quadratic grid, mean of 4 seeds. Measured std error at τ = 1: (2, 2) at 25 steps +0.86 %,
    (3, 3) at 50 −0.45 %; at τ = 0.5 (τ² ≠ τ: checks the c = 1 + τ² of the weights and the noise) −0.08 % and
    −0.51 %. At 10 quadratic steps τ = 1 is off by 15-51 % over every (predictor, corrector) pair (docs/samplers.md)."""
    mean_error, std_error = toy_moments(schedule, "sa_solver", steps, tau=tau, predictor_order=orders[0],
                                        corrector_order=orders[1], spacing="quadratic")
    assert abs(mean_error) < 0.01 and abs(std_error) < std_tol


@pytest.mark.parametrize(("options", "error"), [
    ({"tau": -0.5}, r"^sampler\.tau=-0\.5: must be a number >= 0 and <= 2; pass sampler\.tau=X with X >= 0 and <= 2$"),
    ({"predictor_order": 4}, r"^sampler\.predictor_order=4: must be an integer in \[1, 3\]"),
    ({"corrector_order": -1}, r"^sampler\.corrector_order=-1: must be an integer in \[0, 3\] \(0: no corrector\)"),
])
def test_sa_solver_refuses_bad_options_with_one_line(schedule, options, error):
    with pytest.raises((ValueError, ConfigError), match=error):
        build_sampler("sa_solver", schedule, 10, **options)


def test_sa_solver_weights_are_the_integral_of_the_reverse_sde_family(schedule):
    """Each stored x̂₀ weight is σ_t·(1+τ²)·∫_{λ_s}^{λ_t} e^{−τ²(λ_t−λ)}·e^{λ}·ℓ_j(λ) dλ (ℓ_j the Lagrange basis on the
    x̂₀ nodes in λ), by quadrature, at τ = 0.5, where τ² and τ differ; the noise std is σ_t·√(1 − e^{−2τ²h})."""
    from scipy.integrate import quad

    tau, sampler = 0.5, build_sampler("sa_solver", schedule, 12, tau=0.5, predictor_order=3, corrector_order=3)
    lam, sigma = sampler.lam, sampler.sigma
    for table, k, s, t in [(sampler._predict, 5, 5, 6), (sampler._correct, 5, 4, 5)]:
        decay, weights, std = table[k]
        nodes = [lam[k - j] for j in range(3)]
        for j, w in enumerate(weights):
            others = [v for i, v in enumerate(nodes) if i != j]
            ell = np.poly1d(others, r=True) / np.prod([nodes[j] - v for v in others])
            integral = quad(lambda v, ell=ell, end=lam[t]: math.exp(-tau**2 * (end - v) + v) * ell(v), lam[s], lam[t])
            assert w == pytest.approx(sigma[t] * (1 + tau**2) * integral[0], rel=1e-9)
        h = lam[t] - lam[s]
        assert decay == pytest.approx(sigma[t] / sigma[s] * math.exp(-tau**2 * h), rel=1e-12)
        assert std == pytest.approx(sigma[t] * math.sqrt(1 - math.exp(-2 * tau**2 * h)), rel=1e-12)


def test_sa_solver_corrector_redoes_the_last_step_with_its_noise(schedule):
    """Step 1 corrects step 0's update from x_T with x̂₀ at both points and step 0's own ξ, then predicts from the
    corrected point with fresh ξ: checked against the coefficient tables by hand."""
    toy = GaussianToy(schedule, 0.2, 0.3)
    sampler = build_sampler("sa_solver", schedule, 10, tau=1.0, predictor_order=2, corrector_order=2,
                            clip_denoised=False)
    gen = torch.Generator().manual_seed(0)
    x_T, xi0, xi1 = (torch.randn(64, generator=gen, dtype=torch.float64) for _ in range(3))
    t0, t1 = sampler.timesteps.tolist()[:2]
    x1 = sampler.step(toy.eps(x_T, t0), t0, x_T, noise=xi0).prev_sample
    out = sampler.step(toy.eps(x1, t1), t1, x1, noise=xi1)
    x0_0 = (x_T - sampler.sigma[0] * toy.eps(x_T, t0)) / sampler.alpha[0]
    x0_1 = (x1 - sampler.sigma[1] * toy.eps(x1, t1)) / sampler.alpha[1]

    def apply(update, x, x0s, noise):
        decay, weights, std = update
        return decay * x + sum(w * x0 for w, x0 in zip(weights, x0s)) + std * noise

    corrected = apply(sampler._correct[1], x_T, [x0_1, x0_0], xi0)
    assert torch.allclose(out.prev_sample, apply(sampler._predict[1], corrected, [x0_1, x0_0], xi1), atol=1e-12)
    assert not torch.allclose(corrected, x1)  # the correction moved the point
