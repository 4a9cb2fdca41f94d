"""bench.quality.training: the quality model trained with strict FP32, with an experiment's stack (same seed, data
order and steps) and with strict FP32 on the next seed, its loss curves, the two gated rows (stack and training
noise against FP32) and the training verdict between them."""

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import bench.quality.training as quality_training
from bench.core.records import job_key, provenance, recipe_label
from bench.core.runner import compose_job
from bench.core.worker import base_row
from bench.ladder import run as run_ladder_command
from bench.quality.training import (
    compare_losses,
    gate_jobs,
    gated_pairs,
    gated_row,
    quality_pair_ladder,
    split_overrides,
    train_arms,
    training_commands,
    training_verdict,
)
from med_ddpm.config_checks import ConfigError
from med_ddpm.train import read_loss_log
from med_ddpm.utils import atomic_write

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


def test_the_arms_differ_only_by_fast_train_s_stack_or_the_seed(tmp_path):
    """The GPU command's three runs compose with the real configs: the quality model at batch 4 x 1, the same
    seed, steps and data, fast_train's recipes with the options fast_train sets on them, and nothing else apart;
    the reseeded FP32 run differs from the FP32 run by the seed alone."""
    commands = training_commands(1000, "fast_train", tmp_path)
    assert list(commands) == ["fp32", "fast_train", "fp32_reseed"]
    fp32, fast, reseed = (_train_config(argv) for argv in commands.values())
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        shipped = OmegaConf.to_container(compose("train", overrides=["experiment=fast_train", "output_dir=."]).recipe)
    assert fast["recipe"] == shipped and "compile_cudagraphs" in fast["recipe"]
    assert fast["recipe"]["gather_upsample"]["forward"] == "gather" and fast["recipe"]["fused_adam"]["guard"] == "device"
    assert "recipe" not in fp32 or not fp32["recipe"]
    assert fast["train"]["max_steps"] == 1000 and (fast["train"]["batch_size"], fast["train"]["grad_accum"]) == (4, 1)
    assert fast["model"]["image_size"] == [64, 64, 64] and fast["resume"] == "auto"
    same = ("seed", "model", "data", "diffusion", "train")
    assert {k: fp32[k] for k in same} == {k: fast[k] for k in same}
    assert (fp32["seed"], reseed["seed"]) == (0, 1) and reseed["output_dir"] == str(tmp_path / "fp32_reseed")
    apart = ("seed", "output_dir")
    assert {k: v for k, v in fp32.items() if k not in apart} == {k: v for k, v in reseed.items() if k not in apart}


def test_a_seed_override_moves_the_reseeded_run_to_the_next_seed(tmp_path):
    commands = training_commands(10, "fast_train", tmp_path, ["seed=5"])
    assert [_train_config(commands[arm])["seed"] for arm in ("fp32", "fast_train", "fp32_reseed")] == [5, 5, 6]


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

    def fake(argv, run, steps, timeout_s, gpu=None):
        with lock:
            calls.append((run.name, gpu, gpu in active))
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
    gpus = {arm: gpu for arm, gpu, _ in calls}
    assert {gpus["fp32"], gpus["fast_train"]} == {"2", "5"} and gpus["fp32_reseed"] in ("2", "5")
    assert not any(clash for *_, clash in calls)  # never two runs on one GPU


def test_without_gpus_the_arms_run_in_turn_and_a_failed_arm_does_not_stop_the_others(monkeypatch, tmp_path):
    calls = _fake_arms(monkeypatch, fail=("fast_train",))
    statuses = train_arms({"fp32": [], "fast_train": [], "fp32_reseed": []}, tmp_path, 4)
    assert statuses == {"fp32": "done", "fast_train": "error", "fp32_reseed": "done"}
    assert calls == [("fp32", None, False), ("fast_train", None, False), ("fp32_reseed", None, False)]


def test_loss_comparison_is_paired_over_the_tail_and_not_for_the_reseeded_run():
    curves = {"fp32": ([1, 2, 3, 4], [1.0, 0.5, 0.4, 0.2]), "fast": ([1, 2, 3, 4], [1.0, 0.6, 0.4, 0.3]),
              "fp32_reseed": ([1, 2, 3, 4], [0.9, 0.5, 0.3, 0.25])}
    summary = compare_losses(curves, "fp32", unpaired=("fp32_reseed",))
    assert summary["fp32"]["tail_mean_loss"] == pytest.approx(0.2)  # the last quarter: step 4
    assert summary["fast"]["tail_mean_difference"] == pytest.approx(0.1) and summary["fast"]["paired"]
    assert "tail_mean_difference" not in summary["fp32"]
    assert summary["fp32_reseed"]["tail_mean_loss"] == pytest.approx(0.25)
    assert not summary["fp32_reseed"]["paired"] and "tail_mean_difference" not in summary["fp32_reseed"]


