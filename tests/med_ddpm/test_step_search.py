"""med_ddpm.step_search: the KL-bound terms, the exact grid search, M on the exact-ε Gaussian toy, and the command
end to end (a small network, phantoms and whole-head NIfTI data, the written sampler configs sampled with)."""

import itertools
import json
import math
import re

import numpy as np
import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir

from med_ddpm import step_search
from med_ddpm.checkpoint import save_checkpoint
from med_ddpm.cli import CONFIG_PATH
from med_ddpm.data.phantoms import write_phantom_niftis
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.model import UNet3D
from med_ddpm.samplers import SPACINGS, sampler_from_config
from med_ddpm.samplers import search as step_search_method
from med_ddpm.samplers.search import (
    denoised_distances,
    interval_costs,
    kl_bound,
    log_snr_weights,
    optimal_grid,
    sampler_snippet,
    search,
)

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
    batches = [(images[i:i + 1], torch.zeros(1, 2, 16, 16, 16)) for i in range(2)]
    distances = denoised_distances(model, schedule, batches, g)
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


def test_gram_slices_sum_to_the_whole(toy, monkeypatch):
    """M is the same whether the float64 Gram matrix is accumulated in one slice or in many."""
    schedule = toy[0]
    images = MU + S * torch.randn(2, 1, 16, 16, 16, generator=torch.Generator().manual_seed(1))
    batches = [(images[i:i + 1], torch.zeros(1, 2, 16, 16, 16)) for i in range(2)]
    model = lambda inp, t: 0.1 * inp[:, :1]  # noqa: E731 - any ε-model will do
    whole = denoised_distances(model, schedule, batches, torch.Generator().manual_seed(0))
    monkeypatch.setattr(step_search_method, "GRAM_CHUNK", 1000)  # 4096 voxels a volume: 5 slices, the last one short
    sliced = denoised_distances(model, schedule, batches, torch.Generator().manual_seed(0))
    assert np.allclose(sliced, whole, rtol=1e-9, atol=1e-12) and whole[100, 0] > 0


# ---------------------------------------------------------------------------------------------- the command

