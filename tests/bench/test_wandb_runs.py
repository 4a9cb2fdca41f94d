"""One W&B run per results row: the offline run files, read back with W&B's own record protobuf (tests/conftest.py
``wandb_offline``), hold the row's recipe toggles as config and its figures as summary. No network, no mock of
wandb: ``wandb_offline`` keeps every W&B folder in the test's tmp_path."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bench.core.records import RESULTS_FILE, RUN_ID_ENV, append_row, read_rows
from bench.core.wandb_runs import job_name, log_job, publish_unlogged, run_config, run_summary, stack_name
from bench.report import write_report
from med_ddpm.config_checks import ConfigError, OutputError
from med_ddpm.tracking import LOGGED_FILE, WandbTracker, check_logger, deciding_check, gate_summary

REPO = Path(__file__).resolve().parents[2]
GATED = REPO / "bench" / "results" / "h100" / "quality" / RESULTS_FILE  # two rows with a real gate report


def command(*args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != RUN_ID_ENV}  # a launch from a shell: its own run
    done = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def by_name(runs: list[dict]) -> dict[str, dict]:
    return {run["name"]: run for run in runs}


def check_runs_equal_rows(runs: list[dict], rows: list[dict]) -> None:
    """One run per row: named by the job, grouped by the launch, its recipes true, the others false, its
    median in the summary."""
    assert len(runs) == len(rows)
    named = by_name(runs)
    for row in rows:
        run = named[job_name(row)]
        assert (run["group"], run["job_type"]) == (row["run_id"], row["scenario"])
        assert {name for name, on in run["config"]["recipe"].items() if on} == set(row["recipes"])
        assert "amp_fp16" in run["config"]["recipe"]  # every recipe is an axis, false where not chosen
        assert run["config"]["stack"] == stack_name(row) and run["config"]["run_id"] == row["run_id"]
        assert run["summary"]["ms_median"] == row["ms_median"] and run["summary"]["status"] == row["status"]
        assert run["exit_code"] == 0


@pytest.mark.e2e
def test_a_two_job_sweep_leaves_one_offline_run_per_job(tmp_path, wandb_offline):
    out = tmp_path / "sweep"
    command("bench.sweep", "-m", "experiment=bench_smoke", "recipe=[],[channels_last_3d]", "logger=wandb",
            f"hydra.sweep.dir={out}")
    rows, runs = read_rows(out), wandb_offline(out)
    check_runs_equal_rows(runs, rows)
    fp32, channels_last = (by_name(runs)[job_name(r)] for r in rows)
    assert fp32["config"]["stack"] == "strict_fp32" and channels_last["config"]["recipe"]["channels_last_3d"]
    assert channels_last["config"]["recipe_options"]["channels_last_3d"] == {"audit": True}
    speedup = rows[0]["ms_median"] / rows[1]["ms_median"]
    assert channels_last["summary"]["speedup_vs_strict_fp32"] == pytest.approx(speedup)
    assert channels_last["summary"]["verdict"] == "not gated"
    write_report(out, wandb=True)  # every row was logged when measured: the report logs none again
    assert len(wandb_offline(out)) == 2


@pytest.mark.e2e
def test_a_smoke_ladder_leaves_one_offline_run_per_job(tmp_path, wandb_offline):
    out = tmp_path / "ladder"
    command("bench.ladder", "preset=smoke", f"out={out}", "only='denoise_step bench.batch_size=1'",
            "best=[channels_last_3d]", "logger=wandb")
    rows = read_rows(out)
    assert [r["recipes"] for r in rows] == [[], ["channels_last_3d"]]
    check_runs_equal_rows(wandb_offline(out / "wandb"), rows)


@pytest.mark.e2e
def test_the_report_publishes_rows_measured_without_wandb_once(tmp_path, wandb_offline):
    """Rows measured without W&B (a gated pair, an OOM) become runs when the report is asked to, offline, in the
    results folder; the verdict, worst p-value, deciding check and detectable eps bias are in the summary, the
    failed job is a failed run with its message; a second report logs nothing."""
    shutil.copy(GATED, tmp_path / RESULTS_FILE)
    oom = {**read_rows(tmp_path)[0], "status": "oom", "message": "CUDA out of memory. Tried to allocate 2 GiB",
           "ms_median": None, "quality": None, "job_name": "forward.shipped", "recipes": ["amp_bf16"]}
    append_row(tmp_path / RESULTS_FILE, oom)
    rows = read_rows(tmp_path)
    write_report(tmp_path, wandb=True)
    runs = wandb_offline(tmp_path / "wandb")
    assert len(runs) == 3 and len((tmp_path / LOGGED_FILE).read_text().splitlines()) == 3
    gated = [r for r in runs if r["summary"]["status"] == "ok"]
    assert sorted(r["summary"]["verdict"] for r in gated) == ["fail", "warn"]
    for run in gated:
        assert run["summary"]["worst_p"] == pytest.approx(0.7492507492507493)
        assert run["summary"]["deciding_check"] == "eps_noise"
        assert run["summary"]["min_detectable_eps_bias"] == rows[0]["quality"]["min_detectable_eps_bias"]
    failed = by_name(runs)["forward.shipped"]
    assert failed["exit_code"] == 1 and failed["summary"]["status"] == "oom"
    assert failed["summary"]["message"].startswith("CUDA out of memory") and failed["config"]["stack"] == "shipped"
    assert publish_unlogged(tmp_path, rows) == []


@pytest.mark.e2e
def test_a_command_preset_logs_each_of_its_rows_once_the_run_ends(tmp_path, wandb_offline, monkeypatch):
    """preset=evidence, e2e, quality_training and quality_128 run their jobs as commands of their own: with
    logger=wandb their rows (a failed one too) become runs when the preset returns, and a rerun logs none again."""
    from hydra import compose

    from bench import ladder
    from med_ddpm.cli import configs

    rows = read_rows(GATED)
    oom = {**rows[0], "status": "oom", "message": "CUDA out of memory", "ms_median": None, "quality": None}

    def preset(cfg):
        for row in (*rows, oom):
            append_row(Path(cfg.out) / RESULTS_FILE, row)
        return 0

    monkeypatch.setitem(ladder.COMMAND_PRESETS, "e2e", preset)
    with configs():
        cfg = compose("ladder", overrides=["preset=e2e", f"out={tmp_path}", "logger=wandb"])
    assert ladder.run(cfg) == 0
    runs = wandb_offline(tmp_path / "wandb")
    assert len(runs) == 3 and sorted(r["summary"]["status"] for r in runs) == ["ok", "ok", "oom"]
    monkeypatch.setitem(ladder.COMMAND_PRESETS, "e2e", lambda cfg: 0)
    ladder.run(cfg)
    assert len(wandb_offline(tmp_path / "wandb")) == 3

@pytest.mark.e2e
def test_runs_are_read_once_w_and_b_has_written_them_whole(tmp_path, wandb_offline):
    """``finish()`` returns before W&B's service writes the run's file (it holds its last block until it closes the
    run): whatever part of the file is on disk when the reader first looks, it reads the whole run once written,
    and refuses a run whose file never holds its exit record."""
    tracker = WandbTracker({"mode": "offline", "dir": str(tmp_path / "made")}, {"a": 1}, name="made")
    tracker.summarize({"x": 2.5})
    tracker.finish()
    (made,) = wandb_offline(tmp_path / "made")
    assert (made["name"], made["config"]["a"], made["summary"]["x"], made["exit_code"]) == ("made", 1, 2.5, 0)
    (path,) = (tmp_path / "made").rglob("offline-run-*/run-*.wandb")
    data = path.read_bytes()
    for cut in (0, 7, len(data) // 2, len(data) - 1):  # none yet, the header alone, a cut record, all but a byte
        late = tmp_path / f"late{cut}" / path.parent.name / path.name
        late.parent.mkdir(parents=True)
        late.write_bytes(data[:cut])
        writer = threading.Timer(0.3, late.write_bytes, [data])
        writer.start()
        assert wandb_offline(late.parents[1]) == [made]
        writer.join()
    late.write_bytes(data[:-1])
    with pytest.raises(AssertionError, match=r"no finished W&B run file after 0.2 s"):
        wandb_offline(late.parents[1], wait_s=0.2)


def test_a_wandb_failure_keeps_the_row_and_warns_in_one_line(tmp_path, wandb_offline, caplog):
    row = append_row(tmp_path / RESULTS_FILE, {
        "scenario": "denoise_step", "batch_size": 1, "recipes": [], "status": "ok", "ms_median": 2.0,
        "config": {"logger": {"name": "wandb", "mode": "no-such-mode", "dir": str(tmp_path)}}})
    with caplog.at_level(logging.WARNING):
        log_job(row, tmp_path)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "W&B: denoise_step.b1.strict_fp32 not logged" in warning and "\n" not in warning
    assert read_rows(tmp_path) == [row] and not (tmp_path / LOGGED_FILE).exists()


def test_config_and_summary_of_a_row():
    """What a dashboard reads: the recipe booleans and options, the stack's name, the environment; the timings,
    both speed-ups against their own run's rows, and the gate's numbers."""
    run = {"run_id": "r", "scenario": "full_sample", "model": "m", "image_size": [8, 8, 8], "batch_size": 1,
           "sampler": "ddim", "steps": 25, "status": "ok", "env": {"gpu": "H100", "torch": "2.x"}}
    base = {**run, "recipes": [], "ms_median": 40.0}
    defaults = {**run, "recipes": ["torch_defaults"], "ms_median": 20.0}
    other_run = {**base, "run_id": "other", "ms_median": 1.0}
    row = {**run, "recipes": ["amp_fp16", "compile"], "ms_median": 10.0, "job_name": "sampler25.shipped",
           "config": {"recipe": {"amp_fp16": {"dtype": "float16", "_target_": "x"}, "compile": {"mode": "max"}}},
           "quality": read_rows(GATED)[0]["quality"]}
    config = run_config(row)
    assert config["recipe"]["amp_fp16"] and config["recipe"]["compile"] and not config["recipe"]["tf32"]
    assert config["recipe_options"] == {"amp_fp16": {"dtype": "float16"}, "compile": {"mode": "max"}}
    assert (config["stack"], config["sampler"], config["calls"], config["gpu"]) == ("shipped", "ddim", 25, "H100")
    summary = run_summary(row, [other_run, base, defaults, row])
    assert summary["speedup_vs_strict_fp32"] == 4.0 and summary["speedup_vs_torch_defaults"] == 2.0
    assert (summary["verdict"], summary["deciding_check"]) == ("warn", "eps_noise")
    assert "speedup_vs_torch_defaults" not in run_summary(row, [base, row])


def test_the_deciding_check_is_the_verdicts_with_the_smallest_p():
    checks = {"a": {"status": "pass", "p_value": 0.01}, "b": {"status": "fail", "p_value": 0.2},
              "c": {"status": "fail", "p_value": 0.05}, "d": {"status": "fail"}}
    assert deciding_check(checks, "fail") == ("c", 0.01)
    assert deciding_check(checks, "pass") == ("a", 0.01)
    assert gate_summary(None) == {"verdict": "not gated"}


def test_logger_wandb_that_cannot_run_is_one_line(tmp_path, monkeypatch):
    assert not check_logger({"name": "none"})
    assert check_logger({"name": "wandb", "dir": str(tmp_path / "new")}) and (tmp_path / "new").is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match=r"^logger\.dir=.*file/sub: W&B cannot write there"):
        check_logger({"name": "wandb", "dir": str(tmp_path / "file" / "sub")})
    with pytest.raises(ConfigError, match=r"^logger\.mode=bogus: not a W&B mode"):
        check_logger({"name": "wandb", "mode": "bogus", "dir": str(tmp_path)})
    monkeypatch.setitem(sys.modules, "wandb", None)  # the package absent, as on a machine without it
    with pytest.raises(ConfigError, match=r"^logger=wandb: the wandb package is not installed; pip install"):
        check_logger({"name": "wandb", "dir": str(tmp_path)})
