"""The training loop on tiny CPU configs: it learns, resumes exactly, and samples to NIfTI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from med_ddpm import train as train_mod
from med_ddpm.checkpoint import load_checkpoint, read_checkpoint
from med_ddpm.data.phantoms import write_phantom_niftis
from med_ddpm.diffusion import diffusion_loss
from med_ddpm.sample import run as run_sample
from med_ddpm.train import EpochSampler, build, fit
from optim import RecipeStack, UnsupportedRecipeError

CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")
# A 2-level net on 8^3: the real code path at a size a 2-core CPU trains in a fraction of a second a step.
SMALL = ["model=tiny", "model.image_size=[8,8,8]", "model.channel_mult=[1,2]", "model.attention_ds=[2]",
         "device=cpu"]


def cfg_for(name: str, out: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        quiet = "train.progress=false" if name == "train" else "progress=false"
        return compose(config_name=name, overrides=[*SMALL, quiet, f"output_dir={out}", *overrides])


def test_epoch_sampler_resumes_mid_epoch():
    full = EpochSampler(5, seed=3)
    it = iter(full)
    first = [next(it) for _ in range(13)]
    resumed = iter(EpochSampler(5, seed=3, start=7))
    assert [next(resumed) for _ in range(6)] == first[7:]
    assert sorted(first[:5]) == list(range(5)) and first[:5] != first[5:10]


def eval_loss(job) -> float:
    """L1 loss at fixed t and noise on the first phantom: a noise-free view of learning."""
    item = job.dataset[0]
    x, cond = item["image"][None], item["cond"][None]
    gen = torch.Generator().manual_seed(1)
    t = torch.tensor([20, 60, 120, 200])
    noise = torch.randn((4, *x.shape[1:]), generator=gen)
    with torch.no_grad():
        return diffusion_loss(job.net, job.schedule, x.expand(4, *x.shape[1:]), cond.expand(4, *cond.shape[1:]),
                              t=t, noise=noise).item()


def test_tiny_model_overfits_one_volume(tmp_path):
    cfg = cfg_for("train", tmp_path, "data.num_volumes=1", "train.max_steps=40", "train.lr=2e-3",
                  "train.grad_accum=1", "train.batch_size=2", "train.save_every=100")
    job = build(cfg)
    before = eval_loss(job)
    summary = fit(job)
    after = eval_loss(job)
    assert before == pytest.approx(0.7979, abs=0.05)  # zero-init net predicts 0: E|N(0,1)| = 0.798
    assert after < 0.6 * before, (before, after)
    assert summary["step"] == 40 and (tmp_path / "checkpoints" / "last.pt").exists()


def test_loop_builds_adam_with_the_stacks_optimizer_options(tmp_path):
    """recipe=[fused_adam] reaches the loop's optimiser (and only there); the default is torch's foreach Adam."""
    assert not build(cfg_for("train", tmp_path / "plain")).optimizer.defaults["fused"]
    job = build(cfg_for("train", tmp_path / "fused", "recipe=[fused_adam]", "train.max_steps=1", "train.grad_accum=1"))
    assert job.optimizer.defaults["fused"] is True
    fit(job)
    assert job.step == 1 and all(torch.isfinite(p).all() for p in job.net.parameters())


@pytest.mark.parametrize(("guard", "forwards"), [("host", 1), ("device", 2)])
def test_a_non_finite_loss_skips_the_update(tmp_path, monkeypatch, guard, forwards):
    """A NaN loss on the first of two micro-batches: no Adam update, the skip counted once, the second
    micro-batch still drawn; the next step trains. The host guard also skips the backwards (and the
    second forward); the device guard runs them and fused Adam skips its own update."""
    job = build(cfg_for("train", tmp_path, "train.grad_accum=2", "data.num_volumes=2", "recipe=[fused_adam]",
                        f"recipe.fused_adam.guard={guard}"))
    job.model = job.net
    real_loss, calls, drawn = train_mod.diffusion_loss, [], []

    def nan_on_first_call(*args, **kwargs):
        calls.append(1)
        loss = real_loss(*args, **kwargs)
        return loss * float("nan") if len(calls) == 1 else loss

    def batches():
        while True:
            item = job.dataset[len(drawn) % len(job.dataset)]
            drawn.append(1)
            yield {"image": item["image"][None], "cond": item["cond"][None]}

    monkeypatch.setattr(train_mod, "diffusion_loss", nan_on_first_call)
    stream, before = batches(), {k: v.clone() for k, v in job.net.state_dict().items()}
    assert math.isnan(train_mod.train_step(job, stream))
    assert (len(drawn), len(calls)) == (2, forwards)
    assert all((p.grad is None) == (guard == "host") for p in job.net.parameters())
    assert all(torch.equal(v, job.net.state_dict()[k]) for k, v in before.items())
    assert job.stack.guard.skipped == 1
    assert math.isfinite(train_mod.train_step(job, stream))
    assert (len(drawn), len(calls), job.stack.guard.skipped) == (4, forwards + 2, 1)
    assert not all(torch.equal(v, job.net.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("recipes", [[], ["recipe=[fused_adam]", "recipe.fused_adam.guard=device"]],
                         ids=["default", "device_guard"])
def test_kill_and_resume_gives_the_same_weights(tmp_path, monkeypatch, recipes):
    common = ["train.max_steps=6", "train.save_every=2", "train.ema_start=2", "train.ema_every=1",
              "train.lr=1e-3", "data.num_volumes=3", *recipes]
    fit(build(cfg_for("train", tmp_path / "straight", *common)))

    real_update = train_mod.update_ema

    def dies_at_step_5(job):
        if job.step == 5:
            raise KeyboardInterrupt("killed")
        real_update(job)

    monkeypatch.setattr(train_mod, "update_ema", dies_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        fit(build(cfg_for("train", tmp_path / "killed", *common)))
    assert read_checkpoint(tmp_path / "killed" / "checkpoints" / "last.pt")["step"] == 4
    monkeypatch.setattr(train_mod, "update_ema", real_update)
    fit(build(cfg_for("train", tmp_path / "killed", *common, "resume=auto")))

    assert_same_last_checkpoint(tmp_path / "straight", tmp_path / "killed", 6)


def assert_same_last_checkpoint(run_a: Path, run_b: Path, step: int) -> None:
    """Both runs' last.pt are at ``step`` with the same weights, EMA and optimizer state."""
    a, b = (read_checkpoint(run / "checkpoints" / "last.pt") for run in (run_a, run_b))
    assert a["step"] == b["step"] == step
    for entry in ("model", "ema"):
        for k in a[entry]:
            assert torch.equal(a[entry][k], b[entry][k]), (entry, k)
    assert a["optimizer"]["state"][0]["exp_avg"].equal(b["optimizer"]["state"][0]["exp_avg"])


