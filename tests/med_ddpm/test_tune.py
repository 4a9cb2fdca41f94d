"""med_ddpm.tune end to end on a tiny network (8^3, T = 10, N = 10, the least at which the bias checks can fail): the fewest passing calls, the sealed
sampler.yaml that med_ddpm.sample uses or refuses, the hold-out of the gate from the search, resuming, and the
refusals of bad input. Most runs set the gate's limits to make a verdict certain: ``quality.alpha.fail=0`` and
``warn=0`` pass every distribution check, ``alpha.fail=2`` fails them (a p-value is at most 1); one keeps the gate's
own ``alpha.warn``, so its verdict is the candidate's against the checkpoint's strict-FP32 DDPM."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from med_ddpm import sample, tune
from med_ddpm.checkpoint import save_checkpoint
from med_ddpm.data.datasets import build_dataset, load_condition
from med_ddpm.data.phantoms import write_phantom_niftis
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.model import UNet3D
from med_ddpm.quality import probe
from med_ddpm.quality.probe import cond_hash, fixed_noise, sample_seed
from med_ddpm.samplers.tuned import SEAL, file_sha256, read_tuned
from med_ddpm.tuning import gate, run

CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")
SIZE = [8, 8, 8]
PASS = ["quality.alpha.fail=0", "quality.alpha.warn=0"]
FAIL = ["quality.alpha.fail=2"]


def tiny_checkpoint(path: Path, seed: int) -> str:
    """A 2-level whole-head network on 8^3 with a 10-step schedule, random weights."""
    torch.manual_seed(seed)
    net, schedule = UNet3D(3, 1, 32, (1, 2), 1, (2,)), NoiseSchedule(10)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.02)
    config = {"model": dict(net.config, image_size=SIZE), "diffusion": schedule.config,
              "data": {"name": "synthetic", "variant": "whole_head"}}
    save_checkpoint(path, model_state=net.state_dict(), ema_state=net.state_dict(), config=config, step=1)
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "last.pt", seed=0)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reference_cache")


def compose_tune(checkpoint: str, out: Path, cache: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose("tune", overrides=[
            f"checkpoint={checkpoint}", f"output_dir={out}", f"paths.reference_cache={cache}", "~experiment",
            "++sampler.variant=sde", "device=cpu", "progress=false", "budgets=[2,3]", "search.n=2", "gate.batch=4",
            "quality.n_samples=10", "quality.n_masks=2", "quality.n_perm=100", *overrides])


def compose_sample(checkpoint: str, out: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose("sample", overrides=[f"checkpoint={checkpoint}", f"output_dir={out}", "device=cpu",
                                            "progress=false", "mask_workers=0", *overrides])


def refusal(capsys, call, cfg) -> str:
    with pytest.raises(SystemExit) as exit_:
        call(cfg)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0].removeprefix("error: ")


@pytest.fixture(scope="module")
def tuned(checkpoint, cache, tmp_path_factory) -> dict[str, Path]:
    """The folders of two runs: one whose first budget passes, one where no budget passes."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("passed", "failed")}
    for name, limits in (("passed", PASS), ("failed", FAIL)):
        tune.main(compose_tune(checkpoint, folders[name], cache, *limits))
    return folders


@pytest.fixture(scope="module")
def passed(tuned) -> Path:
    return tuned["passed"]


@pytest.fixture(scope="module")
def failed(tuned) -> Path:
    return tuned["failed"]


def test_stops_at_the_fewest_calls_that_pass_and_sample_uses_that_grid(passed, checkpoint, tmp_path, capsys):
    record = read_tuned(passed / "sampler.yaml")
    state = json.loads((passed / "tune.json").read_text())
    assert record["verdict"] == "pass" and record["calls"] == 2 and [b["calls"] for b in record["budgets"]] == [2]
    assert list(state["budgets"]) == ["2"] and record["sampler"]["timesteps"] == state["budgets"]["2"]["grid"]
    assert record["sampler"]["timesteps"][0] == 9 and record["sampler"]["variant"] == "sde"
    assert record["checkpoint"]["sha256"] == file_sha256(checkpoint) and record["torch"]
    assert record["gate"]["statistics"]["n_samples"] == 10 and "kid_vs_ref" in record["gate"]["statistics"]["checks"]
    assert "**2 model calls pass**" in (passed / "report.md").read_text()
    assert (passed / "calls_vs_quality.png").stat().st_size > 1000

    cfg = compose_sample(checkpoint, tmp_path, f"tuned={passed / 'sampler.yaml'}")
    sample.main(cfg)
    assert list(cfg.sampler.timesteps) == record["sampler"]["timesteps"] and cfg.sampler.steps == 2
    assert len(list(tmp_path.glob("*.nii.gz"))) == 2  # the two phantom masks


