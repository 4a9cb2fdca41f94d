"""bench.quality_training: the quality model trained with strict FP32 and with an experiment's stack (same seed,
data order and steps), its loss curves, and one gated row comparing the two EMA models."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from bench.ladder import compose_job, quality_pair_ladder
from bench.ladder import run as run_ladder_command
from bench.quality_training import compare_losses, split_overrides, training_commands
from med_ddpm.errors import ConfigError
from med_ddpm.train import read_loss_log

CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")
# the tiny net cut to 8^3 and a 4-step schedule: two CPU trainings and an N = 8 gate in seconds
TINY = ["model=tiny", "model.image_size=[8,8,8]", "model.channel_mult=[1,2]", "model.attention_ds=[2]", "device=cpu",
        "diffusion.timesteps=4", "sampler.steps=4", "data.num_volumes=4", "train.batch_size=2", "train.ema_start=0",
        "train.save_every=2", "+logger.log_every=1", "quality.n_samples=8", "quality.n_masks=2", "quality.n_perm=200"]


def ladder(out, *overrides):
    """``python -m bench.ladder preset=quality_training out=... <overrides>``, composed as the command does."""
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("ladder", overrides=["preset=quality_training", f"out={out}", *overrides])
    return run_ladder_command(cfg)


def _train_config(argv):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return OmegaConf.to_container(compose("train", overrides=argv[1:]), resolve=True)


def test_the_pair_differs_only_by_fast_train_s_stack(tmp_path):
    """The GPU command's two runs compose with the real configs: the quality model at batch 4 x 1, the same
    seed, steps and data, fast_train's recipes with the options fast_train sets on them, and nothing else apart."""
    commands = training_commands(1000, "fast_train", tmp_path)
    assert list(commands) == ["fp32", "fast_train"]
    fp32, fast = (_train_config(argv) for argv in commands.values())
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        shipped = OmegaConf.to_container(compose("train", overrides=["experiment=fast_train", "output_dir=."]).recipe)
    assert fast["recipe"] == shipped and "compile_cudagraphs" in fast["recipe"]
    assert fast["recipe"]["gather_upsample"]["forward"] == "gather" and fast["recipe"]["fused_adam"]["guard"] == "device"
    assert "recipe" not in fp32 or not fp32["recipe"]
    assert fast["train"]["max_steps"] == 1000 and (fast["train"]["batch_size"], fast["train"]["grad_accum"]) == (4, 1)
    assert fast["model"]["image_size"] == [64, 64, 64] and fast["resume"] == "auto"
    same = ("seed", "model", "data", "diffusion", "train")
    assert {k: fp32[k] for k in same} == {k: fast[k] for k in same}


def test_overrides_are_routed_and_the_gate_job_composes(tmp_path):
    train, gate = split_overrides(["model=tiny", "train.max_steps=3", "quality.n_samples=8", "+bench.x=1", "seed=2"])
    assert train == ["model=tiny", "train.max_steps=3", "seed=2"]
    assert gate == ["model=tiny", "quality.n_samples=8", "+bench.x=1", "seed=2"]
    (job,) = quality_pair_ladder("a.pt", "b.pt")
    cfg = compose_job(job, tmp_path)["config"]
    assert cfg["bench"]["checkpoint"] == "a.pt" and cfg["quality"]["candidate_checkpoint"] == "b.pt"
    assert cfg["bench"]["quality"] and not cfg.get("recipe") and cfg["sampler"]["name"] == "ddpm"
    assert cfg["model"]["image_size"] == [64, 64, 64]
    with pytest.raises(ConfigError, match="candidate_checkpoint=PATH"):
        list(quality_pair_ladder("a.pt", None))


def test_bad_options_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="quality_training.steps=0: must be an integer >= 1"):
        ladder(tmp_path, "quality_training.steps=0")
    with pytest.raises(ConfigError, match="quality_training.steps='many': must be an integer >= 1"):
        ladder(tmp_path, "quality_training.steps=many")
    with pytest.raises(ConfigError, match="quality_training.experiment=nope: no configs/experiment/nope.yaml"):
        ladder(tmp_path, "quality_training.experiment=nope")


def test_loss_comparison_is_paired_over_the_tail():
    curves = {"fp32": ([1, 2, 3, 4], [1.0, 0.5, 0.4, 0.2]), "fast": ([1, 2, 3, 4], [1.0, 0.6, 0.4, 0.3])}
    summary = compare_losses(curves, "fp32")
    assert summary["fp32"]["tail_mean_loss"] == pytest.approx(0.2)  # the last quarter: step 4
    assert summary["fast"]["tail_mean_difference"] == pytest.approx(0.1)
    assert "tail_mean_difference" not in summary["fp32"]


def test_a_resumed_run_s_loss_log_keeps_each_step_s_last_line(tmp_path):
    lines = [{"step": 10, "loss": 0.5}, {"step": 20, "loss": 0.4}, {"step": 20, "loss": 0.3}]
    (tmp_path / "loss.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + '\n{"step": 3')  # a torn line
    assert read_loss_log(tmp_path) == ([10, 20], [0.5, 0.3])


@pytest.mark.slow
def test_tiny_pair_trains_compares_and_gates(tmp_path):
    """Tiny model on the CPU, 4 steps each, quality_model's own stack (amp_bf16; fast_train's compiles for CUDA)."""
    out, runs = tmp_path / "out", tmp_path / "runs"
    args = [f"quality_training.runs={runs}", "quality_training.steps=4", "quality_training.experiment=quality_model",
            "quality_training.overrides=[" + ",".join(f"'{o}'" for o in TINY) + "]"]
    assert ladder(out, *args) == 0
    for arm in ("fp32", "quality_model"):
        assert (runs / arm / "checkpoints" / "last.pt").exists() and (runs / arm / "checkpoints" / "step_0000004.pt").exists()
        logged = [json.loads(line) for line in (runs / arm / "loss.jsonl").read_text().splitlines()]
        assert [r["step"] for r in logged] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in logged)
    curves = json.loads((out / "loss_curves.json").read_text())
    fp32, bf16 = curves["curves"]["fp32"]["loss"], curves["curves"]["quality_model"]["loss"]
    assert fp32 != bf16 and bf16[0] == pytest.approx(fp32[0], rel=0.05)  # same weights, batch, t and eps at step 1
    assert curves["summary"]["quality_model"]["tail_mean_difference"] == pytest.approx(bf16[-1] - fp32[-1])
    assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    training = json.loads((out / "training.json").read_text())
    assert training["quality_model"]["timings"]["steps"] == 4 and "recipe=[amp_bf16]" in training["quality_model"]["argv"]
    (row,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    quality = row["quality"]
    assert row["status"] == "ok" and quality["verdict"] in ("pass", "warn", "fail") and quality["n_samples"] == 8
    assert quality["checkpoints"] == {"reference": str(runs / "fp32" / "checkpoints" / "last.pt"),
                                      "candidate": str(runs / "quality_model" / "checkpoints" / "last.pt")}
    assert quality["paired"] and quality["metrics"]["eps_rel_l2"] > 0  # two different trained models
    assert ladder(out, *args) == 0  # resumable: nothing left, nothing rerun
    assert len((out / "results.jsonl").read_text().splitlines()) == 1