@pytest.mark.parametrize("slow_first_call", [True, False])
def test_a_compiled_stack_warms_up_on_zeros_before_the_data_wait_and_trains_the_same(tmp_path, monkeypatch,
                                                                                      slow_first_call):
    """The warm-up passes (the compiled graphs loaded, autotuned and recorded while the dataset builds) run the
    first batch's shapes before the loop waits for its data, and leave weights, optimizer and random state as
    they were: with dropout on, the run ends with the weights of a run without them."""
    common = ["train.max_steps=2", "train.batch_size=2", "train.grad_accum=1", "data.num_volumes=2",
              "model.dropout=0.3", "train.lr=1e-3"]
    plain = build(cfg_for("train", tmp_path / "plain", *common))
    fit(plain)
    monkeypatch.setattr(RecipeStack, "slow_first_call", property(lambda self: slow_first_call))
    job, events, real_loss, real_wait = build(cfg_for("train", tmp_path / "warm", *common)), [], \
        train_mod.diffusion_loss, train_mod.wait_for_data
    monkeypatch.setattr(train_mod, "diffusion_loss",
                        lambda model, schedule, x, cond, **kw: events.append(("loss", x.shape, bool(x.any())))
                        or real_loss(model, schedule, x, cond, **kw))
    monkeypatch.setattr(train_mod, "wait_for_data", lambda j: events.append(("wait",)) or real_wait(j))
    fit(job)
    warm_up = [("loss", torch.Size([2, 1, 8, 8, 8]), False)] * 2 if slow_first_call else []
    assert events[:len(warm_up) + 1] == [*warm_up, ("wait",)] and len(events) == len(warm_up) + 3
    assert ("warmed_up_s" in json.loads((tmp_path / "warm" / "timings.json").read_text())) == slow_first_call
    for k, v in plain.net.state_dict().items():
        assert torch.equal(v, job.net.state_dict()[k]), k


