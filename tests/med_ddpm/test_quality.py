"""The quality gate on a tiny model at N = 32 (8 masks x 4 seeds): a second FP32 seed passes, a 5 % eps scale
and eps + N(0, 0.05^2) fail, a 1 % scale warns, numbers are strict JSON."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from med_ddpm.config_checks import ConfigError
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.model import UNet3D
from med_ddpm.quality.gate import QualityGate
from med_ddpm.quality.probe import (
    fixed_noise,
    load_thresholds,
    phantom_masks,
    probe_run,
    randomize_zero_init,
    run_trajectory,
)
from med_ddpm.quality.stats import bias_test, per_sample_fit
from med_ddpm.samplers import DDPMSampler, sampler_from_config

N, MASKS = 32, 8
SHAPE = (N, 1, 8, 8, 8)
T = 4  # DDPM over a 4-step cosine schedule keeps each N = 32 trajectory near a second on CPU
CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    net = UNet3D(in_channels=3, out_channels=1, model_channels=32, channel_mult=(1, 2), attention_ds=(2,)).eval()
    randomize_zero_init(net)  # a fresh net predicts eps = 0: nothing to compare
    sampler = DDPMSampler(NoiseSchedule(timesteps=T))
    sampler.set_timesteps(T)
    cond = phantom_masks(N, MASKS, (8, 8, 8), "whole_head", seed=0)
    reference = run_trajectory(net, sampler, cond, fixed_noise(SHAPE, steps=T, seed=0))
    return net, sampler, cond, reference


@pytest.fixture(scope="module")
def gate():
    return QualityGate(load_thresholds())


def _candidate(setup, model_fn, seed=0):
    net, sampler, cond, reference = setup
    return run_trajectory(model_fn, sampler, cond, fixed_noise(SHAPE, T, seed), probe_inputs=reference.probe_inputs)


def test_fixed_noise_is_float32_seeded_and_order_independent():
    a, b = fixed_noise(SHAPE, 5, seed=7), fixed_noise(SHAPE, 5, seed=7)
    assert a.x_T.dtype == torch.float32 and len(a.step_noise) == 5
    assert torch.equal(a.step_noise[3], b.step_noise[3]) and torch.equal(a.x_T, b.x_T)
    assert not torch.equal(a.step_noise[3], a.step_noise[2])
    assert not torch.equal(a.x_T, fixed_noise(SHAPE, 5, seed=8).x_T)
    with pytest.raises(IndexError):
        a.step_noise[5]


def test_phantom_masks_are_strata_of_equal_size():
    cond = phantom_masks(N, MASKS, (8, 8, 8), "whole_head", seed=0)
    assert cond.shape == (N, 2, 8, 8, 8)
    assert len(torch.unique(cond.flatten(1), dim=0)) == MASKS and torch.equal(cond[0], cond[N // MASKS - 1])
    with pytest.raises(ValueError, match="multiple of quality.n_masks"):
        phantom_masks(30, MASKS, (8, 8, 8), "whole_head", seed=0)


def test_reference_records_probes_for_every_sample(setup):
    reference = setup[-1]
    assert sorted(reference.eps_probe) == [0, 1, 2, 3]
    assert reference.probe_inputs[3].shape == (N, 3, 8, 8, 8)  # cat([x_t, cond])
    assert all(e.abs().max() > 0.01 for e in reference.eps_probe.values())  # every path counts


def test_identical_stack_passes_with_zero_drift(setup, gate):
    report = gate.run(setup[-1], _candidate(setup, setup[0]))
    assert report.verdict == "pass", report.reasons
    assert report.metrics["eps_rel_l2"] == 0.0 and report.metrics["x0_nrmse"] == 0.0
    assert report.checks["kid_vs_ref"]["value"] < 0  # unbiased: negative for equal sets, and still a pass
    json.dumps(report.to_dict(), allow_nan=False)  # strict JSON for the bench row


def test_fp32_with_another_seed_passes_without_paired_checks(setup, gate):
    report = gate.run(setup[-1], _candidate(setup, setup[0], seed=1))
    assert report.verdict == "pass", report.reasons
    assert report.context["paired"] is False and "x0_nrmse" not in report.checks
    kid = report.checks["kid_vs_ref"]
    assert 0 < kid["p_value"] <= 1 and set(kid["null_quantiles"]) == {"q05", "q50", "q95"}
    assert kid["null_quantiles"]["q05"] < 0 < kid["null_quantiles"]["q95"]  # the null straddles 0


@pytest.mark.parametrize("factor, status", [(1.05, "fail"), (1.02, "fail"), (1.01, "warn")])
def test_eps_scale_is_caught_as_a_bias(setup, gate, factor, status):
    net = setup[0]
    report = gate.run(setup[-1], _candidate(setup, lambda x, t: net(x, t) * factor))
    check = report.checks["eps_scale_bias"]
    assert check["value"] == pytest.approx(factor - 1, rel=1e-4) and check["status"] == status
    assert report.checks["eps_noise"]["value"] < 1e-5  # a pure scale leaves no random part
    assert report.verdict == status
    assert report.context["min_detectable_eps_bias"] == pytest.approx(0.015)


def test_eps_noise_fails_as_noise_not_bias(setup, gate):
    net = setup[0]
    g = torch.Generator().manual_seed(0)
    report = gate.run(setup[-1], _candidate(setup, lambda x, t: (e := net(x, t)) + 0.05 * torch.randn(e.shape, generator=g)))
    assert report.checks["eps_noise"]["value"] == pytest.approx(0.05, rel=0.05)
    assert report.checks["eps_noise"]["status"] == "fail" and report.checks["eps_scale_bias"]["status"] == "pass"
    assert report.verdict == "fail"


def test_non_finite_sample_fails(setup, gate):
    candidate = _candidate(setup, setup[0])
    candidate = dataclasses.replace(candidate, samples=candidate.samples.clone())
    candidate.samples[0, 0, 0, 0, 0] = float("nan")
    report = gate.run(setup[-1], candidate)
    assert report.verdict == "fail" and report.checks["x0_nonfinite"]["value"] == 1
    json.dumps(report.to_dict(), allow_nan=False)


def test_probe_only_run_can_fail_but_never_pass(setup, gate):
    net, _, _, reference = setup
    same = gate.run(reference, probe_run(net, reference, "cpu"))
    assert same.verdict == "warn" and set(same.checks) == {"eps_scale_bias", "eps_mean_bias", "eps_noise"}
    scaled = gate.run(reference, probe_run(lambda x, t: net(x, t) * 1.05, reference, "cpu"))
    assert scaled.verdict == "fail"


def test_a_different_distribution_fails_the_permutation_tests(setup, gate):
    candidate = _candidate(setup, setup[0], seed=1)
    shifted = dataclasses.replace(candidate, samples=(candidate.samples * 0.5 + 0.3).clamp(-1, 1))
    report = gate.run(setup[-1], shifted)
    assert report.checks["histogram_w1_vs_ref"]["status"] == "fail"
    assert report.checks["mmd_vs_ref"]["p_value"] < 0.01 and report.verdict == "fail"


def _shifted_probes(reference, shifts):
    """A probe-only candidate: the reference's ε at every probe plus, per timestep, a per-sample offset."""
    eps = {t: e + shifts.get(t, torch.zeros(N)).view(N, *[1] * (e.dim() - 1)) for t, e in reference.eps_probe.items()}
    return dataclasses.replace(reference, samples=None, eps_probe=eps)


