"""bench.report on fixture rows: speed-ups vs the same run's baseline, missing baseline, failed rows,
runs mixed in one file, rows of unknown provenance; bench.core.records' run id and provenance stamp."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from bench import report
from bench.core import records, row_lines
from bench.core.records import append_row, missing_baselines, read_rows

SHA = "0123456789abcdef0123456789abcdef01234567"
ROOT = Path(__file__).resolve().parents[2]


def row(recipes, ms, status="ok", batch=1, scenario="train_step", mem=10.0, quality=None, message="", run="run-1"):
    return {"run_id": run, "git_sha": SHA, "dirty": False, "scenario": scenario, "model": "medddpm_whole_head", "image_size": [128, 128, 128],
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
    assert by[(1, "amp_bf16")]["verdict"] == "warn" and by[(1, "[] (fp32)")]["verdict"] is None
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


def test_strict_fp32_rows_alone_get_no_speedup_plots(tmp_path):
    """Two trained models gated against each other are two strict-FP32 rows: a ratio of their times is no
    recipe's speed-up, so neither speed-up plot is drawn or linked."""
    gate = {"verdict": "fail", "metrics": {"x0_nrmse": 3e-2}}
    for ms in (35.7, 35.72):
        append_row(tmp_path / "results.jsonl", row([], ms, scenario="denoise_step", quality=gate))
    md = report.write_report(tmp_path).read_text()
    assert not list(tmp_path.glob("speedup*.png")) and "![speedup" not in md
    assert [r["baseline"] for r in report.report_rows(read_rows(tmp_path))] == [True, True]


def test_torn_line_and_missing_baselines(sweep):
    with open(sweep / "results.jsonl", "a") as f:
        f.write('{"scenario": "train_st')  # a writer killed mid-line
    with pytest.warns(RuntimeWarning, match=r"skipping results\.jsonl:8, cut short \(a run killed while writing it\)"):
        rows = read_rows(sweep)
    assert len(rows) == len(ROWS)
    need = missing_baselines(rows, "run-1")
    assert [r["batch_size"] for r in need] == [2]
    assert missing_baselines(rows, "run-2") == []  # another run's rows are not this run's to complete


def test_bad_status_refused(tmp_path):
    """A row with an unknown status is refused before anything is written: no file, or the file as it was."""
    with pytest.raises(ValueError, match="status"):
        append_row(tmp_path / "r.jsonl", {**row([], 1.0), "status": "great"})
    assert not (tmp_path / "r.jsonl").exists()
    append_row(tmp_path / "r.jsonl", row([], 1.0))
    before = (tmp_path / "r.jsonl").read_bytes()
    with pytest.raises(ValueError, match="status"):
        append_row(tmp_path / "r.jsonl", {**row([], 1.0), "status": "great"})
    assert (tmp_path / "r.jsonl").read_bytes() == before


def test_rows_merged_from_several_runs_keep_their_commit():
    """Rows appended by later device runs must not be labelled with the first row's commit."""
    a, b = row([], 100.0), row(["compile"], 30.0, run="run-2")
    a["git_sha"], b["git_sha"], b["dirty"] = "ac09301" + "0" * 33, "55861c0" + "0" * 33, True
    a["env"] = {"gpu": "NVIDIA H200", "git_sha": "ac09301"}
    b["env"] = {"gpu": "NVIDIA H200", "git_sha": "55861c0"}
    table = report.report_rows([a, b])
    assert [r["code"] for r in table] == ["ac0930100000", "55861c000000-dirty"]
    assert "git_sha ac09301 / 55861c0" in report.env_summary([a, b])
    assert "gpu NVIDIA H200," in report.env_summary([a, b])
    assert "| 55861c000000-dirty | run-2 |" in report.to_markdown(table, [a, b])


