"""The negative controls and the quality ladder: each control does what its label says, the gate fails the
harmful ones and passes strict FP32 with another seed and the FP32 recipes, through the real configs."""


import pytest
import torch
from hydra import compose, initialize_config_dir

from bench.core import presets
from bench.core.records import job_key, recipe_label
from bench.core.runner import compose_job
from bench.core.worker import base_row
from bench.quality.controls import EpsNoise, EpsScale, SkipGroupNorm
from med_ddpm.cli import CONFIG_DIR
from med_ddpm.config_checks import ConfigError
from med_ddpm.model import UNet3D
from med_ddpm.quality.probe import gate_from_config, randomize_zero_init
from optim.base import DeviceInfo


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    model = UNet3D(in_channels=3, out_channels=1, model_channels=32, channel_mult=(1, 2), attention_ds=(2,)).eval()
    return randomize_zero_init(model)  # a fresh net predicts eps = 0: every control would be invisible


def _call(model):
    x = torch.randn(2, 3, 8, 8, 8, generator=torch.Generator().manual_seed(1))
    return model(x, torch.tensor([1, 2]))


def test_eps_scale_and_noise_do_what_their_labels_say(net):
    eps = _call(net)
    assert eps.abs().mean() > 0.1
    scale = EpsScale(1.05)
    assert scale.label == "eps_scale(1.05)" and scale.describe()["negative_control"] is True
    assert torch.allclose(_call(scale.prepare_model(net)), eps * 1.05)
    noisy = _call(EpsNoise(0.05).prepare_model(net)) - eps
    assert noisy.std().item() == pytest.approx(0.05, rel=0.2) and abs(noisy.mean().item()) < 0.02


def test_skip_groupnorm_removes_exactly_one(net):
    import copy

    count = lambda m: sum(isinstance(x, torch.nn.GroupNorm) for x in m.modules())  # noqa: E731
    skipped = SkipGroupNorm(0).prepare_model(copy.deepcopy(net))
    assert count(skipped) == count(net) - 1 and not torch.allclose(_call(skipped), _call(net))
    with pytest.raises(ValueError, match="out of range"):
        SkipGroupNorm(10_000).prepare_model(copy.deepcopy(net))


def test_controls_are_never_shipped_recipes():
    recipe_dir = CONFIG_DIR / "recipe"
    for control in (CONFIG_DIR / "control").glob("*.yaml"):
        assert not (recipe_dir / control.name).exists()
        assert "bench.quality.controls." in control.read_text()
    assert not any("bench.quality.controls" in p.read_text() for p in recipe_dir.glob("*.yaml"))


def _gate(*overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("bench", overrides=["experiment=bench_smoke", "diffusion.timesteps=4", "sampler.steps=4",
                                          "output_dir=unused", *overrides])
    return gate_from_config(cfg, "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("overrides, verdict", [
    (["recipe=[]", "quality.candidate_seed=1"], "pass"),
    (["recipe=[channels_last_3d]"], "pass"),
    (["recipe=[]", "+control=eps_scale", "recipe.eps_scale.factor=1.05"], "fail"),
    (["recipe=[]", "+control=eps_noise", "recipe.eps_noise.sigma=0.05", "quality.trajectory=false"], "fail"),
    (["recipe=[]", "+control=eps_noise", "recipe.eps_noise.sigma=0.04", "quality.trajectory=false"], "warn"),
])
def test_the_gate_end_to_end_on_the_real_configs(overrides, verdict):
    """The tiny model, a 4-step schedule, N = 32 (8 masks x 4 seeds), composed exactly as the ladder does. The
    eps-noise controls run probe-only, as in the ladder: 0.05 is above the smallest noise the gate fails, 0.04
    below it (warn)."""
    report = _gate(*overrides)
    assert report.verdict == verdict, report.reasons
    assert report.context["n_samples"] == 32 and report.context["n_masks"] == 8
    assert report.context["min_detectable_eps_bias"] <= 0.02
    assert 0.04 < report.context["min_detectable_eps_noise"] < 0.05


