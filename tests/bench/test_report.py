"""bench.report on fixture rows: speed-ups vs the in-sweep baseline, missing baseline, failed rows."""

import json

import pytest

from bench import report
from bench.records import append_row, missing_baselines, read_rows


def row(recipes, ms, status="ok", batch=1, scenario="train_step", mem=10.0, quality=None, message=""):
    return {"scenario": scenario, "model": "medddpm_whole_head", "image_size": [128, 128, 128],
            "batch_size": batch, "sampler": None, "steps": None, "recipes": recipes, "status": status,
            "message": message, "ms_median": ms, "ms_p10": ms and ms * 0.9, "ms_p90": ms and ms * 1.1,
            "iqr_pct": 1.0, "peak_mem_gib": mem, "volumes_per_s": ms and batch / ms * 1e3, "tflops": 1.0,
            "peak_fraction": 0.01, "compile_s": None, "quality": quality, "env": {"gpu": "NVIDIA H200"},
            "config": {"bench": {"timeout_s": 10}}}


ROWS = [
    row([], 800.0, mem=20.0),
    row(["tf32"], 200.0, mem=20.0, quality={"verdict": "pass", "metrics": {"x0_nrmse": 1e-3}}),
    row(["amp_bf16"], 100.0, mem=10.0, quality={"verdict": "warn", "metrics": {"x0_nrmse": 2e-2}}),
    row(["amp_fp16"], None, status="oom", mem=None, message="CUDA out of memory. Tried to allocate"),
    row(["tf32"], 400.0, batch=2),  # workload without a baseline
    row([], 1600.0, batch=4), row(["tf32"], 300.0, batch=4),
]


@pytest.fixture
def sweep(tmp_path):
    for r in ROWS:
        append_row(tmp_path / "results.jsonl", r)
    return tmp_path


def test_speedups_against_same_workload_baseline():
    table = report.report_rows(ROWS)
    by = {(r["batch_size"], r["recipes"]): r for r in table}
    assert by[(1, "[] (fp32)")]["speedup"] == pytest.approx(1.0)
    assert by[(1, "tf32")]["speedup"] == pytest.approx(4.0)
    assert by[(1, "amp_bf16")]["speedup"] == pytest.approx(8.0)
    assert by[(1, "amp_bf16")]["mem_vs_baseline"] == pytest.approx(0.5)
    assert by[(1, "amp_bf16")]["quality"] == "warn"
    assert by[(1, "amp_fp16")]["speedup"] is None and by[(1, "amp_fp16")]["status"] == "oom"
    assert by[(2, "tf32")]["speedup"] is None and not by[(2, "tf32")]["has_baseline"]
    assert by[(4, "tf32")]["speedup"] == pytest.approx(1600 / 300)


def test_pareto_front():
    # (quality distance, speed-up): the third point is dominated by the second.
    assert report.pareto_front([(1e-3, 4.0), (2e-2, 8.0), (3e-2, 7.0), (1e-4, 1.0)]) == [0, 1, 3]


def test_write_report_files(sweep):
    md = report.write_report(sweep).read_text()
    assert "oom" in md and "CUDA out of memory" in md
    assert "No successful strict-FP32 row" in md  # the batch-2 workload
    assert "| tf32 | ok | 200 |" in md
    csv_text = (sweep / "report.csv").read_text().splitlines()
    assert len(csv_text) == len(ROWS) + 1 and csv_text[0].startswith("scenario,model")
    for png in ("speedup.png", "speedup_vs_quality.png", "throughput_vs_batch.png"):
        assert (sweep / png).stat().st_size > 1000


def test_torn_line_and_missing_baselines(sweep):
    with open(sweep / "results.jsonl", "a") as f:
        f.write('{"scenario": "train_st')  # a writer killed mid-line
    with pytest.warns(RuntimeWarning, match="unreadable row"):
        rows = read_rows(sweep)
    assert len(rows) == len(ROWS)
    need = missing_baselines(rows)
    assert [r["batch_size"] for r in need] == [2]


def test_bad_status_refused(tmp_path):
    with pytest.raises(ValueError, match="status"):
        append_row(tmp_path / "r.jsonl", {**row([], 1.0), "status": "great"})
    assert not (tmp_path / "r.jsonl").exists() or json.loads("[]") == []


def test_rows_merged_from_several_runs_keep_their_commit():
    """Rows appended by later device runs must not be labelled with the first row's commit."""
    a, b = row([], 100.0), row(["compile"], 30.0)
    a["env"] = {"gpu": "NVIDIA H200", "git_sha": "ac09301"}
    b["env"] = {"gpu": "NVIDIA H200", "git_sha": "55861c0"}
    table = report.report_rows([a, b])
    assert [r["code"] for r in table] == ["ac09301", "55861c0"]
    assert "git_sha ac09301 / 55861c0" in report.env_summary([a, b])
    assert "gpu NVIDIA H200," in report.env_summary([a, b])
    assert "| 55861c0 |" in report.to_markdown(table, [a, b])