def test_each_row_is_compared_with_the_baseline_of_its_own_run():
    """A reused sweep directory: run 2's rows against run 2's baseline, never run 1's (issue 29's 2.3x vs 1.84x)."""
    rows = [row([], 230.0), row(["amp_bf16"], 100.0), row([], 184.0, run="run-2"), row(["amp_bf16"], 100.0, run="run-2")]
    table = report.report_rows(rows)
    assert [r["speedup"] for r in table] == pytest.approx([1.0, 2.3, 1.0, 1.84])
    assert [r["headline"] for r in table] == [False, False, True, True]  # the latest row of each stack
    md = report.to_markdown(table, rows)
    assert "| amp_bf16 | ok | 100 | 90 | 110 | 1 | 1.84 |" in md and "| 2.3 |" not in md


def test_a_run_without_its_own_baseline_gets_no_speedup():
    rows = [row([], 200.0), row(["tf32"], 100.0, run="run-2")]
    (base, tf32) = report.report_rows(rows)
    assert base["speedup"] == pytest.approx(1.0) and tf32["speedup"] is None and not tf32["has_baseline"]


def test_rows_of_unknown_provenance_stay_out_of_the_headline():
    """Rows without a run id (written before run ids) or a commit are listed apart, numbers unchanged, no ratio."""
    legacy = [{k: v for k, v in r.items() if k not in ("run_id", "git_sha", "dirty")} for r in ROWS[:2]]
    legacy[0]["env"] = {"git_sha": "unknown"}
    copied = row(["amp_bf16"], 50.0, run="run-3") | {"git_sha": "unknown", "dirty": None}
    rows = [*legacy, copied, row([], 400.0, run="run-4")]
    table = report.report_rows(rows)
    assert [r["headline"] for r in table] == [False, False, False, True]
    assert [r["run_id"] for r in table][:2] == [report.LEGACY_RUN] * 2
    assert table[1]["speedup"] is None and table[1]["ms_median"] == 200.0
    md = report.to_markdown(table, rows)
    head, _, apart = md.partition("## Rows of unknown provenance")
    assert "| [] (fp32) | ok | 400 |" in head and "| tf32 |" not in head and "| amp_bf16 |" not in head
    assert "| tf32 | ok | 200 |" in apart and "| amp_bf16 | ok | 50 |" in apart and "legacy (no run id)" in apart


def test_append_row_stamps_run_id_and_provenance(tmp_path, monkeypatch):
    monkeypatch.setenv(records.RUN_ID_ENV, "run-x")
    append_row(tmp_path / "r.jsonl", {k: v for k, v in row([], 1.0).items() if k not in ("run_id", "git_sha", "dirty")})
    (written,) = read_rows(tmp_path / "r.jsonl")
    assert written["run_id"] == "run-x" and written["git_sha"] == records.provenance()["git_sha"]
    assert len(written["git_sha"]) == 40 and isinstance(written["dirty"], bool)  # the test runs in a checkout
    first = records.new_run()
    assert records.run_id() == first != "run-x" and records.new_run() != first


@pytest.mark.e2e
def test_commands_started_inside_a_run_keep_its_id(tmp_path, monkeypatch):
    """A shell script of several commands (one device call) exports one id: each command's launch keeps it, where a
    command started without one gets its own."""
    clean = {k: v for k, v in os.environ.items() if k != records.RUN_ID_ENV}
    subprocess.run([sys.executable, "-m", "bench.counters", "experiment=bench_smoke", f"counters.out={tmp_path}"],
                   cwd=records.ROOT, env={**clean, records.RUN_ID_ENV: "call-1"}, check=True, capture_output=True)
    assert read_rows(tmp_path / "counters.jsonl")[0]["run_id"] == "call-1"  # its launch's new_run() kept it

    def launch(inherited: str | None) -> str:  # a process that read ``inherited`` from its environment at start
        monkeypatch.setattr(records, "INHERITED_RUN_ID", inherited)
        monkeypatch.delenv(records.RUN_ID_ENV, raising=False)  # restored after the test
        records.new_run()
        return records.new_run()

    assert launch("call-1") == "call-1" and launch(None) != launch(None)


