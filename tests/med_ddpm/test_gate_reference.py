"""The gate's strict-FP32 reference at any size: computed once, cached on disk by what it depends on (the weights'
bytes, the sampler's whole config, the masks and noise seeds and N, the code), reused only while all of them match;
run in batches a GPU holds (the same samples whatever the batch); against the candidate's own sampler
(``quality.reference_sampler=same``); and the one-line refusals of a batch or a checkpoint that does not fit."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from med_ddpm.config_checks import ConfigError
from med_ddpm.quality import probe

CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")
N = 16  # the least sign-flip p-value, 2^-15, is far below alpha.bias over the probes


def compose(*overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return hydra_compose(config_name="bench", overrides=["experiment=bench_smoke", "diffusion.timesteps=4",
                                                             "sampler.steps=4", f"quality.n_samples={N}",
                                                             "quality.n_masks=4", *overrides])


def save_weights(path: Path, cfg, scale: float = 1.0) -> str:
    """The gate's seeded net as a checkpoint at ``path``; ``scale`` multiplies its last convolution (other bytes)."""
    from med_ddpm.checkpoint import save_checkpoint

    net, _ = probe.gate_model(cfg, None, 0)
    last = [m for m in net.modules() if isinstance(m, torch.nn.Conv3d)][-1]
    with torch.no_grad():
        last.weight.mul_(scale)
    config = {**{k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "diffusion")},
              "data": {"name": "synthetic", "variant": "whole_head"}}
    save_checkpoint(path, model_state=net.state_dict(), ema_state=net.state_dict(), config=config, step=1)
    return str(path)


@pytest.fixture
def references(monkeypatch):
    """The reference runs computed, as (sampler, noise seed, N): a reference records its probes (probe_inputs None),
    a candidate runs on the reference's."""
    computed = []
    real = probe.batched_trajectory

    def counted(model_fn, sampler, cond, channels, seed, batch, **kw):
        if kw.get("probe_inputs") is None:
            computed.append((type(sampler).__name__, seed, len(cond)))
        return real(model_fn, sampler, cond, channels, seed, batch, **kw)

    from med_ddpm.tuning import gate as tuning

    monkeypatch.setattr(probe, "batched_trajectory", counted)
    monkeypatch.setattr(tuning, "batched_trajectory", counted)  # med_ddpm.tune's runs, counted alike
    return computed


def gate(cfg, checkpoint=None):
    return probe.gate_from_config(cfg, "cpu", checkpoint=checkpoint).to_dict()


def test_the_same_key_reuses_the_reference_and_each_component_changed_recomputes_it(tmp_path, references,
                                                                                     monkeypatch):
    cache = f"quality.cache_dir={tmp_path / 'cache'}"
    cfg = compose(cache, "recipe=[channels_last_3d]")
    weights = save_weights(tmp_path / "a.pt", cfg)
    first = gate(cfg, weights)
    assert len(references) == 1 and first["verdict"] == "pass"
    assert gate(cfg, weights)["metrics"] == first["metrics"] and len(references) == 1, "same key: reused"
    copy = tmp_path / "copy.pt"
    copy.write_bytes(Path(weights).read_bytes())
    gate(cfg, str(copy))
    assert len(references) == 1, "the weights' bytes are the key, not the file's path or time"
    gate(compose(cache, "recipe=[channels_last_3d]", "sampler=ddim"), weights)
    assert len(references) == 1, "the DDPM reference does not depend on the candidate's sampler"
    gate(compose(cache, "recipe=[channels_last_3d]", "quality.batch_size=4"), weights)
    assert len(references) == 1, "nor on the batch it ran in"

    save_weights(Path(weights), cfg, scale=1.5)  # retrained at the same path
    gate(cfg, weights)
    assert len(references) == 2, "other weights: recomputed"
    gate(compose(cache, "recipe=[channels_last_3d]", "seed=1"), weights)
    assert len(references) == 3 and references[-1][1] == 1, "other masks and noise seed: recomputed"
    gate(compose(cache, "recipe=[channels_last_3d]", "quality.n_samples=20"), weights)
    assert len(references) == 4 and references[-1][2] == 20, "another N: recomputed"
    monkeypatch.setattr(probe, "reference_code_digest", lambda: "other code")
    gate(cfg, weights)
    assert len(references) == 5, "other code: recomputed"


def test_a_reference_on_the_candidates_sampler_is_keyed_by_that_samplers_whole_config(tmp_path, references):
    cache = f"quality.cache_dir={tmp_path}"
    same = ("recipe=[channels_last_3d]", "quality.reference_sampler=same", "sampler=ddim")
    report = gate(compose(cache, *same))
    assert references == [("DDIMSampler", 0, N)] and report["paired"] and report["verdict"] == "pass"
    assert report["reference_sampler"] == report["candidate_sampler"]
    gate(compose(cache, *same))
    assert len(references) == 1, "same sampler config: reused"
    gate(compose(cache, *same, "sampler.eta=1.0"))
    assert len(references) == 2, "one option of the sampler changed: recomputed"
    gate(compose(cache, *same, "sampler.steps=3"))
    assert len(references) == 3, "its steps changed: recomputed"


