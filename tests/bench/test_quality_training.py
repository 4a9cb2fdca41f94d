"""bench.quality.training: the quality model trained with strict FP32 on its seed and k more, with an experiment's
stack and with a control, each on a seed of its own; its loss curves, the gated rows and the training verdict
(bench.quality.training_verdict): the control fails, a fresh FP32 seed passes, and the stack is judged against the band."""

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import bench.quality.training as quality_training
from bench.core.records import job_key, provenance, read_rows, recipe_label
from bench.core.runner import compose_job
from bench.core.worker import base_row
from bench.ladder import run as run_ladder_command
from bench.quality.training import (
    gate_jobs,
    gated_pairs,
    gated_row,
    quality_pair_ladder,
    reseeds,
    split_overrides,
    tail_losses,
    train_arms,
    training_commands,
)
from bench.quality.training_verdict import training_verdict
from med_ddpm.checkpoint import save_checkpoint
from med_ddpm.config_checks import ConfigError
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.model import UNet3D
from med_ddpm.train import read_loss_log
from med_ddpm.utils import atomic_write

CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")
# the tiny net cut to 8^3 and a 4-step schedule: CPU trainings in seconds each and an N = 10 gate (over 4 probed
# timesteps the bias checks need N >= 10 to be able to fail)
TINY = ["model=tiny", "model.image_size=[8,8,8]", "model.channel_mult=[1,2]", "model.attention_ds=[2]", "device=cpu",
        "diffusion.timesteps=4", "sampler.steps=4", "data.num_volumes=8", "train.batch_size=2", "quality.n_samples=10",
        "quality.n_masks=2"]
CONTROL = ["train.lr=2.0e-5"]
ARMS = ["fp32", "fp32_seed1", "fp32_seed2", "fp32_seed3", "fp32_seed4", "fast_train", "control"]


def ladder(out, *overrides):
    """``python -m bench.ladder preset=quality_training out=... <overrides>``, composed as the command does."""
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("ladder", overrides=["preset=quality_training", f"out={out}", *overrides])
    return run_ladder_command(cfg)


def _train_config(argv):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return OmegaConf.to_container(compose("train", overrides=argv[1:]), resolve=True)


def test_the_arms_differ_only_by_their_seed_the_stack_or_the_control(tmp_path):
    """The GPU command's runs compose with the real configs: the quality model at batch 4 x 1, the same steps and
    data; the reference on the quality model's seed and every other run on a seed of its own; fast_train's recipes
    with the options fast_train sets on them; the control strict FP32 at a tenth of the quality model's learning rate."""
    commands = training_commands(1000, "fast_train", tmp_path, CONTROL)
    assert list(commands) == ARMS
    configs = {arm: _train_config(argv) for arm, argv in commands.items()}
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        shipped = OmegaConf.to_container(compose("train", overrides=["experiment=fast_train", "output_dir=."]).recipe)
    fast, fp32, control = configs["fast_train"], configs["fp32"], configs["control"]
    assert fast["recipe"] == shipped and "compile_cudagraphs" in fast["recipe"]
    assert fast["recipe"]["gather_upsample"]["forward"] == "gather" and fast["recipe"]["fused_adam"]["guard"] == "device"
    assert fast["train"]["max_steps"] == 1000 and (fast["train"]["batch_size"], fast["train"]["grad_accum"]) == (4, 1)
    assert fast["model"]["image_size"] == [64, 64, 64] and fast["resume"] == "auto"
    assert [c["seed"] for c in configs.values()] == [0, 1, 2, 3, 4, 5, 6]
    assert control["train"]["lr"] == pytest.approx(fp32["train"]["lr"] / 10)
    apart = {"seed", "output_dir", "recipe"}
    for arm, cfg in configs.items():
        assert not cfg.get("recipe") or arm == "fast_train"
        assert cfg["output_dir"] == str(tmp_path / arm)
        mine = {k: v for k, v in cfg.items() if k not in apart}
        if arm == "control":
            mine["train"] = {**mine["train"], "lr": fp32["train"]["lr"]}
        assert mine == {k: v for k, v in fp32.items() if k not in apart}, arm


def test_the_control_is_a_tenth_of_the_quality_model_s_learning_rate_in_the_ladder_config():
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("ladder", overrides=["preset=quality_training"])
        lr = compose("train", overrides=["experiment=quality_model", "output_dir=."]).train.lr
    assert list(cfg.quality_training.control) == CONTROL and float(CONTROL[0].split("=")[1]) == pytest.approx(lr / 10)