@pytest.mark.gpu_long
def test_graphed_training_after_its_warm_up_passes_trains_as_without_them(tmp_path, monkeypatch):
    """fast_train's stack (CUDA-graph trees) on the tiny model: the warm-up passes record the graphs the steps then
    replay, and the three steps end where a run without the passes ends (cuDNN's autotuning may pick other
    algorithms: the two runs differ by far less than the steps moved the weights)."""
    if not torch.cuda.is_available():
        pytest.fail("gpu-marked test run without CUDA")
    overrides = ["experiment=fast_train", "model=tiny", "model.image_size=[16,16,16]", "model.channel_mult=[1,2]",
                 "model.attention_ds=[2]", "device=cuda", "train.max_steps=3", "train.lr=1e-3", "data=synthetic",
                 "data.num_volumes=2", "paths.compile_cache=null", "train.progress=false"]
    runs = {}
    for name, warm in (("warm", True), ("plain", False)):
        if not warm:
            monkeypatch.setattr(train_mod, "warm_up", lambda job: False)
        with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
            job = build(compose(config_name="train", overrides=[*overrides, f"output_dir={tmp_path / name}"]))
        initial = {k: v.detach().clone() for k, v in job.net.state_dict().items()}
        fit(job)
        runs[name] = {k: v.detach().float() for k, v in job.net.state_dict().items()}
        timings = json.loads((tmp_path / name / "timings.json").read_text())
        assert ("warmed_up_s" in timings) == warm
    moved = sum((runs["plain"][k] - initial[k].float()).norm() ** 2 for k in initial) ** 0.5
    apart = sum((runs["warm"][k] - runs["plain"][k]).norm() ** 2 for k in initial) ** 0.5
    assert apart < 0.05 * moved, (apart, moved)


def test_resume_refuses_a_different_model(tmp_path):
    fit(build(cfg_for("train", tmp_path, "train.max_steps=1", "train.grad_accum=1")))
    with pytest.raises(ValueError, match="model config differs"):
        fit(build(cfg_for("train", tmp_path, "train.max_steps=2", "model.model_channels=64", "resume=auto")))


def test_mismatched_data_and_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="data variant 'brats' has 4 image"):
        build(cfg_for("train", tmp_path, "data.variant=brats"))