def test_a_batched_run_is_the_run_of_one_batch():
    """Sample i's noise comes from (seed, i): a gate in batches of 4 computes what one batch of N does (up to the
    float rounding a convolution's batch changes)."""
    shape = (N, 1, 8, 8, 8)
    whole, part = probe.batch_noise(shape, 4, 0, range(N), "cpu"), probe.batch_noise(shape, 4, 0, range(4, 8), "cpu")
    assert torch.equal(whole.x_T[4:8], part.x_T) and torch.equal(whole.step_noise[3][4:8], part.step_noise[3])
    one, batched = gate(compose("recipe=[]", "sampler=ddim")), gate(compose("recipe=[]", "sampler=ddim",
                                                                            "quality.batch_size=4"))
    assert batched["metrics"] == pytest.approx(one["metrics"], rel=1e-4, abs=1e-6)
    assert (batched["verdict"], batched["batch_size"], one["batch_size"]) == (one["verdict"], 4, N)


def test_a_probe_only_candidate_runs_in_batches_too():
    report = gate(compose("recipe=[]", "quality.trajectory=false", "quality.batch_size=8"))
    assert report["metrics"]["eps_noise"] == 0.0 and "x0_nrmse" not in report["metrics"]


def test_visited_probes_move_to_the_timesteps_a_few_step_sampler_calls():
    from med_ddpm.diffusion import NoiseSchedule
    from med_ddpm.samplers import sampler_from_config

    schedule = NoiseSchedule(timesteps=250)
    ddpm = sampler_from_config({"name": "ddpm", "steps": 250}, schedule)
    assert probe.visited_probes(ddpm) == probe.default_probe_timesteps(250)
    few = sampler_from_config({"name": "dpm_solver_pp", "steps": 10, "variant": "sde"}, schedule)
    visited = {int(t) for t in few.timesteps}
    assert set(probe.visited_probes(few)) <= visited and len(probe.visited_probes(few)) >= 3


@pytest.mark.parametrize("value, match", [(5, "must be a divisor"), (0, "must be a divisor"),
                                          ("x", "must be a divisor")])
def test_a_batch_size_that_is_no_divisor_of_n_is_refused(value, match):
    with pytest.raises(ConfigError, match=match):
        probe.gate_batch({"batch_size": value}, N)


def test_an_unknown_reference_sampler_is_refused():
    with pytest.raises(ConfigError, match="quality.reference_sampler=ddim: must be null"):
        gate(compose("recipe=[]", "quality.reference_sampler=ddim"))


def test_a_batch_the_gpu_cannot_hold_is_refused_naming_the_batch_that_fits():
    h100 = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30)
    probe.check_batch_fits(8, 32, (0.5, 4.2), h100)  # 34 GiB: fits
    with pytest.raises(ConfigError) as refused:
        probe.check_batch_fits(32, 32, (0.5, 4.2), h100)  # about 135 GiB
    line = str(refused.value)
    assert "\n" not in line and line.startswith("quality.batch_size=32:")
    assert "pass quality.batch_size=16" in line and "NVIDIA H100" in line  # 72 GiB usable, 16 x 4.2 + 0.5 fits
    with pytest.raises(ConfigError, match="cannot hold one volume"):
        probe.check_batch_fits(1, 32, (0.5, 100.0), h100)


def test_a_checkpoint_of_another_size_than_the_masks_is_refused_in_one_line(tmp_path):
    weights = save_weights(tmp_path / "a.pt", compose("recipe=[]"))
    with pytest.raises(ConfigError) as refused:
        gate(compose("recipe=[]", "model.image_size=[16,16,16]"), weights)
    assert "trained at 8x8x8" in str(refused.value) and "\n" not in str(refused.value)


def test_a_reference_cut_between_batches_is_finished_from_its_stored_batches(tmp_path, monkeypatch):
    """A reference longer than one device call: the batches stored before the cut are not run again."""
    cfg = compose(f"quality.cache_dir={tmp_path}", "recipe=[]", "quality.batch_size=4")
    recorded = []  # reference batches run: they record their probes
    real = probe.run_trajectory

    def cut_at_third(*args, **kw):
        if kw.get("probe_inputs") is None:
            recorded.append(len(args[2]))
            if len(recorded) == 3 and cut:
                raise KeyboardInterrupt("the device call ended")
        return real(*args, **kw)

    monkeypatch.setattr(probe, "run_trajectory", cut_at_third)
    cut = True
    with pytest.raises(KeyboardInterrupt):
        gate(cfg)
    cut = False
    report = gate(cfg)
    assert recorded == [4, 4, 4, 4, 4], "two batches before the cut, then only the two left and the one cut"
    assert report["verdict"] == "pass" and report["metrics"]["x0_nrmse"] == 0.0


def test_med_ddpm_tune_and_the_128_preset_share_one_ddpm_reference(tmp_path, references):
    """preset=quality_128 gates on seed 1, med_ddpm.tune's held-out gate seed: the same masks, noise, N and weights
    give the same key, so the reference the tuning stored is the gates' (a 128³ DDPM-250 reference is 27 minutes)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from med_ddpm import tune

    cfg = compose("recipe=[]", "sampler=ddpm", "seed=1", "quality.n_samples=10", "quality.n_masks=2",
                  f"quality.cache_dir={tmp_path / 'cache'}", "diffusion.timesteps=10", "sampler.steps=10")
    weights = save_weights(tmp_path / "last.pt", cfg)
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        tuned = hydra_compose("tune", overrides=[
            f"checkpoint={weights}", f"output_dir={tmp_path / 'tuned'}", f"paths.reference_cache={tmp_path / 'cache'}",
            "~experiment", "++sampler.variant=sde", "device=cpu", "progress=false", "budgets=[2]", "search.n=2",
            "gate.batch=5", "quality.n_samples=10", "quality.n_masks=2", "quality.n_perm=100"])
    tune.main(tuned)
    assert references == [("DDPMSampler", 1, 10)], "the tuning computed the reference once"
    gate(cfg, weights)
    assert len(references) == 1, "the gate read the tuning's reference"