@pytest.mark.slow
def test_tf32_on_a_cpu_is_the_strict_fp32_run_itself():
    """tf32 sets CUDA flags no CPU kernel reads: on a CPU its gate compares strict FP32 with itself, so a pass here
    says nothing about TF32 (the quality ladder gates it on the GPU). What the CPU can check is that it is inert."""
    from optim.tf32 import Tf32

    assert Tf32().capabilities.inert_on(DeviceInfo.of("cpu"))
    report = _gate("recipe=[tf32]")
    assert report.metrics["eps_rel_l2"] == 0.0 and report.metrics["x0_nrmse"] == 0.0, report.reasons


def quality_ladder(checkpoint):
    return [job.overrides for job in presets.jobs("quality", {"checkpoint": checkpoint})]


def test_quality_ladder_runs_controls_and_shipped_stacks_at_n32(tmp_path):
    jobs = list(quality_ladder(str(tmp_path / "quality_model.pt")))
    rows = [base_row(compose_job(job, tmp_path / str(n))) for n, job in enumerate(jobs)]
    assert len({job_key(r) for r in rows}) == len(rows)
    labels = [recipe_label(r) for r in rows]
    for factor in ("1.01", "1.02", "1.05", "1.1"):
        assert f"eps_scale [eps_scale.factor={factor}]" in labels
    assert "tf32" in labels and "channels_last_3d" in labels
    noise = [c["recipe"]["eps_noise"]["sigma"] for c in (r["config"] for r in rows) if "eps_noise" in (c.get("recipe") or {})]
    assert noise == [0.04, 0.05]  # below and above the smallest eps noise the gate fails (0.045)
    configs = [r["config"] for r in rows]
    assert all(c["quality"]["n_samples"] >= 32 and c["model"]["image_size"] == [64, 64, 64] for c in configs)
    assert not configs[0].get("recipe") and configs[0]["quality"]["candidate_seed"] == 1
    assert {c["quality"]["cache_dir"] for c in configs} == {str(tmp_path / "gate_cache")}
    fp16, bf16 = ([r for r in rows if dtype in r["recipes"]] for dtype in ("amp_fp16", "amp_bf16"))
    assert len(fp16) == 1 and fp16[0]["sampler"] == "dpm_solver_pp(variant=sde)"
    assert len(bf16) == 2 and {r["sampler"] for r in bf16} == {"dpm_solver_pp(variant=sde)"}
    assert configs[-1]["sampler"]["clip_denoised"] is False


def test_quality_ladder_gates_fast_sample_exactly_as_shipped(tmp_path):
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        shipped = compose("sample", overrides=["experiment=fast_sample", "checkpoint=x.pt"])
    jobs = list(quality_ladder(str(tmp_path / "q.pt")))
    configs = [compose_job(job, tmp_path / str(n))["config"] for n, job in enumerate(jobs)]
    assert any(c.get("recipe") == OmegaConf.to_container(shipped.recipe, resolve=True)
               and c["sampler"] == OmegaConf.to_container(shipped.sampler, resolve=True) for c in configs)


def test_quality_ladder_needs_a_checkpoint():
    with pytest.raises(ConfigError, match="checkpoint=PATH"):
        list(quality_ladder(None))


@pytest.mark.slow
def test_a_control_row_through_the_bench_worker(tmp_path):
    """What the quality ladder's control jobs do, on the smoke model: a subprocess job whose row fails the gate."""
    from bench.core.worker import run_job

    job = compose_job(["experiment=bench_smoke", "bench=denoise_step", "bench.quality=true", "diffusion.timesteps=4",
                       "sampler.steps=4", "recipe=[]", "+control=eps_scale", "recipe.eps_scale.factor=1.05",
                       "quality.trajectory=false"], tmp_path)
    row = run_job(job, tmp_path / "job", timeout_s=240)
    assert row["status"] == "ok", row["message"]
    assert recipe_label(row) == "eps_scale [eps_scale.factor=1.05]"
    assert row["quality"]["verdict"] == "fail" and row["quality"]["checks"]["eps_scale_bias"]["status"] == "fail"
    assert row["quality"]["min_detectable_eps_bias"] <= 0.02