def test_a_failed_verdict_is_recorded_and_sample_refuses_it(failed, checkpoint, tmp_path, capsys):
    record = read_tuned(failed / "sampler.yaml")
    assert record["verdict"] == "fail" and [b["verdict"] for b in record["budgets"]] == ["fail", "fail"]
    assert "**No budget passed** up to 3 model calls" in (failed / "report.md").read_text()
    line = refusal(capsys, sample.main, compose_sample(checkpoint, tmp_path, f"tuned={failed / 'sampler.yaml'}"))
    assert re.match(rf"^tuned=\S+: its gate verdict is fail at 3 model calls \(\w+=.* -> fail .*\), so it is no "
                    rf"sampler to use; tune with larger budgets: python -m med_ddpm\.tune checkpoint={checkpoint} "
                    r"masks=MASKS output_dir=DIR budgets=\[6,9\]$", line), line
    assert not list(tmp_path.glob("*.nii.gz"))


@pytest.fixture(scope="module")
def warned(checkpoint, cache, tmp_path_factory) -> Path:
    """A run with the gate's own ``alpha.warn`` (0.01) and no fail level: the verdict is what the samples show."""
    out = tmp_path_factory.mktemp("warned")
    tune.main(compose_tune(checkpoint, out, cache, "quality.alpha.fail=0", "budgets=[2]"))
    return out


def test_the_verdict_is_the_candidate_s_against_the_checkpoint_s_fp32_ddpm_and_a_warn_is_refused(
        warned, checkpoint, tmp_path, capsys):
    """The 2-call grid's samples are told apart from the 10-step DDPM's at the permutation test's smallest p
    (1 / (1 + n_perm) < alpha.warn): warn, which med_ddpm.sample refuses as it refuses a fail."""
    record = read_tuned(warned / "sampler.yaml")
    assert record["verdict"] == "warn" and [b["verdict"] for b in record["budgets"]] == ["warn"]
    assert record["budgets"][0]["worst_p"] == pytest.approx(1 / 101)
    line = refusal(capsys, sample.main, compose_sample(checkpoint, tmp_path, f"tuned={warned / 'sampler.yaml'}"))
    assert re.match(r"^tuned=\S+: its gate verdict is warn at 2 model calls \(\w+=.*\), so it is no sampler to use; "
                    r"tune with larger budgets: ", line), line
    assert not list(tmp_path.glob("*.nii.gz"))


def test_a_grid_tuned_for_other_weights_is_refused(passed, tmp_path, capsys):
    other = tiny_checkpoint(tmp_path / "other.pt", seed=1)
    line = refusal(capsys, sample.main, compose_sample(other, tmp_path / "s", f"tuned={passed / 'sampler.yaml'}"))
    assert re.match(rf"^tuned=\S+: tuned for the ema weights of \S+last\.pt \(sha256 [0-9a-f]{{12}}\), not the ema "
                    rf"weights of checkpoint={other}; tune this checkpoint: python -m med_ddpm\.tune "
                    rf"checkpoint={other} ", line), line
    same_file = refusal(capsys, sample.main, compose_sample(read_tuned(passed / "sampler.yaml")["checkpoint"]["path"],
                                                            tmp_path / "s", f"tuned={passed / 'sampler.yaml'}",
                                                            "weights=model"))
    assert "not the model weights of" in same_file


@pytest.mark.parametrize("edit", [("  - 9\n", "  - 8\n"), ("verdict: pass\n", "verdict: pass \n"), None],
                         ids=["timestep", "whitespace", "seal-removed"])
def test_an_edited_grid_file_is_refused(edit, passed, checkpoint, tmp_path, capsys):
    text = (passed / "sampler.yaml").read_text()
    edited = text.replace(*edit, 1) if edit else text.rpartition(SEAL)[0]
    assert edited != text
    (tmp_path / "sampler.yaml").write_text(edited)
    line = refusal(capsys, sample.main, compose_sample(checkpoint, tmp_path / "s", f"tuned={tmp_path / 'sampler.yaml'}"))
    why = "no content_sha256 line" if edit is None else r"edited since med_ddpm\.tune wrote it"
    assert re.match(rf"^tuned={tmp_path / 'sampler.yaml'}: {why}.*python -m med_ddpm\.tune checkpoint=", line), line