def test_a_significant_bias_at_any_probed_timestep_fails(setup, gate):
    """At t = 0 a large mean offset that sign flips reach often (20 samples +0.3, 12 at -0.3: not significant); at
    t = 2 a smaller one that every sample shares. The check fails at t = 2: judging only the timestep of the largest
    mean would pass it."""
    reference = setup[-1]
    scattered = torch.tensor([0.3] * 20 + [-0.3] * 12)
    report = gate.run(reference, _shifted_probes(reference, {0: scattered, 2: torch.full((N,), 0.02)}))
    check = report.checks["eps_mean_bias"]
    assert check["status"] == "fail" and check["t"] == 2 and check["value"] == pytest.approx(0.02, rel=1e-3)
    assert check["per_t"][0]["value"] == pytest.approx(0.075, rel=1e-3) and check["per_t"][0]["p_value"] > 0.1
    assert check["p_value"] < 0.01 and check["p_value"] == pytest.approx(4 / 1001)  # Holm: 4 probes x the smallest p
    assert report.verdict == "fail"
    alone = gate.run(reference, _shifted_probes(reference, {0: scattered}))
    assert alone.checks["eps_mean_bias"]["status"] == "pass"  # the scattered offset alone is no bias


@pytest.mark.parametrize("n, n_perm, refused", [(8, 1000, "quality.n_samples=8: .* pass quality.n_samples>=10$"),
                                                (10, 1000, None),
                                                (32, 200, "quality.n_perm=200: .* pass quality.n_perm>=400$"),
                                                (32, 400, None)])
