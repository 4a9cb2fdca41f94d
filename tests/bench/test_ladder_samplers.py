"""bench.ladder preset=samplers: the few-step samplers gated like the quality preset, plus every searched grid."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from bench.experiments.step_search import sampler_snippet
from bench.ladder import compose_job, ladder_jobs
from bench.sweep import CONFIG_DIR
from bench.worker import base_row
from med_ddpm.errors import ConfigError


def jobs(tmp_path) -> list[list[str]]:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("ladder", overrides=[f"out={tmp_path}", "preset=samplers",
                                           f"checkpoint={tmp_path / 'quality_model.pt'}"])
    return ladder_jobs(cfg)


@pytest.fixture
def searched_grid():
    """A step_search output in configs/sampler/, removed afterwards."""
    path = CONFIG_DIR / "sampler" / "ays_ladder_test_4.yaml"
    path.write_text(sampler_snippet([249, 120, 30, 2], 2, "a test", 1.0, 2.0))
    yield path
    path.unlink()


def test_samplers_preset_gates_2m_and_3m_and_the_searched_grids(tmp_path, searched_grid):
    configs = [compose_job(job, tmp_path / str(n))["config"] for n, job in enumerate(jobs(tmp_path))]
    assert all(c["bench"]["quality"] and c["bench"]["scenario"] == "full_sample" and c["bench"]["batch_size"] == 32
               for c in configs)
    assert {c["quality"]["cache_dir"] for c in configs} == {str(tmp_path / "gate_cache")}  # preset=quality's
    samplers = [c["sampler"] for c in configs]
    assert all(s["name"] == "dpm_solver_pp" and s["variant"] == "sde" for s in samplers)
    grid = {(s["steps"], s["order"], s["spacing"]) for s in samplers if s["timesteps"] is None}
    assert grid == {(n, o, sp) for n in (10, 25, 50) for o in (2, 3) for sp in ("trailing", "quadratic")}
    assert samplers[0]["steps"] == 25  # the budget first
    searched = [s for s in samplers if s["timesteps"] is not None]
    assert [(s["steps"], list(s["timesteps"])) for s in searched] == [(4, [249, 120, 30, 2])]
    rows = [base_row(compose_job(job, tmp_path / "x")) for job in jobs(tmp_path)]
    assert "dpm_solver_pp(order=3,variant=sde,spacing=quadratic)" in {r["sampler"] for r in rows}
    assert len({(r["sampler"], r["steps"]) for r in rows}) == len(rows)  # a row's label and steps name its sampler


def test_samplers_preset_needs_the_checkpoint(tmp_path):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("ladder", overrides=[f"out={tmp_path}", "preset=samplers"])
    with pytest.raises(ConfigError, match="checkpoint=PATH"):
        ladder_jobs(cfg)