def gated(candidate, status="ok", **values):
    """A row as the gate writes it: fp32's weights against ``candidate``'s, distribution checks set to ``values``."""
    checks = {name: {"kind": "distribution", "value": value, "p_value": 0.5, "status": "pass"}
              for name, value in values.items()}
    checks["eps_noise"] = {"kind": "limit", "value": 0.2, "status": "fail"}
    return {"status": status, "config": {"bench": {"checkpoint": "fp32.pt"}, "quality": {"candidate_checkpoint": candidate}},
            "quality": {"verdict": "fail", "checks": checks}}


LOSSES = {"tail_fraction": 0.25, "fp32": {"tail_mean_loss": 0.07}, "fast": {"tail_mean_loss": 0.069},
          "fp32_reseed": {"tail_mean_loss": 0.072}}
NOISE = {"histogram_w1_vs_ref": 0.08, "kid_vs_ref": 2e-5, "mmd_vs_ref": 0.5, "diversity_gap": 0.02}


def test_a_stack_within_training_noise_passes():
    stack = gated("fast.pt", histogram_w1_vs_ref=0.07, kid_vs_ref=-1e-5, mmd_vs_ref=0.5, diversity_gap=-0.015)
    verdict = training_verdict(stack, gated("reseed.pt", **NOISE), LOSSES)
    assert verdict["verdict"] == "pass" and verdict["why"] == "within training noise"
    assert set(verdict["checks"]) == set(NOISE) and verdict["checks"]["kid_vs_ref"]["training_noise"]["value"] == 2e-5
    assert verdict["weight_differences"] == {"eps_noise": {"stack": 0.2, "training_noise": 0.2}}  # reported only
    assert verdict["tail_mean_loss"] == {"fp32": 0.07, "fast": 0.069, "fp32_reseed": 0.072}


def test_a_stack_beyond_one_draw_of_training_noise_is_inconclusive_per_check():
    """One reseed cannot fail a stack (a harmless one lands beyond it half the time): beyond it is inconclusive."""
    stack = gated("fast.pt", histogram_w1_vs_ref=0.09, kid_vs_ref=1e-5, mmd_vs_ref=0.4, diversity_gap=-0.03)
    verdict = training_verdict(stack, gated("reseed.pt", **NOISE), LOSSES)
    assert verdict["verdict"] == "inconclusive"
    assert {n: c["verdict"] for n, c in verdict["checks"].items()} == {
        "histogram_w1_vs_ref": "further", "kid_vs_ref": "within", "mmd_vs_ref": "within", "diversity_gap": "further"}
    assert verdict["why"].startswith("further than one draw of training noise on histogram_w1_vs_ref: stack 0.09 vs "
                                     "training noise 0.08")


def test_a_statistic_that_is_not_a_number_leaves_the_verdict_undecided():
    nan = gated("fast.pt", **{**NOISE, "kid_vs_ref": "nan"})  # JSON keeps a NaN as a string
    verdict = training_verdict(nan, gated("reseed.pt", **NOISE), LOSSES)
    assert verdict["verdict"] == "undecided" and verdict["checks"]["kid_vs_ref"]["verdict"] == "undecided"
    assert verdict["why"].startswith("kid_vs_ref: stack nan")


def test_without_the_training_noise_row_the_verdict_is_undecided():
    rows = [gated("fast.pt", **NOISE), gated("reseed.pt", status="error", **NOISE)]
    stack, noise = gated_row(rows, ("fp32.pt", "fast.pt")), gated_row(rows, ("fp32.pt", "reseed.pt"))
    assert stack is rows[0] and noise is None and gated_row(rows, ("other.pt", "fast.pt")) is None
    verdict = training_verdict(stack, noise, LOSSES)
    assert verdict["verdict"] == "undecided" and "checks" not in verdict
    assert "no gated training_noise row (fp32 vs fp32_reseed)" in verdict["why"] and "stack row" not in verdict["why"]
    assert verdict["tail_mean_loss"]["fp32_reseed"] == 0.072


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


def test_the_two_gates_share_one_reference_cache(tmp_path):
    fake_runs(tmp_path, {"fp32": b"a", "fast_train": b"b", "fp32_reseed": b"c"})
    jobs = gate_jobs(gated_pairs(tmp_path, "fast_train"), tmp_path, ["quality.n_samples=64"])
    configs = [compose_job(job, tmp_path / str(n))["config"] for n, job in enumerate(jobs)]
    assert {c["quality"]["cache_dir"] for c in configs} == {str(tmp_path / "gate_cache")} and len(configs) == 2
    assert [c["quality"]["n_samples"] for c in configs] == [64, 64]
    assert len({c["bench"]["checkpoint"] for c in configs}) == 1
    assert [Path(c["quality"]["candidate_checkpoint"]).parent.parent.name for c in configs] == ["fast_train",
                                                                                                "fp32_reseed"]