def test_a_seed_override_moves_every_run_after_it(tmp_path):
    commands = training_commands(10, "fast_train", tmp_path, CONTROL, ["seed=5"])
    assert [_train_config(argv)["seed"] for argv in commands.values()] == [5, 6, 7, 8, 9, 10, 11]


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
    with pytest.raises(ConfigError, match=r"^quality_training.seeds=3: the fresh seed is judged against the band of "
                                          r"the other seeds, which needs 3 of them; pass quality_training.seeds>=4$"):
        ladder(tmp_path, "quality_training.seeds=3")


def test_more_gpus_than_the_machine_shows_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"^quality_training.gpus=2: this machine shows 1 CUDA GPU\(s\); pass "
                                          r"quality_training.gpus=1$"):
        ladder(tmp_path, "quality_training.gpus=2", "quality_training.steps=1")


def _fake_arms(monkeypatch, fail=(), together=0):
    """train_arm replaced by a short run that records (arm, gpu, clash: another run was on its GPU right then),
    fails the ``fail`` arms and, with ``together``, makes the first two arms wait for each other (a barrier that
    times out unless they run at once)."""
    calls, active, lock = [], [], threading.Lock()
    barrier = threading.Barrier(together, timeout=20) if together else None

    def fake(argv, run, steps, timeout_s, gpu=None, sharing=1):
        with lock:
            calls.append((run.name, gpu, gpu in active, sharing))
            active.append(gpu)
        if barrier is not None and run.name in ("fp32", "fast_train"):
            barrier.wait()
        time.sleep(0.05)
        with lock:
            active.remove(gpu)
        return "error" if run.name in fail else "done"

    monkeypatch.setattr(quality_training, "train_arm", fake)
    return calls


def test_on_two_gpus_two_arms_train_at_once_each_on_its_own_gpu(monkeypatch, tmp_path):
    calls = _fake_arms(monkeypatch, together=2)  # a serial schedule breaks the barrier: BrokenBarrierError
    statuses = train_arms({"fp32": [], "fast_train": [], "fp32_reseed": []}, tmp_path, 4, gpus=["2", "5"])
    assert statuses == {"fp32": "done", "fast_train": "done", "fp32_reseed": "done"}
    gpus = {arm: gpu for arm, gpu, *_ in calls}
    assert {gpus["fp32"], gpus["fast_train"]} == {"2", "5"} and gpus["fp32_reseed"] in ("2", "5")
    assert not any(clash for _, _, clash, _ in calls)  # never two runs on one GPU


def test_a_gpu_listed_twice_trains_two_arms_at_once_and_says_it_was_shared(monkeypatch, tmp_path):
    calls = _fake_arms(monkeypatch, together=2)  # a serial schedule breaks the barrier: BrokenBarrierError
    statuses = train_arms({"fp32": [], "fast_train": [], "fp32_reseed": []}, tmp_path, 4, gpus=["0", "0"])
    assert set(statuses.values()) == {"done"}
    assert any(clash for _, _, clash, _ in calls) and {sharing for *_, sharing in calls} == {2}
    monkeypatch.setattr(quality_training, "finished", lambda run, steps: run.name != "fp32_reseed")
    calls.clear()  # two arms finished: the third trains alone
    train_arms({"fp32": [], "fast_train": [], "fp32_reseed": []}, tmp_path, 4, gpus=["0", "0"])
    assert {name: sharing for name, _, _, sharing in calls}["fp32_reseed"] == 1


def test_without_gpus_the_arms_run_in_turn_and_a_failed_arm_does_not_stop_the_others(monkeypatch, tmp_path):
    calls = _fake_arms(monkeypatch, fail=("fast_train",))
    statuses = train_arms({"fp32": [], "fast_train": [], "fp32_reseed": []}, tmp_path, 4)
    assert statuses == {"fp32": "done", "fast_train": "error", "fp32_reseed": "done"}
    assert calls == [("fp32", None, False, 1), ("fast_train", None, False, 1), ("fp32_reseed", None, False, 1)]


def test_each_run_s_loss_tail_is_the_mean_of_its_last_quarter():
    summary = tail_losses({"fp32": ([1, 2, 3, 4], [1.0, 0.5, 0.4, 0.2]), "fast": ([1, 2, 3, 4, 5, 6, 7, 8], [1.0] * 6 + [0.3, 0.5])})
    assert summary["fp32"]["tail_mean_loss"] == pytest.approx(0.2) and summary["fp32"]["last_step"] == 4
    assert summary["fast"]["tail_mean_loss"] == pytest.approx(0.4) and summary["fast"]["logged_steps"] == 8