SIZE = [8, 8, 8]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A 2-level whole-head network on 8³ with a 50-step schedule, random weights (it checks the pipeline)."""
    torch.manual_seed(0)
    net, schedule = UNet3D(3, 1, 32, (1, 2), 1, (2,)), NoiseSchedule(50)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.02)
    config = {"model": dict(net.config, image_size=SIZE), "diffusion": schedule.config,
              "data": {"name": "synthetic", "variant": "whole_head"}}
    path = tmp_path_factory.mktemp("ckpt") / "last.pt"
    save_checkpoint(path, model_state=net.state_dict(), ema_state=net.state_dict(), config=config, step=1)
    return str(path)


def compose_search(overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        return compose("step_search", overrides=["device=cpu", "progress=false", *overrides])


def test_command_writes_sampler_configs_that_sample(checkpoint, tmp_path, capsys):
    """Phantoms by default: one config per K on a grid better than every named one, its summary, and the printed
    command, which samples with that config as printed (Hydra's search path)."""
    out = tmp_path / "search"
    step_search.main(compose_search([f"checkpoint={checkpoint}", "n=3", "batch=2", "steps=[4,6]",
                                     f"output_dir={out}", "name=ays_small"]))
    printed = capsys.readouterr().out
    summary = json.loads((out / "step_search.json").read_text())
    assert summary["n"] == 3 and summary["data"] == "synthetic whole_head phantoms (seed 10000)"
    for k in (4, 6):
        node = yaml.safe_load((out / "sampler" / f"ays_small_{k}.yaml").read_text())
        result = summary["results"][str(k)]
        assert node["timesteps"] == result["grid"] and node["timesteps"][0] == 49 and len(node["timesteps"]) == k
        assert result["bound"] <= min(result["spacings"].values())
    assert "| 6 |" in (out / "step_search.md").read_text()
    hint = next(line for line in printed.splitlines() if line.startswith("sample with: "))
    assert f"'hydra.searchpath=[file://{out}]' sampler=ays_small_4 sampler.steps=4" in hint
    with initialize_config_dir(config_dir=CONFIG_PATH, version_base="1.3"):
        cfg = compose("sample", overrides=[f"hydra.searchpath=[file://{out}]", "sampler=ays_small_4",
                                           "sampler.steps=4", f"checkpoint={checkpoint}"])
    assert sampler_from_config(cfg.sampler, NoiseSchedule(50)).timesteps.tolist() == summary["results"]["4"]["grid"]


def test_command_searches_on_whole_head_niftis(checkpoint, tmp_path):
    """data=whole_head reads the user's image-mask pairs; its grids differ from the phantoms' (other x₀)."""
    write_phantom_niftis(tmp_path / "data", 2, SIZE, seed=3)
    runs = {}
    for name, data in (("files", ["data=whole_head", f"data.root={tmp_path / 'data'}"]), ("phantoms", [])):
        out = tmp_path / name
        step_search.main(compose_search([f"checkpoint={checkpoint}", "n=2", "steps=[5]", f"output_dir={out}",
                                         *data]))
        runs[name] = json.loads((out / "step_search.json").read_text())
    assert runs["files"]["data"] == f"whole_head volumes of {tmp_path / 'data'}"
    assert runs["files"]["results"]["5"]["bound"] != runs["phantoms"]["results"]["5"]["bound"]


def test_command_runs_inside_a_recipe_stack(checkpoint, tmp_path, monkeypatch):
    """Every forward runs on the network the stack prepared: under channels_last_3d each 5-D weight is in the NDHWC
    layout at every call (strict FP32's are not); the recipe is exact, so it finds the strict-FP32 grids."""
    layouts, forward = {}, UNet3D.forward

    def noted(self, *args, **kw):
        weights = [p for p in self.parameters() if p.dim() == 5]
        layouts[name].add(all(w.is_contiguous(memory_format=torch.channels_last_3d) for w in weights))
        return forward(self, *args, **kw)

    monkeypatch.setattr(UNet3D, "forward", noted)
    results = []
    for name, recipe in (("fp32", "recipe=[]"), ("cl", "recipe=[channels_last_3d]")):
        layouts[name] = set()
        step_search.main(compose_search([f"checkpoint={checkpoint}", "n=2", "steps=[5]", f"output_dir={tmp_path / name}",
                                         recipe]))
        results.append(json.loads((tmp_path / name / "step_search.json").read_text()))
    assert layouts == {"fp32": {False}, "cl": {True}}
    assert results[1]["recipes"] == ["channels_last_3d"]
    assert results[0]["results"]["5"]["grid"] == results[1]["results"]["5"]["grid"]
    assert results[1]["results"]["5"]["bound"] == pytest.approx(results[0]["results"]["5"]["bound"], rel=1e-4)


@pytest.mark.parametrize("overrides, pattern", [
    (["steps=[0]"], r"^steps=0: must be an integer >= 1"),
    (["steps=[60]"], r"^steps=60: must be an integer in \[1, 50\] \(the checkpoint's schedule has T = 50"),
    (["order=4"], r"^order=4: must be an integer in \[1, 3\]"),
    (["n=0"], r"^n=0: must be an integer >= 1"),
    (["name=a/b"], r"^name='a/b': must be a file stem"),
    (["n=40"], r"^n=40: synthetic whole_head phantoms \(seed 10000\) hold 32 volume\(s\); pass n=32 or data\.num_volumes=N$"),
    (["data.variant=brats"], r"^data: brats volumes, but .*last\.pt is a whole_head network; pass data\.variant="
                             r"whole_head$"),
    (["data=whole_head"], r"^data\.root: "),
], ids=["steps-zero", "steps-above-T", "order", "n-zero", "name-path", "n-above-data", "variant", "root-missing"])
def test_misuse_is_one_line(checkpoint, tmp_path, capsys, overrides, pattern):
    with pytest.raises(SystemExit) as exit_:
        step_search.main(compose_search([f"checkpoint={checkpoint}", f"output_dir={tmp_path}", *overrides]))
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, lines
    assert re.search(pattern, lines[0].removeprefix("error: ")), lines[0]
    assert not (tmp_path / "sampler").exists()


def test_an_output_dir_holding_a_search_is_refused(checkpoint, tmp_path, capsys):
    (tmp_path / "step_search.json").write_text("{}")
    with pytest.raises(SystemExit):
        step_search.main(compose_search([f"checkpoint={checkpoint}", f"output_dir={tmp_path}"]))
    assert capsys.readouterr().err.startswith(f"error: output_dir={tmp_path}: already holds a step search")
    assert (tmp_path / "step_search.json").read_text() == "{}"


def test_checkpoint_is_required(tmp_path, capsys):
    with pytest.raises(SystemExit):
        step_search.main(compose_search([f"output_dir={tmp_path}"]))
    assert capsys.readouterr().err.startswith("error: checkpoint: not set; pass checkpoint=PATH")