def test_gated_weights_are_named_by_their_bytes_so_a_retrained_run_is_gated_again(tmp_path):
    """A row gated on weights that were retrained since (a fresh machine, a new call) does not stand for the new
    weights: the pair names the weights by a digest of their bytes, so the old row matches neither key nor pair."""
    fake_runs(tmp_path, {"fp32": b"a", "fast_train": b"b", "fp32_reseed": b"c"})
    before = gated_pairs(tmp_path, "fast_train")
    assert gated_pairs(tmp_path, "fast_train") == before  # unchanged bytes: the same names, the row is kept
    reference, candidate = before["stack"]
    assert Path(candidate).read_bytes() == b"b" and Path(candidate).name.startswith("last-")
    old_row = {"status": "ok", "quality": {"checks": {"kid_vs_ref": {"kind": "distribution", "value": 0.0}}},
               "config": {"bench": {"checkpoint": reference}, "quality": {"candidate_checkpoint": candidate}}}
    assert gated_row([old_row], before["stack"]) is old_row
    fake_runs(tmp_path, {"fp32": b"A"})  # the reference retrained
    after = gated_pairs(tmp_path, "fast_train")
    assert after["stack"][0] != reference and after["stack"][1] == candidate
    assert gated_row([old_row], after["stack"]) is None
    assert Path(reference).read_bytes() == b"a", "the gated row's weights stay as they were gated"


def test_a_resumed_run_s_loss_log_keeps_each_step_s_last_line(tmp_path):
    lines = [{"step": 10, "loss": 0.5}, {"step": 20, "loss": 0.4}, {"step": 20, "loss": 0.3}]
    (tmp_path / "loss.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + '\n{"step": 3')  # a torn line
    assert read_loss_log(tmp_path) == ([10, 20], [0.5, 0.3])


@pytest.mark.slow
def test_tiny_arms_train_compare_and_gate(tmp_path):
    """Tiny model on the CPU, 4 steps each, quality_model's own stack (amp_bf16; fast_train's compiles for CUDA)."""
    out, runs = tmp_path / "out", tmp_path / "runs"
    args = [f"quality_training.runs={runs}", "quality_training.steps=4", "quality_training.experiment=quality_model",
            "quality_training.overrides=[" + ",".join(f"'{o}'" for o in TINY) + "]"]
    assert ladder(out, *args) == 0
    for arm in ("fp32", "quality_model", "fp32_reseed"):
        assert (runs / arm / "checkpoints" / "last.pt").exists() and (runs / arm / "checkpoints" / "step_0000004.pt").exists()
        logged = [json.loads(line) for line in (runs / arm / "loss.jsonl").read_text().splitlines()]
        assert [r["step"] for r in logged] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in logged)
    curves = json.loads((out / "loss_curves.json").read_text())
    fp32, bf16, reseed = (curves["curves"][arm]["loss"] for arm in ("fp32", "quality_model", "fp32_reseed"))
    assert fp32 != bf16 and bf16[0] == pytest.approx(fp32[0], rel=0.05)  # same weights, batch, t and eps at step 1
    assert reseed[0] != fp32[0]  # other weights, batch, t and eps
    assert curves["summary"]["quality_model"]["tail_mean_difference"] == pytest.approx(bf16[-1] - fp32[-1])
    assert "tail_mean_difference" not in curves["summary"]["fp32_reseed"]
    assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    training = json.loads((out / "training.json").read_text())
    arms = training["arms"]
    assert arms["quality_model"]["timings"]["steps"] == 4 and "recipe=[amp_bf16]" in arms["quality_model"]["argv"]
    assert "seed=1" in arms["fp32_reseed"]["argv"]
    assert [(s["git_sha"], s["gpu"]) for s in arms["fp32"]["starts"]] == [(provenance()["git_sha"], None)]
    assert training["git_sha"] == curves["git_sha"] == provenance()["git_sha"]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    gated = [[Path(r["quality"]["checkpoints"][k]) for k in ("reference", "candidate")] for r in rows]
    assert [[w.parent.parent.name for w in pair] for pair in gated] == [["fp32", "quality_model"],
                                                                       ["fp32", "fp32_reseed"]]
    assert all(w.read_bytes() == (w.parent / "last.pt").read_bytes() for pair in gated for w in pair)
    for row in rows:
        assert row["status"] == "ok" and row["quality"]["n_samples"] == 8 and row["quality"]["paired"]
        assert row["quality"]["metrics"]["eps_rel_l2"] > 0  # two different trained models
    verdict = json.loads((out / "training_verdict.json").read_text())
    assert verdict["verdict"] in ("pass", "inconclusive") and len(verdict["checks"]) == 4
    assert verdict["checks"]["kid_vs_ref"]["stack"]["value"] == rows[0]["quality"]["checks"]["kid_vs_ref"]["value"]
    assert verdict["checks"]["kid_vs_ref"]["training_noise"]["value"] == rows[1]["quality"]["checks"]["kid_vs_ref"]["value"]
    assert verdict["tail_mean_loss"]["fp32_reseed"] == pytest.approx(reseed[-1])  # the last quarter: step 4
    assert verdict["git_sha"] == provenance()["git_sha"]
    assert f"**{verdict['verdict']}**" in (out / "training.md").read_text()  # bench.quality.training_report's page
    assert ladder(out, *args) == 0  # resumable: nothing left, nothing rerun
    assert len((out / "results.jsonl").read_text().splitlines()) == 2
