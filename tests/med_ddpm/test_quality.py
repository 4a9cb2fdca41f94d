"""The quality gate on a tiny model: identical stacks pass, broken candidates fail, numbers are JSON."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.model import UNet3D
from med_ddpm.quality import (
    QualityGate,
    calibrate_floor,
    equivalent_execution,
    fixed_noise,
    load_thresholds,
    randomize_zero_init,
    run_trajectory,
)
from med_ddpm.samplers import DDPMSampler

SHAPE = (2, 1, 8, 8, 8)  # two samples of one mask, so distribution metrics run too
T = 4  # DDPM over a 4-step cosine schedule keeps each trajectory well under a second on CPU


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(one_thread):
    torch.manual_seed(0)
    net = UNet3D(in_channels=3, out_channels=1, model_channels=32, channel_mult=(1, 2), attention_ds=(2,)).eval()
    randomize_zero_init(net)  # a fresh net predicts eps = 0: nothing to compare
    sampler = DDPMSampler(NoiseSchedule(timesteps=T))
    sampler.set_timesteps(T)
    cond = -torch.ones(2, 2, 8, 8, 8)
    cond[:, 0, 2:6, 2:6, 2:6] = 1
    cond[:, 1, 3:5, 3:5, 3:5] = 1
    noise = fixed_noise(SHAPE, steps=T, seed=0)
    reference = run_trajectory(net, sampler, cond, noise)
    return net, sampler, cond, noise, reference


def _candidate(setup, model_fn):
    net, sampler, cond, noise, reference = setup
    return run_trajectory(model_fn, sampler, cond, noise, probe_inputs=reference.probe_inputs)


@pytest.fixture(scope="module")
def identical(setup):
    """The same FP32 model again: what an exact recipe must reproduce."""
    return _candidate(setup, setup[0])


@pytest.fixture(scope="module")
def broken(setup):
    """A candidate whose ε is off by 0.5 everywhere (a broken kernel)."""
    net = setup[0]
    return _candidate(setup, lambda x, t: net(x, t) + 0.5)


def test_fixed_noise_is_float32_seeded_and_order_independent():
    a, b = fixed_noise(SHAPE, 5, seed=7), fixed_noise(SHAPE, 5, seed=7)
    assert a.x_T.dtype == torch.float32 and len(a.step_noise) == 5
    assert torch.equal(a.step_noise[3], b.step_noise[3]) and torch.equal(a.x_T, b.x_T)
    assert not torch.equal(a.step_noise[3], a.step_noise[2])
    assert not torch.equal(a.x_T, fixed_noise(SHAPE, 5, seed=8).x_T)
    with pytest.raises(IndexError):
        a.step_noise[5]


def test_reference_records_probes_at_default_timesteps(setup):
    reference = setup[-1]
    assert all(e.abs().max() > 0.01 for e in reference.eps_probe.values())  # every path counts
    assert sorted(reference.eps_probe) == [0, 1, 2, 3]
    assert reference.probe_inputs[3].shape == (2, 3, 8, 8, 8)  # cat([x_t, cond])
    assert reference.samples.dtype == torch.float32 and reference.samples.device.type == "cpu"


def test_identical_stack_passes_with_zero_drift(setup, identical):
    report = QualityGate().run(setup[-1], identical)
    assert report.verdict == "pass", report.reasons
    assert report.metrics["eps_rel_l2"] == 0.0 and report.metrics["x0_max_error"] == 0.0
    assert report.metrics["x0_psnr"] == float("inf") and report.metrics["x0_nrmse"] == 0.0
    json.dumps(report.to_dict(), allow_nan=False)  # strict JSON for the bench row


def test_broken_candidate_fails(setup, broken):
    report = QualityGate().run(setup[-1], broken)
    assert report.verdict == "fail"
    assert report.checks["eps_max_abs"]["value"] == pytest.approx(0.5, abs=1e-5)
    assert report.checks["eps_rel_l2"]["status"] == "fail" and report.checks["x0_nrmse"]["status"] == "fail"
    assert any(r.startswith("eps_rel_l2=") for r in report.reasons)


def test_small_drift_warns(setup):
    net = setup[0]
    report = QualityGate().run(setup[-1], _candidate(setup, lambda x, t: net(x, t) * 1.01))
    assert report.checks["eps_rel_l2"]["status"] == "warn"  # 1 % relative: bf16-level error


def test_non_finite_sample_fails(setup, identical):
    candidate = dataclasses.replace(identical, samples=identical.samples.clone())
    candidate.samples[0, 0, 0, 0, 0] = float("nan")
    report = QualityGate().run(setup[-1], candidate)
    assert report.verdict == "fail" and report.checks["x0_nonfinite"]["value"] == 1
    json.dumps(report.to_dict(), allow_nan=False)


def test_other_sampler_is_not_judged_pairwise(setup, identical):
    candidate = dataclasses.replace(identical, sampler={"name": "DDIMSampler", "steps": 2})
    report = QualityGate().run(setup[-1], candidate)
    assert "x0_nrmse" not in report.checks and report.context["paired"] is False
    assert report.verdict == "warn"  # drift alone is no evidence; distribution floors are uncalibrated


def test_calibrated_floors_gate_distribution_metrics(setup, identical, broken):
    net, sampler, cond, noise, reference = setup
    floors = calibrate_floor(net, sampler, cond, noise, fixed_noise(SHAPE, T, seed=1))
    gate_checks = load_thresholds()["checks"]
    assert set(floors) == set(gate_checks) and all(v >= 0 for v in floors.values())
    assert floors["fid_vs_ref"] > 0 and floors["eps_rel_l2"] < 1e-4  # sampling noise >> round-off
    gate = QualityGate(floor=floors)
    good = gate.run(reference, identical)
    assert good.verdict == "pass" and "fid_vs_ref" in good.checks
    assert gate.run(reference, broken).verdict == "fail"


def test_every_configured_check_is_measured(setup, identical):
    metrics = QualityGate().measure(setup[-1], identical, real=setup[-1].samples)
    assert set(load_thresholds()["checks"]) <= set(metrics)
    assert {"fid_vs_real", "fid_vs_real_ref", "diversity", "diversity_ref"} <= set(metrics)


def test_bad_threshold_config_is_rejected():
    cfg = load_thresholds()
    cfg["checks"]["eps_rel_l2"]["kind"] = "vibes"
    with pytest.raises(ValueError, match="eps_rel_l2"):
        QualityGate(cfg)


def test_equivalent_execution_restores_flags():
    bench, threads = torch.backends.cudnn.benchmark, torch.get_num_threads()
    with equivalent_execution():
        assert torch.backends.cudnn.benchmark != bench
    assert torch.backends.cudnn.benchmark == bench and torch.get_num_threads() == threads


@pytest.mark.slow
def test_gate_from_config_on_the_real_configs():
    from hydra import compose, initialize_config_dir

    from med_ddpm.quality import gate_from_config

    configs = str(Path(__file__).resolve().parents[2] / "configs")
    with initialize_config_dir(config_dir=configs, version_base="1.3"):
        cfg = compose(config_name="bench", overrides=["model=tiny", "diffusion.timesteps=4", "sampler.steps=4",
                                                      "recipe=[channels_last_3d]"])
    report = gate_from_config(cfg, "cpu")
    assert report.verdict == "pass" and report.metrics["eps_rel_l2"] < 1e-5  # layout change: math equivalent
    assert {"fid_vs_real", "fid_vs_real_ref"} <= set(report.metrics)
    json.dumps(report.to_dict(), allow_nan=False)


def test_gate_reuses_a_cached_strict_reference(tmp_path, monkeypatch):
    """A ladder of gates over one model computes the FP32 reference and floors once."""
    from hydra import compose, initialize_config_dir

    from med_ddpm import quality

    configs = str(Path(__file__).resolve().parents[2] / "configs")
    with initialize_config_dir(config_dir=configs, version_base="1.3"):
        cfg = compose(config_name="bench", overrides=[
            "model=tiny", "model.image_size=[16,16,16]", "diffusion.timesteps=4", "sampler.steps=4",
            "quality.calibrate=true",
            f"quality.cache_dir={tmp_path}", "recipe=[channels_last_3d]"])
    first = quality.gate_from_config(cfg, "cpu").to_dict()
    assert len(list(tmp_path.glob("reference_*.pt"))) == 1

    def no_recompute(*args, **kwargs):
        raise AssertionError("the cached reference was not used")

    monkeypatch.setattr(quality, "calibrate_floor", no_recompute)
    assert quality.gate_from_config(cfg, "cpu").to_dict() == first
    cfg.seed = 1  # other noise: another reference
    with pytest.raises(AssertionError, match="cached reference was not used"):
        quality.gate_from_config(cfg, "cpu")
