"""experiment=quality_model_128: the network the 128^3 rows time, trained with the shipped training stack on synthetic
phantoms, its steps sized from the committed H100 rows to about 25 minutes."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from bench.reporting.evidence import choose_run

ROOT = Path(__file__).resolve().parents[2]
H100 = ROOT / "bench" / "results" / "h100"


def train_config(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=["output_dir=x", *overrides])


@pytest.fixture(scope="module")
def cfg():
    return train_config("experiment=quality_model_128")


@pytest.fixture(scope="module")
def timed():
    return choose_run(H100, [])


def test_its_network_is_the_timed_128_network(cfg, timed):
    model = OmegaConf.to_container(cfg.model, resolve=True)
    for job in ("forward.shipped", "train_step.shipped", "ddpm250.strict_fp32", "fast_sampler.shipped",
                "sampler25.shipped"):
        row = timed.ok(job)
        assert row["config"]["model"] == model, job
        assert row["config"]["diffusion"] == OmegaConf.to_container(cfg.diffusion, resolve=True), job


def test_it_trains_with_fast_trains_stack_and_batch_on_phantoms(cfg):
    shipped = train_config("experiment=fast_train")
    assert OmegaConf.to_container(cfg.recipe) == OmegaConf.to_container(shipped.recipe)
    assert (cfg.train.batch_size, cfg.train.grad_accum) == (shipped.train.batch_size, shipped.train.grad_accum)
    assert cfg.data.name == "synthetic" and list(cfg.data.image_size) == [128, 128, 128]
    assert cfg.seed == 0 and cfg.train.max_steps % cfg.train.save_every == 0


def test_its_steps_fit_about_25_minutes_of_the_measured_h100_step(cfg, timed):
    """The steps' time at the committed train_step.shipped row's median (batch 2) leaves room within 25 min for the
    cold compile and the checkpoint saves, and the EMA averages most of the run."""
    step_s = timed.ms("train_step.shipped") / 1000
    minutes = cfg.train.max_steps * step_s / 60
    assert 20 <= minutes <= 23.5, minutes
    assert cfg.train.ema_start < cfg.train.max_steps / 2
