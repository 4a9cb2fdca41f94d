"""bench.ladder preset=samplers: the few-step samplers gated like the quality preset, every searched grid and
restart sampling at 25 model calls."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from bench.core import presets, worker
from bench.core.runner import compose_job
from bench.core.worker import base_row
from bench.ladder import ladder_jobs
from med_ddpm import cli
from med_ddpm.cli import CONFIG_DIR
from med_ddpm.config_checks import ConfigError
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.samplers import sampler_from_config
from med_ddpm.samplers.search import sampler_snippet


def jobs(tmp_path, config_dir: Path) -> list[list[str]]:
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = compose("ladder", overrides=[f"out={tmp_path}", "preset=samplers",
                                           f"checkpoint={tmp_path / 'quality_model.pt'}"])
    return ladder_jobs(cfg)


@pytest.fixture
def searched_grid(tmp_path, monkeypatch) -> Path:
    """A copy of configs/ under ``tmp_path`` with a step_search output in its sampler/, which the ladder and its
    jobs read in place of configs/ (a test writes only under its own folder: the suite runs on parallel workers)."""
    configs = shutil.copytree(CONFIG_DIR, tmp_path / "configs")
    grid = sampler_snippet([249, 120, 30, 2], 2, "a test", 1.0, 2.0)
    (configs / "sampler" / "ays_ladder_test_4.yaml").write_text(grid)
    for module in (cli, presets, worker):
        monkeypatch.setattr(module, "CONFIG_DIR", configs)
    return configs


def test_samplers_preset_gates_2m_3m_the_searched_grids_restarts_and_sa_solver(tmp_path, searched_grid):
    composed = [compose_job(job, tmp_path / str(n)) for n, job in enumerate(jobs(tmp_path, searched_grid))]
    configs = [c["config"] for c in composed]
    assert all(c["bench"]["quality"] and c["bench"]["scenario"] == "full_sample" and c["bench"]["batch_size"] == 32
               for c in configs)
    assert {c["quality"]["cache_dir"] for c in configs} == {str(tmp_path / "gate_cache")}  # preset=quality's
    samplers = [c["sampler"] for c in configs if c["sampler"]["name"] not in ("restart", "sa_solver")]
    assert all(s["name"] == "dpm_solver_pp" and s["variant"] == "sde" for s in samplers)
    grid = {(s["steps"], s["order"], s["spacing"]) for s in samplers if s["timesteps"] is None}
    assert grid == {(n, o, sp) for n in (10, 25, 50) for o in (2, 3) for sp in ("trailing", "quadratic")} | {
        (100, 2, "trailing")}  # experiment=fast_sample's own sampler, the last job
    assert samplers[-1]["steps"] == 100
    assert samplers[0]["steps"] == 25  # the budget first
    searched = [s for s in samplers if s["timesteps"] is not None]
    files = sorted((searched_grid / "sampler").glob("ays_*.yaml"))  # the committed grids and the test's
    assert [(s["steps"], list(s["timesteps"])) for s in searched] == [
        (len(t := OmegaConf.load(f).timesteps), list(t)) for f in files]
    assert (4, [249, 120, 30, 2]) in [(s["steps"], list(s["timesteps"])) for s in searched]
    rows = [base_row(c) for c in composed]
    assert "dpm_solver_pp(order=3,variant=sde,spacing=quadratic)" in {r["sampler"] for r in rows}
    assert len({(r["sampler"], r["steps"]) for r in rows}) == len(rows)  # a row's label and steps name its sampler
    restarts = [(c, r) for c, r in zip(configs, rows) if c["sampler"]["name"] == "restart"]
    assert {(c["sampler"]["variant"], c["sampler"]["t_min"], c["sampler"]["t_max"]) for c, _ in restarts} == {
        (v, t_min, t_max) for v in ("ode", "sde") for t_min, t_max in ((28, 111), (16, 85), (62, 173))}
    assert {r["steps"] for _, r in restarts} == {25}  # the row's steps are its model calls, not the main pass's 13
    assert "restart" in {r["sampler"] for _, r in restarts}  # configs/sampler/restart.yaml as is
    schedule = NoiseSchedule.from_config(configs[0]["diffusion"])
    assert all(len(sampler_from_config(c["sampler"], schedule).timesteps) == 25 for c, _ in restarts)
    sa = [(c["sampler"], r) for c, r in zip(configs, rows) if c["sampler"]["name"] == "sa_solver"]
    assert {(s["steps"], s["spacing"], s["predictor_order"], s["corrector_order"], s["tau"]) for s, _ in sa} == {
        (n, spacing, o, o, 1.0) for n, spacing in ((25, "quadratic"), (10, "trailing")) for o in (2, 3)}
    assert all(len(sampler_from_config(s, schedule).timesteps) == r["steps"] for s, r in sa)


def test_samplers_preset_needs_the_checkpoint(tmp_path):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("ladder", overrides=[f"out={tmp_path}", "preset=samplers"])
    with pytest.raises(ConfigError, match="checkpoint=PATH"):
        ladder_jobs(cfg)