def test_without_a_gated_row_the_verdict_is_inconclusive_and_names_it():
    rows = [gated_row_for("fast_train.pt"), {**gated_row_for("control.pt"), "status": "error"}]
    assert gated_row(rows, ("fp32.pt", "fast_train.pt")) is rows[0]
    assert gated_row(rows, ("fp32.pt", "control.pt")) is None and gated_row(rows, ("other.pt", "fast_train.pt")) is None
    verdict = training_verdict({"fast_train": rows[0], "control": None}, {}, "fp32", "fast_train", "control", [])
    assert verdict["verdict"] == "inconclusive" and "checks" not in verdict
    assert verdict["why"].startswith("no gated row for control in results.jsonl")


def gated_row_for(candidate):
    return {"status": "ok", "config": {"bench": {"checkpoint": "fp32.pt"},
                                       "quality": {"candidate_checkpoint": candidate}},
            "quality": {"verdict": "fail", "checks": {"kid_vs_ref": {"kind": "distribution", "value": 0.0}}}}


def test_the_two_gated_rows_have_their_own_keys_and_labels(tmp_path):
    rows = [base_row(compose_job(job, tmp_path / c)) for c in ("fast", "reseed")
            for job in quality_pair_ladder("/runs/fp32/checkpoints/last-1.pt", f"/runs/{c}/checkpoints/last-2.pt")]
    assert job_key(rows[0]) != job_key(rows[1])
    assert [recipe_label(r) for r in rows] == ["[] (fp32), candidate weights fast/checkpoints/last-2.pt",
                                               "[] (fp32), candidate weights reseed/checkpoints/last-2.pt"]
    plain = {**rows[0], "config": {**rows[0]["config"], "quality": {"candidate_checkpoint": None}}}
    assert job_key(plain) == json.dumps([json.loads(job_key(rows[0]))[0], []])  # other rows keep their key


def fake_runs(runs, contents):
    for arm, data in contents.items():
        (runs / arm / "checkpoints").mkdir(parents=True, exist_ok=True)
        atomic_write(runs / arm / "checkpoints" / "last.pt", lambda f, data=data: f.write(data))  # as train saves


def test_the_gates_share_one_reference_cache(tmp_path):
    fake_runs(tmp_path, {arm: arm.encode() for arm in ARMS})
    jobs = gate_jobs(gated_pairs(tmp_path, ARMS), tmp_path, ["quality.n_samples=64"])
    configs = [compose_job(job, tmp_path / str(n))["config"] for n, job in enumerate(jobs)]
    assert {c["quality"]["cache_dir"] for c in configs} == {str(tmp_path / "gate_cache")} and len(configs) == 6
    assert {c["quality"]["n_samples"] for c in configs} == {64} and len({c["bench"]["checkpoint"] for c in configs}) == 1
    assert [Path(c["quality"]["candidate_checkpoint"]).parent.parent.name for c in configs] == ARMS[1:]


def test_gated_weights_are_named_by_their_bytes_so_a_retrained_run_is_gated_again(tmp_path):
    """A row gated on weights that were retrained since (a fresh machine, a new call) does not stand for the new
    weights: the pair names the weights by a digest of their bytes, so the old row matches neither key nor pair."""
    fake_runs(tmp_path, {"fp32": b"a", "fast_train": b"b"})
    before = gated_pairs(tmp_path, ["fp32", "fast_train"])
    assert gated_pairs(tmp_path, ["fp32", "fast_train"]) == before  # unchanged bytes: the same names, the row is kept
    reference, candidate = before["fast_train"]
    assert Path(candidate).read_bytes() == b"b" and Path(candidate).name.startswith("last-")
    old_row = {"status": "ok", "quality": {"checks": {"kid_vs_ref": {"kind": "distribution", "value": 0.0}}},
               "config": {"bench": {"checkpoint": reference}, "quality": {"candidate_checkpoint": candidate}}}
    assert gated_row([old_row], before["fast_train"]) is old_row
    fake_runs(tmp_path, {"fp32": b"A"})  # the reference retrained
    after = gated_pairs(tmp_path, ["fp32", "fast_train"])
    assert after["fast_train"][0] != reference and after["fast_train"][1] == candidate
    assert gated_row([old_row], after["fast_train"]) is None
    assert Path(reference).read_bytes() == b"a", "the gated row's weights stay as they were gated"