def test_bias_checks_refuse_an_n_at_which_they_could_never_fail(n, n_perm, refused):
    """Over 4 probed timesteps at alpha.bias 0.01, Holm's first step asks p < 0.0025: the exact sign-flip test's
    smallest p is 2 / 2^N (0.0078 at N = 8, 0.002 at N = 10); random flips' is 1 / (1 + n_perm)."""
    gate = QualityGate({**load_thresholds(), "n_perm": n_perm})
    if refused is None:
        gate.check_bias_power(n, 4)
        return
    with pytest.raises(ConfigError, match=refused):
        gate.check_bias_power(n, 4)


def test_the_smallest_detected_eps_noise_is_reported_beside_the_bias(setup, gate):
    report = gate.run(setup[-1], probe_run(setup[0], setup[-1], "cpu"))
    assert report.context["min_detectable_eps_noise"] == load_thresholds()["checks"]["eps_noise"]["warn"]
    assert report.context["min_detectable_eps_bias"] == pytest.approx(0.015)  # no noise: the fail limit


def test_the_smallest_detected_eps_bias_is_the_noise_s_quantile_at_holm_s_first_level_above_the_fail_limit(setup,
                                                                                                           gate):
    """Per-sample ε scale errors of sd 0.05 and mean 0: the smallest δ the gate can tell from them is the
    (1 - alpha.bias / 4 probed timesteps) quantile of the sign-flipped mean, at the timestep where it is least; a
    ``fail`` limit above it is the floor."""
    reference = setup[-1]
    spread = 0.05 * torch.randn(N, generator=torch.Generator().manual_seed(3))
    spread -= spread.mean()
    scaled = {t: e * (1 + spread).view(N, 1, 1, 1, 1) for t, e in reference.eps_probe.items()}
    candidate = dataclasses.replace(reference, samples=None, eps_probe=scaled)
    slopes = {t: per_sample_fit(scaled[t], e)[0] - 1 for t, e in reference.eps_probe.items()}
    holm_first = min(bias_test(d, n_perm=1000, alpha=0.01 / 4).detectable for d in slopes.values())
    assert holm_first > min(bias_test(d, n_perm=1000, alpha=0.01).detectable for d in slopes.values()) > 0.015
    assert gate.run(reference, candidate).context["min_detectable_eps_bias"] == pytest.approx(holm_first)
    floor = load_thresholds()
    floor["checks"]["eps_scale_bias"]["fail"] = 0.2
    assert QualityGate(floor).run(reference, candidate).context["min_detectable_eps_bias"] == 0.2


def test_bad_threshold_config_is_rejected():
    cfg = load_thresholds()
    cfg["checks"]["eps_noise"]["kind"] = "vibes"
    with pytest.raises(ValueError, match="eps_noise"):
        QualityGate(cfg)


N_GATE = 16  # the gates run from the real configs: the least sign-flip p-value, 2^-15, stays far below alpha.bias


def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name="bench", overrides=["experiment=bench_smoke", "diffusion.timesteps=4",
                                                       "sampler.steps=4", f"quality.n_samples={N_GATE}", *overrides])


def test_gate_reuses_a_cached_strict_reference(tmp_path, monkeypatch):
    """A ladder of gates over one model computes the FP32 reference once."""
    from med_ddpm.quality import probe as quality

    cfg = _compose(f"quality.cache_dir={tmp_path}", "recipe=[channels_last_3d]")
    first = quality.gate_from_config(cfg, "cpu").to_dict()
    assert first["verdict"] == "pass" and first["n_samples"] == N_GATE
    assert len(list(tmp_path.glob("reference_*.pt"))) == 1

    def no_recompute(*args, **kwargs):
        raise AssertionError("the cached reference was not used")

    monkeypatch.setattr(quality, "run_trajectory", no_recompute)
    cfg.quality.trajectory = False
    assert quality.gate_from_config(cfg, "cpu").to_dict()["checks"]["eps_noise"]["value"] < 1e-5  # layout: round-off
    cfg.seed = 1  # other noise: another reference
    with pytest.raises(AssertionError, match="cached reference was not used"):
        quality.gate_from_config(cfg, "cpu")


def test_a_sampler_with_more_calls_than_t_gets_a_noise_field_per_call(monkeypatch):
    """Restart sampling can make more model calls than the T steps of the DDPM reference: the candidate's fixed
    noise has one field per call, counted on the one sampler the candidate runs."""
    from med_ddpm.quality import probe as quality

    built = []

    def counted(*args):
        built.append(sampler_from_config(*args))
        return built[-1]

    monkeypatch.setattr(quality, "sampler_from_config", counted)
    cfg = _compose("diffusion.timesteps=8", "sampler=restart", "sampler.steps=4", "sampler.spacing=trailing",
                   "sampler.t_min=3", "sampler.t_max=7", "sampler.restarts=3", "sampler.restart_steps=2", "recipe=[]")
    report = quality.gate_from_config(cfg, "cpu").to_dict()
    assert report["candidate_sampler"] == {"name": "RestartSampler", "steps": 4, "calls": 10}
    assert [type(s).__name__ for s in built] == ["RestartSampler"]  # built once: sized the noise, then ran
    assert report["verdict"] in {"pass", "warn", "fail"}