def test_stamp_gives_provenance_without_git_and_sees_later_edits(tmp_path, monkeypatch):
    """The tree copied to a machine without .git reads its commit from the stamp; an edit since marks it dirty."""
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(records, "ROOT", tree)
    stamp = {"git_sha": SHA, "dirty": False, "files": ["pkg/a.py"], "digest": records.tree_digest(["pkg/a.py"])}
    (tree / ".provenance.json").write_text(json.dumps(stamp))
    assert records.stamp_provenance(tree / ".provenance.json") == {"git_sha": SHA, "dirty": False}
    (tree / "pkg" / "a.py").write_text("x = 2\n")
    assert records.stamp_provenance(tree / ".provenance.json") == {"git_sha": SHA, "dirty": True}
    assert records.stamp_provenance(tree / "absent.json") is None


def test_write_stamp_records_head(tmp_path):
    stamp = records.write_stamp(tmp_path / "stamp.json")
    assert stamp["git_sha"] == records.git_provenance()["git_sha"] and "bench/core/records.py" in stamp["files"]
    assert json.loads((tmp_path / "stamp.json").read_text())["digest"] == records.tree_digest(stamp["files"])


def test_hydras_run_records_are_not_code():
    """The docs' commands write output_dir=samples, eval, ... at the checkout's root, each with a .hydra/ of YAML:
    a run record, ignored by git, so it neither makes the next row dirty nor enters the stamp."""
    if not (records.ROOT / ".git").exists():
        pytest.skip("a copy of the tree without .git")
    ignored = subprocess.run(["git", "check-ignore", "-q", "samples/.hydra/2026-12-05_00-00-00/config.yaml"],
                             cwd=records.ROOT)
    assert ignored.returncode == 0


def test_an_unchanged_stamp_outranks_a_stale_git_head(tmp_path, monkeypatch):
    """A copied tree whose .git HEAD is older than its code reads the stamp; once a stamped file is edited,
    git (the checkout's own HEAD, dirty) answers."""
    tree = tmp_path / "tree"
    (tree / ".git").mkdir(parents=True)
    (tree / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(records, "ROOT", tree)
    monkeypatch.setattr(records, "STAMP_FILE", tree / ".provenance.json")
    monkeypatch.setattr(records, "git_provenance", lambda: {"git_sha": "old", "dirty": True})
    stamp = {"git_sha": SHA, "dirty": False, "files": ["a.py"], "digest": records.tree_digest(["a.py"])}
    (tree / ".provenance.json").write_text(json.dumps(stamp))
    assert records.provenance() == {"git_sha": SHA, "dirty": False}
    (tree / "a.py").write_text("x = 2\n")
    assert records.provenance() == {"git_sha": "old", "dirty": True}


def test_quality_md_lists_every_check_of_the_latest_gated_row(tmp_path):
    """The verdict reads back to the check that decided it: value, p-value, null quantiles or limits."""
    checks = {"eps_scale_bias": {"kind": "bias", "status": "fail", "value": 0.05, "p_value": 0.005,
                                 "pass_limit": 0.005, "fail_limit": 0.015},
              "kid_vs_ref": {"kind": "distribution", "status": "pass", "value": -1e-5, "p_value": 0.55,
                             "null_quantiles": {"q05": -8e-6, "q50": -4e-6, "q95": 2e-5}}}
    gated = {"verdict": "fail", "checks": checks, "n_samples": 32, "n_masks": 8, "min_detectable_eps_bias": 0.015,
             "min_detectable_eps_noise": 0.045, "candidate_sampler": {"name": "probes only", "steps": None}}
    older = {**gated, "verdict": "pass", "checks": {"eps_noise": {"kind": "limit", "status": "pass", "value": 0}}}
    for quality in (older, gated):
        append_row(tmp_path / "results.jsonl", row(["eps_scale"], 35.0, quality=quality))
    append_row(tmp_path / "results.jsonl", row([], 35.0))
    report.write_report(tmp_path)
    md = (tmp_path / "quality.md").read_text()
    assert md.count("## ") == 1 and "probes only: **fail**" in md and "eps_noise" not in md
    assert "| eps_scale_bias | bias | fail | 0.05 | 0.005 |  | 0.005 / 0.015 |" in md
    assert "| kid_vs_ref | distribution | pass | -1e-05 | 0.55 | -8e-06 / -4e-06 / 2e-05 |  |" in md
    assert "smallest eps bias failed 0.015, smallest eps noise failed 0.045" in md


def test_the_smallest_eps_failed_says_only_what_the_row_holds():
    assert report.smallest_failed({"min_detectable_eps_bias": 0.015}) == "smallest eps bias failed 0.015; "
    assert report.smallest_failed({}) == ""


def test_no_quality_md_without_a_gated_row(sweep):
    report.write_report(sweep)
    assert not (sweep / "quality.md").exists()


def report_command(sweep):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return report.main(compose("report", overrides=[f"dir={sweep}"]))


def test_a_row_cut_short_is_named_on_stderr_and_the_complete_rows_are_reported(sweep, capsys):
    """A killed run's last line, then the same line in the middle once a resumed run appended after it: one warning
    line naming file:line, the report of every complete row, and the line named in report.md."""
    with open(sweep / "results.jsonl", "a") as f:
        f.write(json.dumps(row(["amp_bf16"], 90.0, batch=4))[:70])  # a writer killed mid-line
    report_command(sweep)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"warning: {sweep}/results.jsonl:8: cut short (a run killed while writing it), left out; the "
                   "report holds the 7 complete rows"]
    md = (sweep / "report.md").read_text()
    assert "**1 line(s) of results.jsonl cut short** (a run killed while writing a row)" in md
    assert "- `results.jsonl:8`" in md and "| tf32 | ok | 300 |" in md and "| amp_bf16 | ok | 90" not in md
    assert len((sweep / "report.csv").read_text().splitlines()) == len(ROWS) + 1

    append_row(sweep / "results.jsonl", row(["amp_bf16"], 90.0, batch=4))  # the resumed run's row
    report_command(sweep)
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {sweep}/results.jsonl:8: cut short (a run killed while writing it), left out; the report holds "
        "the 8 complete rows"]
    assert "| amp_bf16 | ok | 90" in (sweep / "report.md").read_text()