def test_graphed_training_is_refused_on_a_cpu(tmp_path):
    """CUDA-graph trees need CUDA: on a CPU the stack refuses compile_cudagraphs up front (its card says so)."""
    with pytest.raises(UnsupportedRecipeError, match=r"recipe 'compile_cudagraphs' is unsupported on this device"):
        build(cfg_for("train", tmp_path, "recipe=[compile_cudagraphs]", "train.grad_accum=1"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    fit(build(cfg_for("train", out, "train.max_steps=2", "train.grad_accum=1")))
    return out / "checkpoints" / "last.pt"


def test_sample_cli_writes_nifti_with_the_mask_affine(trained, whole_head_data, tmp_path):
    mask = whole_head_data / "mask" / "sample_1.nii.gz"
    cfg = cfg_for("sample", tmp_path, f"checkpoint={trained}", f"masks={mask}", "sampler=ddim", "sampler.steps=2")
    written = run_sample(cfg)
    assert [p.name for p in written] == ["sample_1.nii.gz"]
    out, ref = nib.load(written[0]), nib.load(mask)
    np.testing.assert_array_equal(out.affine, ref.affine)
    assert out.shape == ref.shape and np.isfinite(out.get_fdata()).all()
    assert (tmp_path / "sample_1.png").stat().st_size > 1000
    marks = json.loads((tmp_path / "timings.json").read_text())
    order = ["run_start_s", "device_ready_s", "checkpoint_ready_s", "recipes_ready_s", "model_ready_s",
             "first_mask_ready_s", "first_volume_done_s", "sampling_done_s"]
    assert [marks[k] for k in order] == sorted(marks[k] for k in order)


def test_training_timings_split_the_start_up(trained):
    """Where a training run's start-up went: imports, the model and recipes, the wait for the dataset built beside
    them in another process, the loop's preparation."""
    marks = json.loads((trained.parents[1] / "timings.json").read_text())
    order = ["run_start_s", "model_built_s", "model_ready_s", "data_ready_s", "loop_start_s", "first_step_done_s"]
    assert [marks[k] for k in order] == sorted(marks[k] for k in order) and marks["steps"] == 2
    assert marks["data_build_s"] > 0


def test_sample_loads_what_train_saved(trained):
    loaded = load_checkpoint(trained)
    assert loaded.step == 2 and loaded.config["model"]["channel_mult"] == [1, 2]


def test_sample_cli_takes_an_original_medddpm_checkpoint(reference_dir, tmp_path):
    """The original format carries no image size: each mask is sampled at its own size."""
    from med_ddpm.data.phantoms import write_phantom_niftis

    write_phantom_niftis(tmp_path / "data", 1, (32, 32, 32))
    mask = next((tmp_path / "data" / "mask").glob("*.nii.gz"))
    ckpt = reference_dir / "wholehead_small_ckpt.pt"
    cfg = cfg_for("sample", tmp_path / "out", f"checkpoint={ckpt}", f"masks={mask}", "sampler=ddim",
                  "sampler.steps=2")
    (written,) = run_sample(cfg)
    out = nib.load(written)
    assert out.shape == (32, 32, 32) and np.isfinite(out.get_fdata()).all()
    np.testing.assert_array_equal(out.affine, nib.load(mask).affine)


def test_wandb_logger_writes_an_offline_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    fit(build(cfg_for("train", tmp_path, "logger=wandb", "logger.log_every=1", "train.max_steps=2",
                      "train.grad_accum=1")))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_ema_follows_medddpm(tmp_path):
    """Copy before ema_start; from then on θ' ← d·θ' + (1 − d)·θ, the first update included."""
    job = build(cfg_for("train", tmp_path, "train.ema_start=2", "train.ema_every=1", "train.ema_decay=0.5"))

    def set_net(value):
        with torch.no_grad():
            for p in job.net.parameters():
                p.fill_(value)

    set_net(1.0)
    job.step = 1
    train_mod.update_ema(job)  # before ema_start: a copy
    set_net(3.0)
    job.step = 2
    train_mod.update_ema(job)  # the first average: 0.5·1 + 0.5·3
    assert all(torch.allclose(p, torch.full_like(p, 2.0)) for p in job.ema.module.parameters())


def test_sample_cli_names_a_mask_the_network_cannot_take(reference_dir, tmp_path):
    from med_ddpm.config_checks import DataError
    from med_ddpm.data.phantoms import write_phantom_niftis

    write_phantom_niftis(tmp_path / "data", 1, (20, 32, 32))  # 20 does not halve 4 times
    mask = next((tmp_path / "data" / "mask").glob("*.nii.gz"))
    cfg = cfg_for("sample", tmp_path / "out", f"checkpoint={reference_dir / 'wholehead_small_ckpt.pt'}",
                  f"masks={mask}", "sampler=ddim", "sampler.steps=2")
    with pytest.raises(DataError, match=rf"{mask.name}.*not divisible by 16.*image_size"):
        run_sample(cfg)


def test_resume_from_a_non_training_checkpoint_names_it(reference_dir, tmp_path):
    ckpt = reference_dir / "wholehead_small_ckpt.pt"
    with pytest.raises(ValueError, match=r"wholehead_small_ckpt.pt: not a training checkpoint"):
        fit(build(cfg_for("train", tmp_path, "train.max_steps=1", f"resume={ckpt}")))


def brats_run(tmp_path, size, *overrides):
    """``experiment=brats model=tiny_brats`` on two phantom cases of ``size`` in the release's per-case layout."""
    write_phantom_niftis(tmp_path / "brats", 2, size, variant="brats", layout="per_case")
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "experiment=brats", "model=tiny_brats", f"data.root={tmp_path / 'brats'}", "device=cpu",
            "train.progress=false", f"output_dir={tmp_path / 'run'}", *overrides])
    job = build(cfg)
    before = [p.clone() for p in job.net.parameters()]
    summary = fit(job)
    assert math.isfinite(summary["loss"]) and summary["step"] == cfg.train.max_steps
    assert not all(torch.equal(a, b) for a, b in zip(before, job.net.parameters()))
    return cfg, job