def test_an_interrupted_run_resumes_and_reuses_the_reference(failed, checkpoint, cache, tmp_path, monkeypatch):
    """Ctrl-C after the first budget leaves its result and no sampler.yaml; the rerun computes the second budget
    only; the reference comes from the cache the first run filled; the result is the uninterrupted run's."""
    calls = {"search": 0, "reference": 0, "budgets": []}
    search, gate_budget, batched_run = run.stack_distances, run.gate_budget, gate.batched_run

    def counted_search(*args):
        calls["search"] += 1
        return search(*args)

    def counted_budget(t, k, *args):
        calls["budgets"].append(k)
        if calls["budgets"] == [2, 3]:
            raise KeyboardInterrupt
        return gate_budget(t, k, *args)

    def counted_run(model_fn, sampler, cond, t, **kw):
        calls["reference"] += kw.get("reference") is None
        return batched_run(model_fn, sampler, cond, t, **kw)

    monkeypatch.setattr(run, "stack_distances", counted_search)
    monkeypatch.setattr(run, "gate_budget", counted_budget)
    monkeypatch.setattr(gate, "batched_run", counted_run)
    with pytest.raises(KeyboardInterrupt):
        tune.main(compose_tune(checkpoint, tmp_path, cache, *FAIL))
    assert not (tmp_path / "sampler.yaml").exists()
    assert list(json.loads((tmp_path / "tune.json").read_text())["budgets"]) == ["2"]
    tune.main(compose_tune(checkpoint, tmp_path, cache, *FAIL))
    assert calls == {"search": 1, "reference": 0, "budgets": [2, 3, 3]}
    resumed, whole = read_tuned(tmp_path / "sampler.yaml"), read_tuned(failed / "sampler.yaml")
    assert resumed["budgets"] == whole["budgets"] and resumed["gate"] == whole["gate"]


def test_the_gate_is_held_out_from_the_search(checkpoint, cache, tmp_path, capsys, monkeypatch):
    """Searched on the user's scans, gated on their masks: the masks of the searched volumes are left out; the
    reference and every candidate draw sample i's noise from seed (gate.seed, i), and the gate's noise seed may not be
    the search's."""
    x_T, run_trajectory = [], probe.run_trajectory

    def noted(model_fn, sampler, cond, noise, **kw):
        x_T.append(noise.x_T)
        return run_trajectory(model_fn, sampler, cond, noise, **kw)

    monkeypatch.setattr(probe, "run_trajectory", noted)
    write_phantom_niftis(tmp_path / "data", 3, SIZE, seed=3)
    masks = tmp_path / "masks"
    shutil.copytree(tmp_path / "data" / "mask", masks)
    write_phantom_niftis(tmp_path / "more", 1, SIZE, seed=7, names=["zz_other"])
    shutil.copy(tmp_path / "more" / "mask" / "zz_other.nii.gz", masks)
    data = ["data=whole_head", f"data.root={tmp_path / 'data'}"]
    tune.main(compose_tune(checkpoint, tmp_path / "out", tmp_path / "cache", *PASS, *data, f"masks={masks}"))
    drawn = torch.cat(x_T).split(10)  # the reference's N = 10, then the candidate's
    gate_noise = torch.cat([fixed_noise((1, 1, *SIZE), 10, sample_seed(1, i)).x_T for i in range(10)])
    assert len(drawn) == 2 and all(torch.equal(run_x_T, gate_noise) for run_x_T in drawn)
    held = read_tuned(tmp_path / "out" / "sampler.yaml")["gate"]["held_out"]
    assert held["masks"] == ["phantom_0002.nii.gz", "zz_other.nii.gz"]
    assert held["left_out"] == ["phantom_0000.nii.gz", "phantom_0001.nii.gz"]
    assert (held["noise_seed"], held["search_noise_seed"]) == (1, 0)
    searched = build_dataset({"name": "whole_head", "root": str(tmp_path / "data")}, SIZE)
    gated = {cond_hash(load_condition(masks / name, "whole_head", SIZE)[0]) for name in held["masks"]}
    assert len(gated) == 2 and not gated & {cond_hash(searched[i]["cond"]) for i in range(2)}
    assert "**Held out.**" in (tmp_path / "out" / "report.md").read_text()

    line = refusal(capsys, tune.main, compose_tune(checkpoint, tmp_path / "same", cache, "gate.seed=0"))
    assert line.startswith("gate.seed=0: the search's noise seed (search.seed); the gate's noise is held out")