def _save_weights(path, cfg, scale_output: float = 1.0):
    """A checkpoint of the gate's seeded net; ``scale_output`` multiplies the last conv: ε × scale exactly."""
    from omegaconf import OmegaConf

    from med_ddpm.checkpoint import save_checkpoint
    from med_ddpm.quality.probe import gate_model

    net, _ = gate_model(cfg, None, 0)
    last = [m for m in net.modules() if isinstance(m, torch.nn.Conv3d)][-1]
    with torch.no_grad():
        last.weight.mul_(scale_output), last.bias.mul_(scale_output)
    config = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "diffusion")}
    save_checkpoint(path, model_state=net.state_dict(), ema_state=net.state_dict(), config=config, step=1)
    return str(path)


def test_two_checkpoints_same_weights_pass_and_other_weights_fail(tmp_path):
    """quality.candidate_checkpoint: the candidate arm runs the other weights exactly as the reference runs."""
    from med_ddpm.quality.probe import gate_from_config

    cfg = _compose("recipe=[]", "sampler=ddpm")
    same, scaled = _save_weights(tmp_path / "a.pt", cfg), _save_weights(tmp_path / "b.pt", cfg, scale_output=1.1)
    cfg.quality.candidate_checkpoint = same
    report = gate_from_config(cfg, "cpu", checkpoint=same).to_dict()
    assert report["verdict"] == "pass" and report["paired"] and report["metrics"]["eps_rel_l2"] == 0.0
    assert report["checkpoints"] == {"reference": same, "candidate": same}
    cfg.quality.candidate_checkpoint = scaled
    report = gate_from_config(cfg, "cpu", checkpoint=same).to_dict()
    assert report["checkpoints"]["candidate"] == scaled and report["verdict"] == "fail"
    assert report["checks"]["eps_scale_bias"]["value"] == pytest.approx(0.1, rel=1e-3)
    assert report["checks"]["eps_scale_bias"]["status"] == "fail" and report["checks"]["x0_nrmse"]["value"] > 0


def test_two_checkpoints_refuse_a_stack_or_another_network(tmp_path):
    from med_ddpm.config_checks import ConfigError
    from med_ddpm.quality.probe import gate_from_config

    cfg = _compose("recipe=[]", "sampler=ddpm")
    mine = _save_weights(tmp_path / "a.pt", cfg)
    other = _save_weights(tmp_path / "b.pt", _compose("model.image_size=[8,8,8]", "model.channel_mult=[1,1]"))
    with pytest.raises(ConfigError, match="another network"):
        gate_from_config(_compose("recipe=[]", "sampler=ddpm", f"quality.candidate_checkpoint={other}"), "cpu",
                         checkpoint=mine)
    with pytest.raises(ConfigError, match=r"pass recipe=\[\] sampler=ddpm"):
        gate_from_config(_compose("recipe=[tf32]", f"quality.candidate_checkpoint={mine}"), "cpu", checkpoint=mine)


@pytest.mark.parametrize("name", ["model.py", "diffusion.py", "samplers/base.py", "samplers/ddpm.py",
                                  "quality/probe.py", "data/phantoms.py"])
def test_an_edit_to_the_code_that_computes_the_reference_is_a_new_cache_key(name, monkeypatch):
    """The key holds the source text of what runs the reference (network, schedule, DDPM, the sampling loop, the
    probes, the phantom masks): a cached reference is never read back for code that would compute another."""
    from med_ddpm.quality import probe as quality

    digest, read_text = quality.reference_code_digest(), Path.read_text
    edited = Path(quality.__file__).parents[1] / name
    monkeypatch.setattr(Path, "read_text", lambda self, *args, **kw: read_text(self, *args, **kw)
                        + ("\n# edited" if self == edited else ""))
    assert quality.reference_code_digest() != digest


def test_the_cached_reference_is_keyed_by_torch_and_the_code_that_computes_it(monkeypatch):
    from med_ddpm.quality import probe as quality

    digest = quality.reference_code_digest()
    assert digest == quality.reference_code_digest() and len(digest) == 16
    monkeypatch.setattr(quality.torch, "__version__", "0.0.0")
    assert quality.reference_code_digest() != digest