def test_tiny_brats_trains_a_step_on_a_cpu(tmp_path):
    """``experiment=brats model=tiny_brats`` as shipped: the BraTS recipe (4 modalities + 4 masks, grad_accum 2,
    loss divided by the batch) at a CPU size."""
    cfg, job = brats_run(tmp_path, (24, 32, 32), "train.max_steps=1")
    assert (cfg.model.in_channels, cfg.model.out_channels, cfg.model.cond_channels) == (8, 4, 4)
    assert cfg.train.grad_accum == 2 and cfg.train.divide_loss_by_batch_size
    assert job.dataset[0]["image"].shape == (4, 24, 32, 32)
    assert read_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["config"]["model"]["out_channels"] == 4


@pytest.mark.e2e
def test_a_resumed_run_continues_its_wandb_run_grouped_by_the_experiment(tmp_path, wandb_offline, monkeypatch):
    """resume=auto continues the W&B run whose id sits beside the checkpoints; the run is grouped by the
    experiment; its summary carries the final loss and timings.json."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # restored (no Hydra run) after the test
    for steps, resume in ((2, []), (3, ["resume=auto"])):
        with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
            cfg = compose(config_name="train", return_hydra_config=True, overrides=[
                "experiment=quality_model", *SMALL, "train.progress=false", f"output_dir={tmp_path}", "logger=wandb",
                f"train.max_steps={steps}", "train.grad_accum=1", "train.sample_every=0", "data.num_volumes=2",
                "train.ema_start=0", *resume])
        HydraConfig.instance().set_config(cfg)  # the experiment chosen, as a Hydra run reads it
        with open_dict(cfg):
            del cfg["hydra"]
        fit(build(cfg))
    first, resumed = sorted(wandb_offline(tmp_path), key=lambda run: run["summary"].get("step", 0))
    assert first["id"] == resumed["id"] == (tmp_path / "checkpoints" / "wandb_run_id").read_text()
    assert first["group"] == resumed["group"] == "quality_model"
    assert resumed["summary"]["step"] == 3 and math.isfinite(resumed["summary"]["loss"])
    assert resumed["summary"]["timings"] == json.loads((tmp_path / "timings.json").read_text())


@pytest.mark.e2e
def test_sample_with_logger_wandb_makes_one_run_of_its_timings_and_montages(trained, tmp_path, wandb_offline):
    from med_ddpm import sample

    sample.main(cfg_for("sample", tmp_path / "out", f"checkpoint={trained}", "sampler=ddim", "sampler.steps=2",
                        "logger=wandb", "mask_workers=0"))
    (run,) = wandb_offline(tmp_path / "out")
    assert (run["name"], run["job_type"]) == ("out", "sample")
    assert run["summary"]["volumes"] == len(list((tmp_path / "out").glob("*.nii.gz"))) > 0
    assert run["summary"]["total_s"] == json.loads((tmp_path / "out" / "timings.json").read_text())["total_s"]
    assert list((tmp_path / "out" / "wandb").rglob("files/media/images/samples/*.png"))