def test_bad_input_is_one_line_and_leaves_no_result(checkpoint, cache, tmp_path, capsys):
    (tmp_path / "notes.pt").write_text("not weights")
    write_phantom_niftis(tmp_path / "big", 2, [16, 16, 16], seed=1)
    cases = {
        "unreadable": ([f"checkpoint={tmp_path / 'notes.pt'}"],
                       rf"^checkpoint={tmp_path / 'notes.pt'}: not a PyTorch checkpoint \(.*\); pass a checkpoint"),
        "masks-size": ([f"masks={tmp_path / 'big' / 'mask'}"],
                       rf"^masks={tmp_path / 'big' / 'mask'}: phantom_0000\.nii\.gz is \[16, 16, 16\] \(D, H, W\), but "
                       r"checkpoint=\S+ samples at \[8, 8, 8\]; pass masks of that size"),
        "too-few-masks": ([f"masks={tmp_path / 'big' / 'mask' / 'phantom_0000.nii.gz'}", "image_size=[16,16,16]"],
                          r"^masks=\S+: 1 mask\(s\) besides the 0 of the search's volumes, and the gate needs "
                          r"quality\.n_masks=2; pass more masks, or quality\.n_masks=1"),
        "budget-above-T": (["budgets=[5,30]"], r"^budgets=30: must be an integer in \[1, 10\] \(the checkpoint's "),
        "ddpm": (["sampler=ddpm"], r"^sampler=ddpm: takes no timestep grid; tune one that does, e\.g\. "
                                   r"sampler=dpm_solver_pp sampler\.variant=sde"),
        "search-n": (["search.n=40"], r"^search\.n=40: synthetic whole_head phantoms \(seed 10000\) hold 32 "
                                      r"volume\(s\); pass search\.n=32 or data\.num_volumes=N$"),
    }
    for name, (overrides, pattern) in cases.items():
        out = tmp_path / name
        line = refusal(capsys, tune.main, compose_tune(checkpoint, out, cache, *overrides))
        assert re.search(pattern, line), (name, line)
        assert not [p.name for p in out.glob("*") if p.name != ".hydra"], name


def test_an_n_the_bias_checks_cannot_fail_at_is_refused_before_anything_is_sampled(checkpoint, tmp_path, capsys,
                                                                                 monkeypatch):
    """N = 8 gives the bias checks' sign-flip test a smallest p of 2 / 2^8, above alpha.bias over the 5 probed
    timesteps: refused in one line naming the option before the search, the timing forward or any trajectory ran."""
    ran = []
    monkeypatch.setattr(run, "stack_distances", lambda *args: ran.append("search"))
    monkeypatch.setattr(run, "seconds_per_volume", lambda *args: ran.append("timing"))
    monkeypatch.setattr(probe, "run_trajectory", lambda *args, **kw: ran.append("trajectory"))
    out = tmp_path / "out"
    line = refusal(capsys, tune.main, compose_tune(checkpoint, out, tmp_path / "cache", "quality.n_samples=8"))
    assert line == ("quality.n_samples=8: the bias checks' sign-flip test cannot reach p < 0.002 (alpha.bias 0.01 "
                    "over 5 probed timesteps, Holm), so they could never fail; pass quality.n_samples>=10")
    assert ran == [] and not [p.name for p in out.glob("*") if p.name != ".hydra"]


def test_another_tuning_in_the_output_dir_is_refused(passed, checkpoint, cache, capsys):
    """A rerun with other settings must not mix its budgets with the earlier run's."""
    line = refusal(capsys, tune.main, compose_tune(checkpoint, passed, cache, *PASS, "search.seed=5"))
    assert line == (f"output_dir={passed}: holds a tuning with another search (tune.json); choose another "
                    "output_dir=, or remove it")


@pytest.mark.e2e
def test_logger_wandb_makes_each_budget_one_offline_run_once(failed, checkpoint, cache, tmp_path, wandb_offline):
    """A finished tuning rerun with logger=wandb reuses every budget and logs each as a run: the calls and the
    recipe booleans as config, the verdict and worst p-value of tune.json as summary; a rerun logs none again."""
    out = tmp_path / "tuned"
    shutil.copytree(failed, out)
    for _ in range(2):
        tune.main(compose_tune(checkpoint, out, cache, *FAIL, "logger=wandb"))
    runs = sorted(wandb_offline(out), key=lambda run: run["config"]["calls"])
    budgets = json.loads((out / "tune.json").read_text())["budgets"]
    assert [logged["name"] for logged in runs] == ["tune.2_calls", "tune.3_calls"]
    for logged, (calls, result) in zip(runs, budgets.items(), strict=True):
        assert logged["config"]["calls"] == int(calls) and logged["group"] == "tuned" and logged["job_type"] == "tune"
        assert not any(logged["config"]["recipe"].values()) and "amp_fp16" in logged["config"]["recipe"]
        assert logged["summary"]["verdict"] == result["verdict"] == "fail"
        assert logged["summary"]["worst_p"] == pytest.approx(min(
            c["p_value"] for c in result["report"]["checks"].values() if c.get("p_value") is not None))
