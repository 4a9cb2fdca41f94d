"""End-to-end CPU sweeps through Hydra multirun + per-job subprocesses (the bench_smoke experiment),
a sweep directory reused by a second launch, and what a job's row carries (measured in this process)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.core.records import RUN_ID_ENV, read_rows
from bench.core.runner import compose_job
from bench.core.worker import measure, run_job
from bench.report import report_rows, write_report

REPO = Path(__file__).resolve().parents[2]
IDENTITY = ("scenario", "model", "image_size", "batch_size", "recipes", "status", "flops", "precision", "message")


def sweep(tmp_path: Path, *overrides: str) -> list[dict]:
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "bench.sweep", "-m", "experiment=bench_smoke", *overrides, f"hydra.sweep.dir={out}"]
    env = {k: v for k, v in os.environ.items() if k != RUN_ID_ENV}  # a launch from a shell: its own run
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_rows(out)


def identity(rows):
    return sorted(json.dumps({k: r.get(k) for k in IDENTITY}, sort_keys=True) for r in rows)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The default-suite sweep: one job, an injected OOM, no baseline given (so one is added)."""
    return sweep(tmp_path_factory.mktemp("smoke"), "recipe=[amp_bf16]", "bench.inject=oom")


@pytest.mark.e2e
def test_smoke_sweep_rows_oom_and_added_baseline(smoke):
    assert [(r["recipes"], r["status"]) for r in smoke] == [(["amp_bf16"], "oom"), ([], "ok")]
    oom, base = smoke
    assert base["ms_median"] > 0 and base["ms_p10"] <= base["ms_median"] <= base["ms_p90"]
    assert base["volumes_per_s"] > 0 and base["flops"] > 0 and base["env"]["torch"] and base["message"] == ""
    assert base["config"]["model"]["image_size"] == [8, 8, 8]
    assert base["precision"] == "fp32" and base["describe"]["order"] == []
    assert "out of memory" in oom["message"] and oom["ms_median"] is None
    assert base["config"]["bench"]["inject"] is None  # the added baseline never inherits a fault


@pytest.mark.slow
def test_results_do_not_depend_on_job_order(tmp_path):
    forward = sweep(tmp_path / "a", "recipe=[],[amp_bf16]", "bench=denoise_step", "bench.inject=null,nan")
    backward = sweep(tmp_path / "b", "recipe=[amp_bf16],[]", "bench=denoise_step", "bench.inject=nan,null")
    assert len(forward) == 4 and {r["status"] for r in forward} == {"ok", "nan"}
    assert identity(backward) == identity(forward)


@pytest.mark.slow
def test_worker_crash_is_an_error_row(tmp_path):
    job = compose_job(["experiment=bench_smoke", "bench=denoise_step", "bench.inject=segfault"], tmp_path)
    row = run_job(job, tmp_path / "job", timeout_s=120)
    assert row["status"] == "error" and "SIGSEGV" in row["message"]
    assert row["env"]["torch"]  # the placeholder row written before the crash kept the environment


def test_a_recipe_inert_on_the_device_is_named_and_its_row_gets_no_speedup(tmp_path):
    """tf32 sets CUDA flags no CPU kernel reads: on a CPU its row times the baseline again, so the row names it and
    the report shows no ratio (a noise "speed-up" read as the recipe's effect), while amp_bf16 keeps its ratio."""
    rows = []
    for recipes in ("[]", "[tf32]", "[tf32,amp_bf16]"):
        job = compose_job(["experiment=bench_smoke", "bench=denoise_step", f"recipe={recipes}"], tmp_path)
        (row,) = measure([job], tmp_path / f"row{len(rows)}.json")
        rows.append({**row, "run_id": "r", "git_sha": "0" * 40})
    assert [r["inert_recipes"] for r in rows] == [[], ["tf32"], ["tf32"]]
    assert [r["precision"] for r in rows] == ["fp32", "fp32", "bf16"]
    assert rows[2]["describe"]["order"] == ["tf32", "amp_bf16"] and rows[2]["ms_median"] > 0
    base, tf32, both = report_rows(rows)
    assert tf32["speedup"] is None and tf32["message"] == "inert on cpu: tf32"
    assert both["speedup"] == pytest.approx(rows[0]["ms_median"] / rows[2]["ms_median"])
    assert both["message"] == "inert on cpu: tf32"


def test_quality_gate_fills_the_row(tmp_path):
    """bench.quality=true: the row carries med_ddpm.quality's verdict for the job's stack vs strict FP32."""
    job = compose_job(["experiment=bench_smoke", "bench=denoise_step", "bench.quality=true", "diffusion.timesteps=10",
                       "sampler.steps=10", "recipe=[amp_bf16]"], tmp_path)
    (row,) = measure([job], tmp_path / "row.json")
    assert row["status"] == "ok", row["message"]
    quality = row["quality"]
    assert quality["metrics"]["eps_rel_l2"] > 0  # bf16 drifts from fp32: the comparison ran
    # bf16 moves one voxel of the 32 samples by about a quarter of the pass-to-warn range; every other check passes
    statuses = {name: check["status"] for name, check in quality["checks"].items()}
    assert {name for name, status in statuses.items() if status != "pass"} == {"x0_max_error"}, quality["reasons"]
    assert quality["verdict"] == statuses["x0_max_error"] == "warn"
    assert quality["reasons"] == [f"x0_max_error={quality['checks']['x0_max_error']['value']:.4g} -> warn (limits pass "
                                  "0.1, warn 0.5)"]


@pytest.mark.slow  # two sweeps; tests/bench/test_report.py checks the same-run matching in the default suite
def test_a_reused_sweep_dir_reports_its_latest_run(tmp_path):
    """`make demo` twice into one directory: the second report shows the same stacks as the first, every
    one from the second run and against that run's baseline (never the first run's)."""
    shapes = []
    for _ in range(2):
        rows = sweep(tmp_path, "bench=denoise_step", "recipe=[],[amp_bf16]")
        md = write_report(tmp_path / "sweep").read_text()
        headline = [r for r in report_rows(rows) if r["headline"]]
        shapes.append(([(r["recipes"], r["status"]) for r in headline],
                       [line for line in md.splitlines() if line.startswith("#")]))
    assert shapes[0] == shapes[1] and shapes[0][0] == [("[] (fp32)", "ok"), ("amp_bf16", "ok")]
    assert len({r["run_id"] for r in rows}) == 2 and all(len(r["git_sha"]) == 40 for r in rows)
    second = [r for r in rows if r["run_id"] == rows[-1]["run_id"]]
    base, amp = (next(r for r in second if r["recipes"] == names) for names in ([], ["amp_bf16"]))
    (speedup,) = [r["speedup"] for r in headline if r["recipes"] == "amp_bf16"]
    assert speedup == pytest.approx(base["ms_median"] / amp["ms_median"])
