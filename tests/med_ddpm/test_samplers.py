"""Samplers: the shared contract, MONAI's DDIM step for step, and the closed-form toy problem of conftest.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import CONFIGS, TOY_DATA, GaussianToy, T, ode_error, sde_moments
from hydra import compose, initialize_config_dir
from monai.networks.schedulers import DDIMScheduler
from omegaconf import OmegaConf

from med_ddpm.config_checks import ConfigError
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.samplers import (
    SAMPLERS,
    DDIMSampler,
    DDPMSampler,
    DEISSampler,
    DPMSolverPPSampler,
    build_sampler,
    check_sampler,
    make_timesteps,
    sample,
    sampler_from_config,
)
from med_ddpm.samplers.base import lagrange_exp_weights, strictly_descending

FEW_STEP = ["ddim", "dpm_solver_pp", "deis", "sa_solver"]


# --- contract -------------------------------------------------------------------------------


@pytest.mark.parametrize("spacing", ["trailing", "linspace", "leading", "quadratic"])
@pytest.mark.parametrize("n", [1, 7, 10, 25, 249, 250])
def test_timesteps_descending_unique_int64(spacing, n):
    ts = make_timesteps(T, n, spacing)
    assert ts.dtype == torch.int64 and ts.shape == (n,)
    assert bool((ts[:-1] > ts[1:]).all()) and 0 <= int(ts[-1]) and int(ts[0]) <= T - 1
    if spacing != "leading":
        assert int(ts[0]) == T - 1
    if spacing in ("linspace", "quadratic") and n > 1:
        assert int(ts[-1]) == 0  # the last x̂₀ comes from t = 0, not from a posterior mean at T/n − 1
    if n == T:
        assert ts.tolist() == list(range(T - 1, -1, -1))


def test_quadratic_grid_is_ddim_quad_with_collisions_pushed_apart():
    # 25 steps: √249·(1 − k/24) squared and rounded; the last two both round to 0, so the
    # second to last is pushed up to 1 and the rest of the tail follows only where it collides
    ts = make_timesteps(T, 25, "quadratic").tolist()
    assert ts[:4] == [249, 229, 209, 191] and ts[-6:] == [11, 7, 4, 2, 1, 0]
    assert strictly_descending(np.array([9, 5, 0, 0, 0]), 10).tolist() == [9, 5, 2, 1, 0]
    assert strictly_descending(np.array([12, 9, 9]), 10).tolist() == [9, 8, 7]  # capped at T − 1 from the top


def test_bad_arguments_raise_clear_errors(schedule):
    with pytest.raises(ValueError, match="sampler.steps"):
        make_timesteps(T, T + 1)
    with pytest.raises(ValueError, match="spacing"):
        DDIMSampler(schedule, spacing="uniform")
    with pytest.raises(ValueError, match="unknown sampler"):
        build_sampler("euler", schedule, 10)
    with pytest.raises(ValueError, match="order"):
        DEISSampler(schedule, order=4)
    with pytest.raises(ValueError, match="variant"):
        DEISSampler(schedule, variant="rk")
    with pytest.raises(ValueError, match="order for dpm_solver_pp must be 1, 2 or 3"):
        DPMSolverPPSampler(schedule, order=4)
    with pytest.raises(ValueError, match="variant for dpm_solver_pp"):
        DPMSolverPPSampler(schedule, variant="ito")
    with pytest.raises(ValueError, match="eta"):
        DDIMSampler(schedule, eta=-0.1)
    with pytest.raises(ValueError, match=r"^sampler\.variant: not an option of sa_solver; drop it with "
                                         r"~sampler\.variant$"):
        build_sampler("sa_solver", schedule, 10, variant="sde")  # what experiment=fast_sample sampler=sa_solver sets
    with pytest.raises(ValueError, match=r"^sampler\.order, sampler\.variant: not an option of ddim; drop them with "
                                         r"~sampler\.order ~sampler\.variant$"):  # restart.yaml's, on a DDIM base
        build_sampler("restart", schedule, 13, t_min=28, t_max=111, base="ddim", order=2, variant="ode",
                      spacing="quadratic")


@pytest.mark.parametrize("name", ["ddpm", *FEW_STEP])
def test_config_files_build_their_sampler(schedule, name):
    node = OmegaConf.to_container(OmegaConf.load(CONFIGS / f"{name}.yaml"))
    assert node["name"] == name
    kwargs = {k: v for k, v in node.items() if k not in ("name", "steps")}
    sampler = build_sampler(node["name"], schedule, node["steps"], **kwargs)
    assert isinstance(sampler, SAMPLERS[name]) and len(sampler.timesteps) == node["steps"]
    assert sampler.stochastic == (name in ("ddpm", "sa_solver"))  # sa_solver ships tau = 1


@pytest.mark.parametrize("name", FEW_STEP)
def test_last_step_returns_x0_estimate_and_history_resets(schedule, name):
    toy = GaussianToy(schedule, 0.2, 0.3)
    sampler = build_sampler(name, schedule, 8)
    x = x_T = torch.randn(64, generator=torch.Generator().manual_seed(1))
    noise = list(torch.randn(8, 64, generator=torch.Generator().manual_seed(2)))  # ignored by the ODE solvers
    for t, z in zip(sampler.timesteps.tolist(), noise):
        out = sampler.step(toy.eps(x, t), t, x, noise=z)
        x = out.prev_sample
    assert torch.equal(out.prev_sample, out.pred_x0)  # the last step lands on x̂₀ ...
    assert float(x.abs().max()) <= 1.0  # ... clipped to [−1, 1] by default
    sampler.set_timesteps(8)
    assert torch.equal(toy.run(sampler, x_T, noise), x)  # multistep history reset by set_timesteps


@pytest.mark.parametrize("name", ["dpm_solver_pp", "deis", "sa_solver"])
def test_multistep_rejects_out_of_order_steps(schedule, name):
    sampler = build_sampler(name, schedule, 10)
    x = torch.zeros(4)
    sampler.step(x, int(sampler.timesteps[0]), x)
    with pytest.raises(ValueError, match="multistep"):
        sampler.step(x, int(sampler.timesteps[2]), x)
    with pytest.raises(ValueError, match="not on this sampler's grid"):
        sampler.step(x, 3, x)


@pytest.mark.parametrize("name", ["ddpm", *FEW_STEP])
def test_sample_loop_is_the_sampler_driven_step_by_step(schedule, name):
    """The one loop calls the network on [x_t, mask] at each of the sampler's timesteps in order, and its x₀ is the
    sampler's chain run by hand from the same x_T and step noise (float32 against float64)."""
    toy = GaussianToy(schedule, 0.2, 0.3)
    cond = torch.rand(2, 2, 4, 4, 4, generator=torch.Generator().manual_seed(3))
    calls = []

    def model(inp: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        calls.append((t.tolist(), torch.equal(inp[:, 1:], cond)))
        return toy.eps(inp[:, :1].double(), int(t[0])).float()

    steps = T if name == "ddpm" else 10
    sampler = build_sampler(name, schedule, steps)
    x_T = torch.randn(2, 1, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(steps, 2, 1, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    x0 = sample(model, sampler, cond, x_T=x_T, step_noise=noise, progress=False)
    assert calls == [([t, t], True) for t in sampler.timesteps.tolist()]
    by_hand = toy.run(build_sampler(name, schedule, steps), x_T.double(), list(noise.double()))
    assert x0.dtype == torch.float32 and torch.allclose(x0.double(), by_hand, atol=1e-4)
    assert not torch.allclose(x0, x_T, atol=0.1)  # the chain moved


def test_add_noise_is_the_forward_process(schedule):
    x0, noise, t = torch.rand(3, 1, 2, 2, 2), torch.randn(3, 1, 2, 2, 2), torch.tensor([0, 100, 249])
    for name in FEW_STEP:
        sampler = build_sampler(name, schedule, 10)
        assert torch.equal(sampler.add_noise(x0, noise, t), schedule.add_noise(x0, noise, t))


# --- DDIM against MONAI and DDPM ---------------------------------------------------------------


def monai_ddim(schedule: NoiseSchedule, steps: int) -> DDIMScheduler:
    """MONAI's DDIM on *our* float32 ᾱ (its own cosine is computed in float32 and differs by ~1e-7)."""
    ref = DDIMScheduler(num_train_timesteps=T, schedule="cosine", clip_sample=True, prediction_type="epsilon")
    ref.betas, ref.alphas_cumprod = schedule.betas.clone(), schedule.alphas_cumprod.clone()
    ref.alphas = 1.0 - ref.betas
    ref.set_timesteps(steps)  # step() uses prev = t − T // steps, whatever grid set_timesteps made
    return ref


@pytest.mark.parametrize("eta", [0.0, 1.0])
@pytest.mark.parametrize("steps", [T, 25])
def test_ddim_matches_monai_step_for_step(schedule, steps, eta):
    ours = DDIMSampler(schedule, eta=eta)  # trailing: evenly spaced by T // steps, like MONAI's step
    ours.set_timesteps(steps)
    ref = monai_ddim(schedule, steps)
    if steps == T:
        assert torch.equal(ours.timesteps, ref.timesteps)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1, 4, 4, 4, generator=gen)
    g_ours, g_ref = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for t in ours.timesteps.tolist():
        eps = 1.5 * torch.randn(x.shape, generator=gen)
        out = ours.step(eps, t, x, generator=g_ours)
        x_ref, x0_ref = ref.step(eps, t, x, eta=eta, generator=g_ref)
        # x̂₀ = (x − σ·ε)/α: float32 rounding is amplified by 1/α_t (~5e3 at t = T−1)
        atol = 1e-6 / math.sqrt(float(schedule.alphas_cumprod[t]))
        torch.testing.assert_close(out.pred_x0, x0_ref, rtol=1e-5, atol=atol)
        torch.testing.assert_close(out.prev_sample, x_ref, rtol=1e-5, atol=5e-5)
        x = out.prev_sample


def test_ddim_eta_one_on_all_steps_is_ddpm(schedule):
    """σ_t(η=1)² = β̃_t (Song et al. eq. 16): without clipping the two updates coincide."""
    ddim, ddpm = (
        DDIMSampler(schedule, eta=1.0, clip_denoised=False),
        DDPMSampler(schedule, clip_denoised=False),
    )
    ddpm.set_timesteps(T)
    gen = torch.Generator().manual_seed(3)
    for t in (249, 200, 100, 10, 1):
        x, eps, z = (torch.randn(64, generator=gen) for _ in range(3))
        a = ddim.step(eps, t, x, noise=z).prev_sample
        b = ddpm.step(eps, t, x, noise=z).prev_sample
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_dpm_solver_pp_first_order_is_ddim(schedule):
    """DPM-Solver++(1) = DDIM η = 0 (Lu et al. 2022b), given unclipped x̂₀."""
    toy = GaussianToy(schedule, 0.2, 0.3)
    x_T = torch.randn(256, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    a = toy.run(build_sampler("dpm_solver_pp", schedule, 12, order=1, clip_denoised=False), x_T)
    b = toy.run(build_sampler("ddim", schedule, 12, clip_denoised=False), x_T)
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


# --- closed-form toy problem -------------------------------------------------------------------


def test_lagrange_exp_weights_are_exact_for_polynomials():
    nodes, a, b = [0.3, -0.4, -1.2], 0.3, 1.1
    assert lagrange_exp_weights([0.3], a, b) == pytest.approx([math.exp(b) - math.exp(a)])
    v = np.linspace(a, b, 20001)
    for p in (lambda u: np.ones_like(u), lambda u: 2 - u, lambda u: u**2 + 0.5 * u):
        quad = np.trapezoid(p(v) * np.exp(v), v)
        assert sum(
            w * p(np.array(n)) for w, n in zip(lagrange_exp_weights(nodes, a, b), nodes)
        ) == pytest.approx(quad, rel=1e-6)


@pytest.fixture(scope="module")
def toy_errors(schedule):
    """Max |x₀ − exact ODE endpoint| over 1024 samples, T−1 → 0 (linspace grid), no clipping."""
    toy = GaussianToy(schedule, 0.2, 0.5)
    x_T = torch.randn(1024, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    runs = {"ddim": {}, "dpm_solver_pp": {}, "deis": {}, "ipndm": {}}
    out = {}
    for key, kw in runs.items():
        name = "deis" if key == "ipndm" else key
        kw = {"variant": "ipndm"} if key == "ipndm" else kw
        out[key] = {n: ode_error(schedule, name, n, x_T, toy, **kw) for n in (10, 20, 40, 80)}
    return out


def test_ddim_is_first_order_and_full_ddim_is_the_ode(schedule, toy_errors):
    e = toy_errors["ddim"]
    for n in (10, 20, 40):
        assert 0.4 < e[2 * n] / e[n] < 0.6
    toy = GaussianToy(schedule, 0.2, 0.5)
    x_T = torch.randn(1024, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert ode_error(schedule, "ddim", T, x_T, toy) < 0.4 * e[80]  # 250 steps: ~1e-2, still first order


def test_dpm_solver_pp_is_second_order(toy_errors):
    """Asymptotically ×4 per doubling; at 10 steps the λ grid is too coarse near t = 0 to beat DDIM."""
    e, ddim = toy_errors["dpm_solver_pp"], toy_errors["ddim"]
    assert e[40] / e[20] < 0.35 and e[80] / e[40] < 0.35
    assert e[20] < ddim[20] and e[40] < 0.5 * ddim[40] and e[80] < 0.25 * ddim[80]


@pytest.mark.parametrize("name", ["deis", "ipndm"])
def test_deis_beats_ddim_by_far(toy_errors, name):
    """tAB-3 / iPNDM-3: 10-100× smaller ODE error than DDIM from 10 steps on."""
    e, ddim = toy_errors[name], toy_errors["ddim"]
    assert e[20] < e[10]
    for n in (10, 20, 40, 80):
        assert e[n] < 0.3 * ddim[n]


@pytest.mark.parametrize(("name", "std_tol"), [("ddim", 0.07), ("dpm_solver_pp", 0.015), ("deis", 0.025)])
def test_deterministic_samples_match_the_data_distribution(schedule, name, std_tol):
    """Default config at 50 steps (trailing grid, x̂₀ clipped) on N(0.2, 0.3²), 4096 samples.

    Measured std deficits: DDIM 5.1 %, DPM-Solver++ 0.6 %, DEIS 1.5 % (the final x̂₀ at t = 4 is a
    posterior mean, which shrinks a little; DDIM adds its first-order error).
    """
    mu, s = 0.2, 0.3
    toy = GaussianToy(schedule, mu, s)
    x_T = torch.randn(4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x0 = toy.run(build_sampler(name, schedule, 50), x_T)
    assert abs(float(x0.mean()) - mu) < 0.01
    assert abs(float(x0.std()) / s - 1) < std_tol


@pytest.mark.parametrize("name", ["ddpm", "ddim"])
def test_ancestral_samples_match_the_data_distribution(schedule, name):
    """DDPM and DDIM η = 1 on all T steps with exact ε draw N(μ, s²) (4096 samples; std ~3 % low).

    The fixed variance β̃_t slightly under-disperses; DDIM η = 1 at 50 steps is ~11 % low, so the
    few-step stochastic sampler is not claimed to match.
    """
    mu, s = 0.2, 0.3
    toy = GaussianToy(schedule, mu, s)
    gen = torch.Generator().manual_seed(0)
    sampler = DDPMSampler(schedule) if name == "ddpm" else DDIMSampler(schedule, eta=1.0)
    sampler.set_timesteps(T)
    x_T = torch.randn(4096, generator=gen, dtype=torch.float64)
    noise = list(torch.randn(len(sampler.timesteps), 4096, generator=gen, dtype=torch.float64))
    x0 = toy.run(sampler, x_T, noise)
    assert abs(float(x0.mean()) - mu) < 0.015
    assert abs(float(x0.std()) / s - 1) < 0.05


@pytest.mark.parametrize("steps", [25, 50])
def test_sde_dpm_solver_pp_samples_match_the_data_distribution(schedule, steps):
    """SDE-DPM-Solver++(2M) with exact ε on N(μ, s²), 4096 samples: unlike DDIM η = 1 at 50 steps
    (~11 % low), it keeps the spread at few steps (measured: std +0.5 % at 25 and +0.6 % at 50)."""
    mu, s = 0.2, 0.3
    toy = GaussianToy(schedule, mu, s)
    gen = torch.Generator().manual_seed(0)
    sampler = build_sampler("dpm_solver_pp", schedule, steps, variant="sde")
    assert sampler.stochastic
    x_T = torch.randn(4096, generator=gen, dtype=torch.float64)
    noise = list(torch.randn(steps, 4096, generator=gen, dtype=torch.float64))
    x0 = toy.run(sampler, x_T, noise)
    assert abs(float(x0.mean()) - mu) < 0.01
    assert abs(float(x0.std()) / s - 1) < 0.02
    ode = toy.run(build_sampler("dpm_solver_pp", schedule, steps), x_T)
    assert float((x0 - ode).abs().mean()) > 0.05, "the SDE variant must actually inject noise"


@pytest.mark.parametrize(("spacing", "steps"), [("trailing", 10), ("trailing", 50), ("quadratic", 15),
                                                ("quadratic", 25), ("quadratic", 50)])
def test_sde_dpm_solver_pp_3m_keeps_the_distribution(schedule, spacing, steps):
    """SDE-DPM-Solver++(3M), exact ε, N(μ, s²). Measured std error, mean of 4 seeds (2M alongside):
    trailing 10: +0.5 % (2M −15 %), 50: +0.5 % (+1.3 %); quadratic 15: −0.1 % (+6.9 %), 25: −1.4 % (+1.4 %),
    50: −0.3 % (−0.03 %). Not claimed where it fails: trailing 15 and 25 overshoot (+6.4 %, +7.1 %; 2M −5.8 %,
    +0.3 %), where the last, widening λ steps make the quadratic extrapolate noisy x̂₀ with weights ~±1.4;
    quadratic 10 is +41 %."""
    mean_error, std_error = sde_moments(schedule, steps, order=3, spacing=spacing)
    assert abs(mean_error) < 0.01
    assert abs(std_error) < 0.03


def test_sde_dpm_solver_pp_3m_is_not_uniformly_better_than_2m(schedule):
    """The measured counterpart of the docstring above: at 25 trailing steps 3M overshoots the spread, 2M does not."""
    assert sde_moments(schedule, 25, order=3)[1] > 0.04
    assert abs(sde_moments(schedule, 25, order=2)[1]) < 0.02


def interior_ode_error(schedule, order: int, steps: int) -> float:
    """Max |x₀ − exact ODE endpoint| of DPM-Solver++ on an explicit grid 240 → 10 (λ from −3.6 to 3.0, no
    clipped-ᾱ jump at either end), N(0.2, 0.5²), 1024 samples, no clipping."""
    toy = GaussianToy(schedule, 0.2, 0.5)
    x_T = torch.randn(1024, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    grid = [int(t) for t in np.round(np.linspace(240, 10, steps))]
    sampler = build_sampler("dpm_solver_pp", schedule, steps, order=order, clip_denoised=False, timesteps=grid)
    return float((toy.run(sampler, x_T) - toy.ode_endpoint(x_T, 240, 10)).abs().max())


def test_dpm_solver_pp_3m_is_third_order_and_beats_2m_on_a_smooth_grid(schedule):
    """Measured: 3M 1.3e-2, 2.7e-3, 4.0e-4 at 20, 40, 80 steps (×4.8, ×6.7 per doubling, towards ×8); 2M
    2.3e-2, 5.9e-3, 1.4e-3. On the full T−1 → 0 grid (toy_errors) 3M does not beat 2M: the λ steps at both
    ends (−8.5 → −5.1 at t = 249, 1.8 → 4.3 over t = 24 → 0) are far from the neighbouring ones."""
    e3 = {n: interior_ode_error(schedule, 3, n) for n in (20, 40, 80)}
    e2 = {n: interior_ode_error(schedule, 2, n) for n in (20, 40, 80)}
    assert e3[80] / e3[40] < 0.2 and e3[40] / e3[20] < 0.25
    for n in (20, 40, 80):
        assert e3[n] < 0.6 * e2[n]


@pytest.mark.parametrize("name", FEW_STEP)
@pytest.mark.parametrize("spacing", ["trailing", "quadratic"])
def test_explicit_timesteps_reproduce_the_spacing(schedule, name, spacing):
    default = build_sampler(name, schedule, 25, spacing=spacing)
    explicit = build_sampler(name, schedule, 25, timesteps=default.timesteps.tolist())
    assert torch.equal(explicit.timesteps, default.timesteps)
    toy = GaussianToy(schedule, *TOY_DATA)
    gen = torch.Generator().manual_seed(2)
    x_T = torch.randn(256, generator=gen, dtype=torch.float64)
    noise = list(torch.randn(25, 256, generator=gen, dtype=torch.float64))  # for the stochastic ones
    assert torch.equal(toy.run(explicit, x_T, noise), toy.run(default, x_T, noise))
    assert build_sampler(name, schedule, timesteps=[249, 120, 3]).timesteps.tolist() == [249, 120, 3]


@pytest.mark.parametrize("grid", [[249, 249, 0], [100, 200], [250, 100], [100, -1], [], [249.0, 100], [True, 0]],
                         ids=["repeated", "ascending", "above-T-1", "negative", "empty", "float", "bool"])
def test_bad_timesteps_are_refused_with_one_line(schedule, grid):
    with pytest.raises(ConfigError, match=r"^sampler\.timesteps=.*strictly decreasing integers in \[0, 249\]; pass "
                       ) as err:
        build_sampler("dpm_solver_pp", schedule, timesteps=grid)
    assert "\n" not in str(err.value)


def test_timesteps_and_steps_must_agree(schedule):
    with pytest.raises(ConfigError, match=r"^sampler\.steps=10: sampler\.timesteps lists 3 steps; pass sampler\.steps=3$"):
        build_sampler("ddim", schedule, 10, timesteps=[249, 100, 0])


def test_timesteps_override_composes_with_the_real_configs():
    """``sampler.timesteps=[...]`` on the command line, checked by the entry points' own check."""
    with initialize_config_dir(config_dir=str(CONFIGS.parent), version_base="1.3"):
        cfg = compose("sample", overrides=["sampler=dpm_solver_pp", "sampler.variant=sde", "sampler.order=3",
                                           "sampler.steps=4", "sampler.timesteps=[249,180,60,9]"])
        bad = compose("sample", overrides=["sampler=deis", "sampler.steps=2", "sampler.timesteps=[9,60]"])
    check_sampler(cfg.sampler, cfg.diffusion)
    check_sampler(OmegaConf.merge(cfg.sampler, {"steps": None}), cfg.diffusion)  # med_ddpm.sample's early check
    sampler = sampler_from_config(cfg.sampler, NoiseSchedule.from_config(cfg.diffusion))
    assert sampler.timesteps.tolist() == [249, 180, 60, 9] and sampler.order == 3 and sampler.stochastic
    with pytest.raises(ConfigError, match=r"^sampler\.timesteps=\[9, 60\]: must be strictly decreasing"):
        check_sampler(bad.sampler, bad.diffusion)


def test_registry_names_each_sampler_config_and_nothing_else():
    """The table is the one place that names samplers: every configs/sampler/*.yaml's name is in it and its config
    builds that class, and no name in it lacks a config."""
    nodes = [OmegaConf.load(path) for path in sorted(CONFIGS.glob("*.yaml"))]
    assert set(SAMPLERS) == {node.name for node in nodes}
    for node in nodes:
        assert type(sampler_from_config(node, NoiseSchedule(timesteps=250))) is SAMPLERS[node.name]
