"""bench.quality.training_report: training.md rendered from a training-stack folder's own files, with each writer's commit."""

import json

from bench.quality.training_report import TRAINING_MD, training_markdown, write_training_report
from bench.report import write_report

SHA = "0123456789abcdef0123456789abcdef01234567"
def judged(value, p_adjusted, status, edge=0.3):
    return {"value": value, "band": {"draws": {"fp32_seed1": 0.1, "fp32_seed2": 0.14}, "k": 2, "mean": 0.12,
                                     "sd": 0.0283, "fail_edge": edge},
            "effect_size": (value - 0.12) / 0.0283, "p_value": p_adjusted / 5, "p_adjusted": p_adjusted, "status": status}


def folder(tmp_path, verdict_sha=SHA, **verdict):
    """A finished preset=quality_training folder: training.json, loss_curves.json and training_verdict.json."""
    timings = {"ms_per_step": 447.025, "steady_steps": 997, "first_step_s": 1.9955, "compile_cache": "off",
               "data_wait_pct": 0.02}
    arms = {"fp32": {"timings": timings, "starts": [{"git_sha": SHA, "dirty": False}, {"git_sha": "f" * 40}]},
            "fast_train": {"timings": {**timings, "ms_per_step": 31.915, "compile_cache": "cold"}, "starts": None},
            "control": {"timings": timings, "starts": [{"git_sha": SHA, "gpu": "0", "runs_per_gpu": 7}]},
            "fp32_seed1": {"timings": None, "starts": []}}
    summary = {"fp32": {"tail_mean_loss": 0.07188, "val_loss": 0.081234}, "fast_train": {"tail_mean_loss": 0.06942}}
    (tmp_path / "training.json").write_text(json.dumps({"arms": arms, "git_sha": SHA, "dirty": True}))
    (tmp_path / "loss_curves.json").write_text(json.dumps({"summary": summary, "git_sha": SHA, "dirty": False}))
    val = {**judged(0.0819, 1.0, "within"), "band": {"draws": {"fp32": 0.082}, "k": 5, "mean": 0.0821, "sd": 0.0008,
                                                     "fail_edge": [0.0781, 0.0861]}}
    base = {"verdict": "pass", "why": "within the band of FP32 retraining on every check", "note": "the note",
            "alpha": 0.05, "gate": {"fast_train": "fail", "control": "fail"},
            "checks": {"val_loss": val, "kid_vs_ref": judged(4.6e-5, 0.0012345, "within")},
            "controls": {"control": {"arm": "control", "expected": "fail", "outcome": "fail", "why": "beyond",
                                     "checks": {"kid_vs_ref": judged(0.5, 0.001, "beyond")}}},
            "weight_differences": {"x0_nrmse": {"fast_train": 0.034, "control": 0.080}}, "git_sha": verdict_sha}
    (tmp_path / "training_verdict.json").write_text(json.dumps({**base, **verdict}))
    return tmp_path


def test_the_page_holds_every_arm_the_verdict_its_bands_and_each_writer_s_commit(tmp_path):
    page = training_markdown(folder(tmp_path))
    assert "`training.json` (code `0123456789ab-dirty`), `loss_curves.json` (code `0123456789ab`)" in page
    assert "`training_verdict.json` (code `0123456789ab`)" in page
    assert ("| strict FP32 (recipe=[]), the reference | 447.0 | 997 | 2.0 (off) | 0.02 | 0.0719 | 0.08123 | "
            "`0123456789ab`, `ffffffffffff` |" in page)  # a run resumed by other code names both commits
    assert "| experiment=fast_train's stack | 31.9 | 997 | 2.0 (cold) | 0.02 | 0.0694 |  | not recorded |" in page
    assert "| strict FP32, seed + 1 |  |  |  |  |  |  | not recorded |" in page
    assert "| the control: strict FP32 with quality_training.control | 447.0 (7 runs per GPU) | 997 |" in page
    assert ("**pass**: within the band of FP32 retraining on every check. The gate alone, each model against FP32's: "
            "fast_train: fail; control: fail.") in page
    assert "| control | the control: strict FP32 with quality_training.control | fail | fail | beyond |" in page
    assert "| val_loss | 0.082 | 0.0821 ± 0.0008 | < 0.0781 or > 0.0861 | 0.0819 | -1.35 | 1 | within |" in page
    assert "| kid_vs_ref | 0.1, 0.14 | 0.12 ± 0.0283 | > 0.3 | 4.6e-05 | -4.24 | 0.0012 | within |" in page
    assert "The control's checks:" in page and "| kid_vs_ref | 0.1, 0.14 | 0.12 ± 0.0283 | > 0.3 | 0.5 |" in page
    assert "| check | fast_train | control |" in page and "| x0_nrmse | 0.034 | 0.08 |" in page
    assert page.endswith("Note: the note\n")


def test_an_inconclusive_verdict_from_code_that_kept_no_commit_renders_without_check_tables(tmp_path):
    page = training_markdown(folder(tmp_path, verdict_sha=None, verdict="inconclusive", why="no gated row for control",
                                    gate=None, checks=None, controls=None, weight_differences=None))
    assert "`training_verdict.json` (code not recorded)" in page and "**inconclusive**: no gated row for control." in page
    assert "checks" not in page.split("## Verdict")[1].split("Note:")[0] and "reported, not deciding" not in page


def test_a_folder_without_a_training_verdict_gets_no_page(tmp_path):
    assert training_markdown(tmp_path) is None and write_training_report(tmp_path) is None
    assert not (tmp_path / TRAINING_MD).exists()


def test_bench_report_writes_the_page_beside_its_tables(tmp_path):
    (folder(tmp_path) / "results.jsonl").write_text("")
    write_report(tmp_path)
    assert (tmp_path / TRAINING_MD).read_text() == training_markdown(tmp_path)




def test_a_verdict_of_older_code_without_bands_keeps_its_page_and_says_why_in_one_line(tmp_path, caplog):
    old = {"stack": {"value": 0.017, "p_value": 0.002, "status": "warn"}, "verdict": "within"}
    (folder(tmp_path, checks={"diversity_gap": old}) / TRAINING_MD).write_text("the page of its day")
    assert write_training_report(tmp_path) is None and (tmp_path / TRAINING_MD).read_text() == "the page of its day"
    assert [r.getMessage().count("\n") for r in caplog.records] == [0]
    assert "training_verdict.json: a verdict of older code" in caplog.text