def test_every_run_s_validation_loss_is_on_the_same_phantoms_and_t_eps_draws(tmp_path, monkeypatch):
    """Each run's network sees the same inputs (x_t with its mask, and t), so two validation losses differ only by
    the weights: equal weights give equal losses, other weights another."""
    for arm, seed in (("fp32", 0), ("fp32_seed1", 1), ("control", 0)):
        torch.manual_seed(seed)
        net, schedule = UNet3D(3, 1, 32, (1, 2), 1, (2,)), NoiseSchedule(10)
        for p in net.parameters():  # no zero-initialised output layer: the weights decide the prediction
            torch.nn.init.normal_(p, std=0.02)
        config = {"model": dict(net.config, image_size=[8, 8, 8]), "diffusion": schedule.config,
                  "data": {"name": "synthetic", "variant": "whole_head"}}
        save_checkpoint(tmp_path / arm / "checkpoints" / "last.pt", model_state=net.state_dict(),
                        ema_state=net.state_dict(), config=config, step=1)
    inputs, forward = [], UNet3D.forward

    def noted(self, x, t, *args, **kw):
        inputs.append((x.clone(), t.clone()))
        return forward(self, x, t, *args, **kw)

    monkeypatch.setattr(UNet3D, "forward", noted)
    monkeypatch.setattr(quality_training, "VALIDATION_PHANTOMS", 10)  # two forwards a draw: 8 phantoms, then 2
    monkeypatch.setattr(quality_training, "VALIDATION_DRAWS", 2)
    losses = quality_training.validation_losses(tmp_path, ["fp32", "fp32_seed1", "control"], torch.device("cpu"))
    per_run = [inputs[i:i + 4] for i in range(0, 12, 4)]
    assert len(inputs) == 12
    for run in per_run[1:]:
        assert all(torch.equal(x, x0) and torch.equal(t, t0) for (x, t), (x0, t0) in zip(run, per_run[0]))
    assert losses["fp32"] == losses["control"] != losses["fp32_seed1"]


def test_a_resumed_run_s_loss_log_keeps_each_step_s_last_line(tmp_path):
    lines = [{"step": 10, "loss": 0.5}, {"step": 20, "loss": 0.4}, {"step": 20, "loss": 0.3}]
    (tmp_path / "loss.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + '\n{"step": 3')  # a torn line
    assert read_loss_log(tmp_path) == ([10, 20], [0.5, 0.3])


@pytest.mark.slow
def test_tiny_runs_train_gate_and_the_control_fails_while_a_fresh_seed_passes(tmp_path):
    """Tiny model on the CPU, 100 steps each, quality_model's own stack (amp_bf16; fast_train's compiles for CUDA):
    the whole preset through the ladder command. A tenth of the learning rate leaves the tiny model far behind in 100
    steps (its validation loss far above the five FP32 runs'): the control fails; the last FP32 seed, judged
    against the other three, passes, and so does the stack. About three minutes on a 2-core CPU."""
    out, runs = tmp_path / "out", tmp_path / "runs"
    args = [f"quality_training.runs={runs}", "quality_training.steps=100", "quality_training.image_size=null",
            "quality_training.experiment=quality_model",
            "quality_training.overrides=[" + ",".join(f"'{o}'" for o in TINY) + "]"]
    assert ladder(out, *args) == 0
    arms = ["fp32", *reseeds(4), "quality_model", "control"]
    for arm in arms:
        logged = [json.loads(line) for line in (runs / arm / "loss.jsonl").read_text().splitlines()]
        assert logged[-1]["step"] == 100 and all(r["loss"] > 0 for r in logged)
    training = json.loads((out / "training.json").read_text())
    assert list(training["arms"]) == arms and "recipe=[amp_bf16]" in training["arms"]["quality_model"]["argv"]
    assert [(s["git_sha"], s["gpu"]) for s in training["arms"]["fp32"]["starts"]] == [(provenance()["git_sha"], None)]
    curves = json.loads((out / "loss_curves.json").read_text())
    assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG" and training["git_sha"] == curves["git_sha"]
    rows = read_rows(out)
    assert [Path(r["quality"]["checkpoints"]["candidate"]).parent.parent.name for r in rows] == arms[1:]
    assert all(r["status"] == "ok" and r["quality"]["n_samples"] == 10 for r in rows)
    verdict = json.loads((out / "training_verdict.json").read_text())
    assert {n: c["outcome"] for n, c in verdict["controls"].items()} == {"control": "fail", "fresh_seed": "pass"}
    assert verdict["controls_ok"] and verdict["verdict"] == verdict["stack_outcome"]
    control = verdict["controls"]["control"]["checks"]["val_loss"]
    assert control["status"] == "beyond" and control["effect_size"] > 3.5  # it trained less far than FP32 does
    assert verdict["verdict"] == "pass"
    assert verdict["val_loss"] == {arm: curves["summary"][arm]["val_loss"] for arm in arms}
    assert verdict["checks"]["kid_vs_ref"]["value"] == rows[-2]["quality"]["checks"]["kid_vs_ref"]["value"]
    assert f"**{verdict['verdict']}**" in (out / "training.md").read_text()  # bench.quality.training_report's page
    assert ladder(out, *args) == 0  # resumable: nothing left, nothing rerun
    assert len((out / "results.jsonl").read_text().splitlines()) == 6