def test_a_corrupt_line_is_refused_in_one_line_naming_it(sweep, capsys):
    lines = (sweep / "results.jsonl").read_text().splitlines()
    lines[2] = "#" + lines[2][1:]  # a corrupt byte in the amp_bf16 row
    (sweep / "results.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit) as exit_:
        report_command(sweep)
    assert exit_.value.code == 2 and capsys.readouterr().err.splitlines() == [
        f"error: {sweep}/results.jsonl:3: not a results row (Expecting value: line 1 column 1 (char 0)); each line "
        "is one JSON row: repair or remove line 3"]
    assert not (sweep / "report.md").exists()


def test_every_cut_of_a_row_is_told_from_a_corrupt_line():
    line = json.dumps({**row(["tf32"], 1.5), "dirty": True, "extra": [None, -2.5e-3, "a \\ \"b\""]})
    for end in range(1, len(line)):
        with pytest.raises(ValueError) as err:
            json.loads(line[:end])
        assert row_lines.cut_short(err.value), line[:end]
    for corrupt in ("#" + line[1:], line + "x", line.replace(":", ";", 1), "nul" + line):
        with pytest.raises(ValueError) as err:
            json.loads(corrupt)
        assert not row_lines.cut_short(err.value), corrupt


def test_no_note_when_every_line_reads(sweep):
    assert "cut short" not in report.write_report(sweep).read_text()


def gated(verdict, n=None, checkpoint=None):
    quality = {"verdict": verdict, **({"n_samples": n} if n else {})}
    return {**row(["tf32"], 100.0, quality=quality), "config": {"bench": {"timeout_s": 10, "checkpoint": checkpoint}}}


def test_the_quality_cell_says_not_gated_the_gates_n_and_random_weights():
    """A bare ``pass`` on a seeded random net at N=8 must not read like a trained model's verdict at N=32."""
    rows = [row([], 100.0), gated("pass", 8), gated("fail", 32, "runs/q/last.pt"), gated("error")]
    assert [r["quality"] for r in report.report_rows(rows)] == [
        "not gated", "pass (N=8, random weights)", "fail (N=32)", "error (random weights)"]
    assert [r["verdict"] for r in report.report_rows(rows)] == [None, "pass", "fail", "error"]
    assert "| pass (N=8, random weights) | 0123456789ab |" in report.to_markdown(report.report_rows(rows[:2]), rows[:2])


def ddp_row(world, recipes, ms, efficiency):
    return row(recipes, ms, scenario="ddp_train_step") | {"world_size": world, "grad_accum": 2,
                                                           "scaling_efficiency": efficiency}


def test_ddp_worlds_get_their_own_headings_and_scaling_efficiency():
    rows = [ddp_row(1, [], 400.0, 1.0), ddp_row(1, ["amp_bf16"], 100.0, 1.0), ddp_row(2, [], 440.0, 0.909)]
    md = report.to_markdown(report.report_rows(rows), rows)
    one, two = "## ddp_train_step · medddpm_whole_head · batch 1 · grad accum 2 · world 1", "world 2"
    assert md.count(one) == 1 and md.count(two) == 1 and md.index(one) < md.index(two)
    assert "| volumes_per_s | scaling_efficiency | tflops |" in md
    assert "| [] (fp32) | ok | 440 | 396 | 484 | 1 | 1 | 10 | 1 | 2.27 | 0.909 | 1 |" in md
    assert "scaling_efficiency" not in report.to_markdown(report.report_rows(ROWS), ROWS)  # no DDP row: no column
    assert "grad accum" not in report.to_markdown(report.report_rows(ROWS), ROWS) and "world" not in report.workload_title(ROWS[0])


def run_report(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | {"PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "bench.report", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=180)


@pytest.mark.e2e
@pytest.mark.parametrize("arg, line", [
    (None, "error: dir: has no value; pass dir=<a sweep folder holding results.jsonl>"),
    ("results.jsonl", "error: dir={d}/results.jsonl: is a file, not a folder; pass dir=<a sweep folder holding "
                      "results.jsonl>"),
    ("absent", "error: {d}/absent: no results file (results.jsonl); pass the folder a sweep or ladder wrote"),
], ids=["unset", "a-file", "absent"])
def test_a_bad_dir_is_one_line_and_creates_nothing(arg, line, sweep):
    """Hydra's run dir is not dir=: an unset dir is no traceback, a file no FileExistsError, and an absent folder
    is not created (with a report.log in it) only to be refused."""
    before = sorted(sweep.rglob("*"))
    proc = run_report(*([f"dir={sweep / arg}"] if arg else []), cwd=sweep)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [line.format(d=sweep)], proc.stderr
    assert sorted(sweep.rglob("*")) == before


def test_a_folder_of_end_to_end_rows_gets_their_page_not_empty_step_tables(tmp_path):
    """bench.report on a preset=e2e folder: the rows have no step times, so report.md points to e2e.md, which it
    writes from the same rows as bench.core.e2e does; a folder of both keeps the step tables too."""
    e2e = {**row(["amp_fp16"], None), "scenario": "e2e_sample", "e2e": "scenario=e2e_sample masks=4 compile_cache=warm",
           "total_s": 46.9, "compile_cache": "warm"}
    append_row(tmp_path / "results.jsonl", e2e)
    md = report.write_report(tmp_path).read_text()
    assert "every row is in [e2e.md](e2e.md)" in md and "| recipes |" not in md
    page = (tmp_path / "e2e.md").read_text()
    line = page.splitlines()[2]
    assert line.startswith(f"| `scenario=e2e_sample masks=4 compile_cache=warm` | {e2e['git_sha'][:12]} | warm |")
    assert "| 46.9 |" in line
    for r in ROWS[:2]:
        append_row(tmp_path / "results.jsonl", r)
    md = report.write_report(tmp_path).read_text()
    assert "| tf32 | ok | 200 |" in md and "e2e_sample" not in md
