"""bench.report's model-calls plot: gated sampling rows, the worst distribution p-value, the gate's dict metrics."""

from bench import report
from bench.records import append_row

SHA = "0123456789abcdef0123456789abcdef01234567"
CHECKS = {"kid_vs_ref": {"kind": "distribution"}, "mmd_vs_ref": {"kind": "distribution"},
          "x0_nrmse": {"kind": "paired"}}


def sampling_row(sampler: str, steps: int, kid_p: float, mmd_p: float, verdict: str) -> dict:
    metrics = {"kid_vs_ref": {"value": 1e-3, "p_value": kid_p}, "mmd_vs_ref": {"value": 2e-3, "p_value": mmd_p},
               "x0_nrmse": {"value": 0.2}, "eps_rel_l2": {"value": 0.01, "p_value": 1e-9}}
    return {"run_id": "run-1", "git_sha": SHA, "dirty": False, "scenario": "full_sample", "model": "quality_model",
            "image_size": [64, 64, 64], "batch_size": 32, "sampler": sampler, "steps": steps, "recipes": ["amp_bf16"],
            "status": "ok", "message": "", "ms_median": 10.0 * steps, "peak_mem_gib": 1.0,
            "quality": {"verdict": verdict, "metrics": metrics},
            "config": {"bench": {"timeout_s": 10}, "quality": {"checks": CHECKS}}}


def test_worst_distribution_p_reads_only_the_distribution_checks():
    assert report.worst_distribution_p(sampling_row("ddpm", 250, 0.4, 0.03, "pass")) == 0.03  # not eps_rel_l2's
    assert report.worst_distribution_p({"quality": None, "config": {}}) is None


def test_quality_value_reads_the_gates_dict_metrics():
    assert report._quality_value(sampling_row("ddpm", 250, 0.4, 0.03, "pass"), "x0_nrmse") == 0.2


def test_report_plots_calls_against_the_gate(tmp_path):
    for sampler, steps, p, verdict in [("dpm_solver_pp(variant=sde)", 25, 1e-4, "fail"),
                                       ("dpm_solver_pp(variant=sde)", 100, 0.2, "pass"),
                                       ("dpm_solver_pp(order=3,variant=sde)", 25, 0.05, "pass")]:
        append_row(tmp_path / "results.jsonl", sampling_row(sampler, steps, p, 0.5, verdict))
    md = report.write_report(tmp_path).read_text()
    assert "![calls_vs_quality](calls_vs_quality.png)" in md
    assert (tmp_path / "calls_vs_quality.png").stat().st_size > 1000
    rows = report.read_rows(tmp_path)
    assert report.plot_calls(rows, report.report_rows(rows), tmp_path / "none.png") is not None
    assert report.plot_calls(rows[:0], [], tmp_path / "none.png") is None
