"""Restart sampling (med_ddpm/samplers/restart_sampler.py) on the toy problem (conftest.py) and with the real configs."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CONFIGS, TOY_DATA, GaussianToy, toy_moments
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from med_ddpm.config_checks import ConfigError
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.samplers import build_sampler, check_sampler, sampler_from_config, sampler_options
from med_ddpm.samplers.restart_sampler import RestartSampler, segment_grid

# --- restart sampling (med_ddpm/samplers/restart_sampler.py) ------------------------------------------------------


def restart_node(**options) -> dict:
    return {**OmegaConf.to_container(OmegaConf.load(CONFIGS / "restart.yaml")), **options}


def test_restart_timesteps_are_the_model_calls(schedule):
    """Main pass to t_min = 28, then each restart re-solves 111 → 28 in 6 calls, then the main pass ends."""
    node = restart_node()
    sampler = sampler_from_config(node, schedule)
    main = [249, 209, 173, 140, 111, 85, 62, 43]
    assert sampler.timesteps.tolist() == [*main, *[111, 97, 83, 70, 56, 42] * 2, 28, 16, 7, 2, 0]
    assert len(sampler.timesteps) == 25 and sampler.num_inference_steps == 13
    assert sampler.stochastic and segment_grid(111, 28, 6) == [111, 97, 83, 70, 56, 42, 28]
    bare = sampler_from_config(restart_node(restarts=0), schedule)
    base = build_sampler("dpm_solver_pp", schedule, 13, spacing="quadratic")
    assert torch.equal(bare.timesteps, base.timesteps)
    toy = GaussianToy(schedule, *TOY_DATA)
    x_T = torch.randn(256, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.equal(toy.run(bare, x_T), toy.run(base, x_T))  # no restarts: the base sampler itself


@pytest.mark.parametrize("variant", ["ode", "sde"])
def test_restart_jump_adds_exactly_the_forward_process_noise(schedule, variant):
    """The step landing on t_min returns r·x_{t_min} + √(1 − r²)·z, r² = ᾱ_{t_max}/ᾱ_{t_min} (ODE base); after a
    stochastic step x_{t_min} = m + s·z₁ the two compose: r·m + √(r²s² + 1 − r²)·z."""
    toy = GaussianToy(schedule, *TOY_DATA)
    sampler = build_sampler("restart", schedule, 13, spacing="quadratic", variant=variant, t_min=28, t_max=111,
                            restarts=1, restart_steps=6)
    base = build_sampler("dpm_solver_pp", schedule, 13, spacing="quadratic", variant=variant)
    gen = torch.Generator().manual_seed(5)
    x = y = torch.randn(512, generator=gen, dtype=torch.float64)
    for t in sampler.timesteps.tolist()[:7]:
        z = torch.randn(512, generator=gen, dtype=torch.float64)
        x = sampler.step(toy.eps(x, t), t, x, noise=z).prev_sample
        y = base.step(toy.eps(y, t), t, y, noise=z).prev_sample
    assert torch.equal(x, y)  # the main pass is the base sampler's, noise and all
    t, z = 43, torch.randn(512, generator=gen, dtype=torch.float64)
    r2 = float(schedule.alphas_cumprod.double()[111] / schedule.alphas_cumprod.double()[28])
    s = base.noise_std(7)
    assert (s > 0) == (variant == "sde")
    jumped = sampler.step(toy.eps(x, t), t, x, noise=z).prev_sample
    m = base.step(toy.eps(y, t), t, y, noise=torch.zeros_like(y)).prev_sample
    torch.testing.assert_close(jumped, math.sqrt(r2) * m + math.sqrt(r2 * s**2 + 1 - r2) * z, rtol=0, atol=1e-12)
    assert int(sampler.timesteps[8]) == 111  # the next call is at t_max


def test_restart_keeps_the_toy_distribution_at_25_calls(schedule):
    """Exact ε on N(0.2, 0.3²), 4 seeds × 4096, default config (13 quadratic DPM-Solver++ steps + 2 × 6 on
    [28, 111]): the std errors docs/samplers.md quotes, pinned (the toy is seeded)."""
    options = sampler_options(restart_node())
    ode_mean, ode_std = toy_moments(schedule, "restart", 13, **options)
    sde_mean, sde_std = toy_moments(schedule, "restart", 13, **{**options, "variant": "sde"})
    alone = toy_moments(schedule, "restart", 13, **{**options, "restarts": 0})[1]
    alone_sde = toy_moments(schedule, "restart", 13, **{**options, "restarts": 0, "variant": "sde"})[1]
    assert abs(ode_mean) < 0.01 and abs(sde_mean) < 0.01
    assert (ode_std, sde_std, alone, alone_sde) == pytest.approx((-0.0035, -0.0175, 0.0178, 0.087), abs=5e-4)
    assert alone > 0.015 and abs(ode_std) < 0.5 * alone  # the restarts, not the main pass, bring it in


@pytest.mark.parametrize(("options", "error"), [
    ({"t_min": 111, "t_max": 28}, r"^sampler\.t_min=111: must be below sampler\.t_max=28 .*; pass"),
    ({"t_min": 30}, r"^sampler\.t_min=30: not a point of the main pass's grid \[209, .*, 0\] .*; pass one of"),
    ({"restart_steps": 90}, r"^sampler\.restart_steps=90: more steps than the 83 training steps .*; pass"),
    ({"restarts": -1}, r"^sampler\.restarts=-1: must be an integer >= 0"),
    ({"base": "ddpm"}, r"^sampler\.base='ddpm': unknown value; pass one of ddim, dpm_solver_pp, deis$"),
    ({"t_max": 250}, r"^sampler\.t_max=250: must be an integer in \[1, 249\]"),
    ({"restart_steps": 2.5}, r"^sampler\.restart_steps=2\.5: must be an integer >= 1; pass sampler\.restart_steps=N"),
], ids=["t_min-above-t_max", "t_min-off-grid", "segment-too-fine", "restarts-negative", "base-ddpm", "t_max-high",
        "restart_steps-fraction"])
def test_restart_refuses_bad_options_with_one_line(schedule, options, error):
    with pytest.raises(ConfigError, match=error) as err:
        sampler_from_config(restart_node(**options), schedule)
    assert "\n" not in str(err.value)


def test_restart_composes_with_the_sampling_command_and_fast_sample():
    with initialize_config_dir(config_dir=str(CONFIGS.parent), version_base="1.3"):
        cfg = compose("sample", overrides=["experiment=fast_sample", "sampler=restart", "sampler.steps=13"])
    check_sampler(cfg.sampler, cfg.diffusion)
    sampler = sampler_from_config(cfg.sampler, NoiseSchedule.from_config(cfg.diffusion))
    assert isinstance(sampler, RestartSampler) and sampler.main.variant == "sde"  # fast_sample's variant
    assert len(sampler.timesteps) == 25
