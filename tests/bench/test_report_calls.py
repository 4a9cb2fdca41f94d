"""bench.report's model-calls plot: gated sampling rows, the worst distribution p-value, the gate's checks."""

from pathlib import Path

from bench import report
from bench.core.records import append_row, read_rows

SHA = "0123456789abcdef0123456789abcdef01234567"
H200_SAMPLERS = Path(__file__).resolve().parents[2] / "bench/results/h200/quality/samplers/results.jsonl"


def sampling_row(sampler: str, steps: int, kid_p: float, mmd_p: float, verdict: str) -> dict:
    """A gated sampling row as the gate writes it: plain metric values, and each check's kind and p-value."""
    checks = {"kid_vs_ref": {"kind": "distribution", "value": 1e-3, "p_value": kid_p, "status": verdict},
              "mmd_vs_ref": {"kind": "distribution", "value": 2e-3, "p_value": mmd_p, "status": verdict},
              "eps_mean_bias": {"kind": "bias", "value": 1e-4, "p_value": 1e-9, "status": "pass"}}
    return {"run_id": "run-1", "git_sha": SHA, "dirty": False, "scenario": "full_sample", "model": "quality_model",
            "image_size": [64, 64, 64], "batch_size": 32, "sampler": sampler, "steps": steps, "recipes": ["amp_bf16"],
            "status": "ok", "message": "", "ms_median": 10.0 * steps, "peak_mem_gib": 1.0,
            "quality": {"verdict": verdict, "metrics": {"kid_vs_ref": 1e-3, "mmd_vs_ref": 2e-3, "x0_nrmse": 0.2},
                        "checks": checks},
            "config": {"bench": {"timeout_s": 10}}}


def test_worst_distribution_p_reads_only_the_distribution_checks():
    assert report.worst_distribution_p(sampling_row("ddpm", 250, 0.4, 0.03, "pass")) == 0.03  # not the bias check's
    assert report.worst_distribution_p({"quality": None, "config": {}}) is None


def test_worst_distribution_p_reads_the_h200_gate_rows():
    """The rows the gate wrote on the H200: every one has a distribution p-value, the passing ones the highest."""
    rows = read_rows(H200_SAMPLERS)
    worst = {row["run_id"] + row["sampler"] + str(row["steps"]): report.worst_distribution_p(row) for row in rows}
    assert all(p is not None and 0 < p <= 1 for p in worst.values())
    passed = [report.worst_distribution_p(r) for r in rows if r["quality"]["verdict"] == "pass"]
    failed = [report.worst_distribution_p(r) for r in rows if r["quality"]["verdict"] == "fail"]
    assert passed and failed and min(passed) > 0.05 > min(failed)


def test_quality_value_reads_the_gates_metrics():
    assert report._quality_value(sampling_row("ddpm", 250, 0.4, 0.03, "pass"), "x0_nrmse") == 0.2


def test_report_plots_calls_against_the_gate(tmp_path):
    for sampler, steps, p, verdict in [("dpm_solver_pp(variant=sde)", 25, 1e-4, "fail"),
                                       ("dpm_solver_pp(variant=sde)", 100, 0.2, "pass"),
                                       ("dpm_solver_pp(order=3,variant=sde)", 25, 0.05, "pass")]:
        append_row(tmp_path / "results.jsonl", sampling_row(sampler, steps, p, 0.5, verdict))
    md = report.write_report(tmp_path).read_text()
    assert "![calls_vs_quality](calls_vs_quality.png)" in md
    assert (tmp_path / "calls_vs_quality.png").stat().st_size > 1000
    rows = read_rows(tmp_path)
    assert report.plot_calls(rows, report.report_rows(rows), tmp_path / "none.png") is not None
    assert report.plot_calls(rows[:0], [], tmp_path / "none.png") is None
