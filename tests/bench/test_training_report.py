"""bench.quality.training_report: training.md rendered from a training-stack folder's own files, with each writer's commit."""

import json

from bench.quality.training_report import TRAINING_MD, training_markdown, write_training_report
from bench.report import write_report

SHA = "0123456789abcdef0123456789abcdef01234567"
CHECK = {"value": 0.05, "p_value": 0.001, "status": "fail"}


def folder(tmp_path, verdict_sha=SHA, **verdict):
    """A finished preset=quality_training folder: training.json, loss_curves.json and training_verdict.json."""
    timings = {"ms_per_step": 447.025, "steady_steps": 997, "first_step_s": 1.9955, "compile_cache": "off",
               "data_wait_pct": 0.02}
    arms = {"fp32": {"timings": timings, "starts": [{"git_sha": SHA, "dirty": False}, {"git_sha": "f" * 40}]},
            "fast_train": {"timings": {**timings, "ms_per_step": 31.915, "compile_cache": "cold"}, "starts": None},
            "fp32_reseed": {"timings": None, "starts": []}}
    summary = {"fp32": {"tail_mean_loss": 0.07188}, "fast_train": {"tail_mean_loss": 0.06942,
                                                                  "tail_mean_difference": -0.00246}}
    (tmp_path / "training.json").write_text(json.dumps({"arms": arms, "git_sha": SHA, "dirty": True}))
    (tmp_path / "loss_curves.json").write_text(json.dumps({"summary": summary, "git_sha": SHA, "dirty": False}))
    base = {"verdict": "pass", "why": "within training noise", "note": "one draw of training noise",
            "gate": {"stack": "fail", "training_noise": "fail"},
            "checks": {"kid_vs_ref": {"stack": {**CHECK, "value": 4.6e-5}, "training_noise": CHECK,
                                      "verdict": "within"}},
            "weight_differences": {"x0_nrmse": {"stack": 0.034, "training_noise": 0.080}}, "git_sha": verdict_sha}
    (tmp_path / "training_verdict.json").write_text(json.dumps({**base, **verdict}))
    return tmp_path


def test_the_page_holds_every_arm_the_verdict_and_each_writer_s_commit(tmp_path):
    page = training_markdown(folder(tmp_path))
    assert "`training.json` (code `0123456789ab-dirty`), `loss_curves.json` (code `0123456789ab`)" in page
    assert "`training_verdict.json` (code `0123456789ab`)" in page
    assert ("| strict FP32 (recipe=[]) | 447.0 | 997 | 2.0 (off) | 0.02 | 0.0719 |  | `0123456789ab`, `ffffffffffff` |"
            in page)  # a run resumed by other code names both commits
    assert "| experiment=fast_train's stack | 31.9 | 997 | 2.0 (cold) | 0.02 | 0.0694 | -0.0025 | not recorded |" in page
    assert "| strict FP32, next seed (unpaired) |  |  |  |  |  |  | not recorded |" in page
    assert "**pass**: within training noise. The gate alone: stack vs FP32: fail; FP32 reseeded vs FP32: fail." in page
    assert "| kid_vs_ref | 4.6e-05 | 0.001 | 0.05 | 0.001 | within |" in page
    assert "| x0_nrmse | 0.034 | 0.08 |" in page and page.endswith("Note: one draw of training noise\n")


def test_an_undecided_verdict_from_code_that_kept_no_commit_renders_without_check_tables(tmp_path):
    page = training_markdown(folder(tmp_path, verdict_sha=None, verdict="undecided", why="no gated stack row",
                                    gate=None, checks=None, weight_differences=None))
    assert "`training_verdict.json` (code not recorded)" in page and "**undecided**: no gated stack row." in page
    assert "these decide" not in page and "reported, not deciding" not in page


def test_a_folder_without_a_training_verdict_gets_no_page(tmp_path):
    assert training_markdown(tmp_path) is None and write_training_report(tmp_path) is None
    assert not (tmp_path / TRAINING_MD).exists()


def test_bench_report_writes_the_page_beside_its_tables(tmp_path):
    (folder(tmp_path) / "results.jsonl").write_text("")
    write_report(tmp_path)
    assert (tmp_path / TRAINING_MD).read_text() == training_markdown(tmp_path)


def test_each_p_value_has_two_significant_digits(tmp_path):
    checks = {"kid_vs_ref": {"stack": {**CHECK, "p_value": 0.0012345}, "training_noise": CHECK, "verdict": "within"}}
    assert "| kid_vs_ref | 0.05 | 0.0012 | 0.05 | 0.001 | within |" in training_markdown(folder(tmp_path, checks=checks))
