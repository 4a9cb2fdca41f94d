"""bench.experiments.step_search: the KL-bound terms, the exact grid search, and M on the exact-ε Gaussian toy."""

import itertools
import math

import numpy as np
import pytest
import torch
import yaml

from bench.experiments.step_search import (
    denoised_distances,
    interval_costs,
    kl_bound,
    log_snr_weights,
    optimal_grid,
    parse_args,
    sampler_snippet,
    search,
)
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.samplers import SPACINGS, sampler_from_config

MU, S = 0.2, 0.3  # toy data x₀ ~ N(μ, s²) per voxel


def random_problem(T: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    pts = rng.normal(size=(T, 3)).cumsum(axis=0)
    distances = ((pts[:, None] - pts[None]) ** 2).sum(-1)
    return distances, rng.uniform(0.1, 2.0, size=T)


def test_interval_costs_are_the_weighted_sums():
    distances, weights = random_problem(9)
    costs = interval_costs(distances, weights)
    for a in range(9):
        for b in range(9):
            want = sum(weights[t] * distances[t, a] for t in range(b, a))
            assert costs[a, b] == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_optimal_grid_is_the_brute_force_minimum(steps):
    T = 11
    costs = interval_costs(*random_problem(T, seed=steps))
    grid = optimal_grid(costs, steps)
    assert grid[0] == T - 1 and len(grid) == steps and all(a > b for a, b in zip(grid, grid[1:]))
    brute = min(kl_bound(costs, [T - 1, *rest[::-1]]) for rest in itertools.combinations(range(T - 1), steps - 1))
    assert kl_bound(costs, grid) == pytest.approx(brute, rel=1e-12)


@pytest.fixture(scope="module")
def toy():
    """M from the tool on N(μ, s²) images with the exact ε-model (2 samples of 16³ voxels)."""
    schedule = NoiseSchedule(250)
    abar = schedule.alphas_cumprod.double()

    def model(inp: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a, x = float(abar[int(t[0])]), inp[:, :1].double()
        return (math.sqrt(1 - a) * (x - math.sqrt(a) * MU) / (a * S**2 + 1 - a)).float()

    g = torch.Generator().manual_seed(0)
    images = MU + S * torch.randn(2, 1, 16, 16, 16, generator=g)
    distances = denoised_distances(model, schedule, images, torch.zeros(2, 2, 16, 16, 16), g, batch=1)
    return schedule, abar.numpy(), distances


def test_distances_match_the_closed_form(toy):
    """x̂₀_t = μ + c_t·(√ᾱ_t·(x₀ − μ) + √(1 − ᾱ_t)·ε), c_t = s²√ᾱ_t/(ᾱ_t·s² + 1 − ᾱ_t), so
    M[a, b] = (c_a√ᾱ_a − c_b√ᾱ_b)²·s² + (c_a√(1−ᾱ_a) − c_b√(1−ᾱ_b))² (no clipping: |x̂₀| < 1 here)."""
    _, abar, distances = toy
    c = S**2 * np.sqrt(abar) / (abar * S**2 + 1 - abar)
    signal, noise = c * np.sqrt(abar), c * np.sqrt(1 - abar)
    exact = (signal[:, None] - signal[None]) ** 2 * S**2 + (noise[:, None] - noise[None]) ** 2
    assert np.allclose(distances, distances.T) and np.all(np.diag(distances) < 1e-9)
    for a, b in [(249, 0), (200, 100), (60, 40), (5, 0)]:
        assert distances[a, b] == pytest.approx(exact[a, b], rel=0.05)


def test_search_beats_every_spacing_and_writes_a_sampler_config(toy):
    schedule, _, distances = toy
    costs = interval_costs(distances, log_snr_weights(schedule))
    result = search(costs, [10, 25])
    for k, r in result.items():
        assert set(r["spacings"]) == set(SPACINGS)
        assert r["bound"] <= min(r["spacings"].values()) * (1 + 1e-12)
        node = yaml.safe_load(sampler_snippet(r["grid"], 3, "toy", r["bound"], r["spacings"]["trailing"]))
        sampler = sampler_from_config(node, schedule)
        assert sampler.timesteps.tolist() == r["grid"] and sampler.stochastic and sampler.order == 3
        assert r["grid"][0] == 249 and len(r["grid"]) == k


def test_arguments_are_checked():
    with pytest.raises(SystemExit, match="out=DIR is required"):
        parse_args(["model=tiny"])
    with pytest.raises(SystemExit, match="key=value"):
        parse_args(["out=x", "sample=3"])
    assert parse_args(["out=x", "n=2"]) == {"out": "x", "n": "2"}
