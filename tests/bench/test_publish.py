"""bench.report publish=true on the synthetic evidence run of two GPUs (tests/bench/fixtures/evidence/): the pages
per GPU, the GPUs side by side with a sentence per workload, the README table; one run per folder, never mixed;
one-line refusals for a missing headline row, an unknown or incomplete ``run=`` and a README without markers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose

from bench.core.records import read_rows
from bench.reporting.evidence import fmt_ms, fmt_x, sig
from bench.reporting.pages import from_config, publish
from med_ddpm import cli
from med_ddpm.config_checks import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[2]
H100, H200 = "20260101T000000Z-synth1", "20260102T000000Z-synth2"  # the fixture's run ids
MEMORY = "needs 37.1 GiB of GPU memory (its measured peak); Tesla V100-SXM2-16GB has 15.8 GiB"  # a 16 GiB card's reason


def folders(repo: Path) -> list[Path]:
    return [repo / "bench" / "results" / gpu for gpu in ("h100", "h200")]


def publish_all(repo: Path, wanted=()) -> list[str]:
    return publish(folders(repo), repo / "docs" / "results", repo / "README.md", "h100", wanted)


def rows(folder: Path) -> list[dict]:
    return read_rows(folder)


def write_rows(folder: Path, new: list[dict]) -> None:
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in new))


def run_report(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | {"PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "bench.report", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=180)


def test_figures_keep_their_significant_digits():
    assert [sig(10.04, 3), sig(0.98249, 3), sig(2411.3, 4), sig(0.0, 3)] == ["10.0", "0.982", "2411", "0"]
    assert [fmt_ms(20.02), fmt_ms(2411.3), fmt_ms(49903.0), fmt_ms(None)] == ["20.02 ms", "2.411 s", "49.90 s", ""]
    assert fmt_x(197.3 / 18.48) == "10.7×" and fmt_x(None) == ""


def test_every_page_comes_from_one_run_per_gpu(evidence_repo):
    lines = publish_all(evidence_repo)
    docs = evidence_repo / "docs" / "results"
    assert lines[:2] == [f"{folders(evidence_repo)[0]}: run `{H100}` at commit `111111111111`, the newest complete run",
                         f"{folders(evidence_repo)[1]}: run `{H200}` at commit `222222222222`, the newest complete run"]
    h100, h200, gpus = ((docs / f"{name}.md").read_text() for name in ("h100", "h200", "gpus"))
    readme = (evidence_repo / "README.md").read_text()
    assert f"run `{H100}` at commit `111111111111`" in readme and "[every table](docs/results/h100.md)" in readme
    assert "| `forward` | 200.4 ms, reference | 96.31 ms, not gated | 20.02 ms, not gated | 10.0× | 4.81× |  |" in readme
    assert "`e2e.sample4_cold` 63.40 s; `e2e.sample4_warm` 26.60 s |" in readme
    # The fixture's H100 ran the shipped train step as fast_train's fp16 variant (as a GPU without bf16 would).
    assert "| 112.2 ms (`fast_train_fp16`), 56.10 ms a volume, not gated |" in readme
    assert "| `train_step.shipped` (train step, batch 2) (`fast_train_fp16`) | 112.2 ms |" in h100
    # The H200's gate files are of the 64³ quality model: no 128³ cell takes their verdict, and the page says why.
    # The first such cell gives the reason; a later cell of the same reason and no file of its own says "as above".
    first = next(line for line in h200.splitlines() if line.startswith("| `forward.torch_defaults`"))
    assert first.endswith('| not gated (no 128³ gate of this stack and sampler in quality/; see docs/quality.md, '
                          '"The gate at 128³") |')
    assert "| 18.48 ms | 18.30 ms – 18.85 ms | 20 | 18.48 ms | 10.7× | 4.85× | 2.02 | not gated (as above) |" in h200
    assert "the 64³ quality model's: pass) |" in h200
    assert "| 2.500 s | 2.475 s – 2.550 s | 20 | 1.250 s | 1.00× | 0.187× | 4.50 | reference" in h200
    assert "pass (trained: within training noise, [training_verdict.json](../../bench/results/h200/quality/training/" in h200
    assert "`ddpm250.shipped` (DDPM, 250 steps, batch 1) | 4.751 s |" in h200 and "| 6.75 | not gated (as above) |" in h200
    assert "pass" not in h100.split("## Step benchmarks")[1] and "this folder has no gate files (no `quality/`)" in h100
    assert "read from the gate's files in [quality/](../../bench/results/h200/quality)" in h200
    # One plan for the 128³ quality model, on the page of the GPU the README shows.
    assert "## The 128³ quality model's plan" in h100 and "## The 128³ quality model's plan" not in h200
    assert "| `sampler25.strict_fp32` (the searched 25-call sampler) | unsupported: synthetic, no such row on this card |" in h100
    assert "| `sampler25.torch_defaults` (the searched 25-call sampler) | no row |" in h100
    # Side by side: a sentence per workload, from the numbers, and the counters under the study's claims.
    assert ("- `forward`: `strict_fp32` the same within 5 %; `torch_defaults` 1.07× as fast on the H200 as on the "
            "H100") in gpus
    assert "- `sampler25`: `shipped` 1.07× as fast on the H200 as on the H100." in gpus
    assert "the H100: 6.70× fewer SM cycles, 26.0× fewer instructions, IPC -72.1%; the H200: 6.70× fewer SM cycles, " \
           "29.4× fewer instructions" in gpus
    assert "| study (A100, TF32 + channels-last 3-D) | | up to 100x | 100x | 1.45-9.98x | +7 % |" in gpus
    assert "| `forward.shipped` | 20.02 ms | 10.0× | 4.81× | not gated | 18.48 ms | 10.7× | 4.85× | not gated |" in gpus
    assert f"H100: run `{H100}` at commit `111111111111`; H200: run `{H200}`" in gpus
    assert "The runs are of different commits: a difference between these columns may come from the code" in gpus
    for page in (*docs.iterdir(), evidence_repo / "README.md"):  # committed, they pass tests/test_docs_links.py
        for target in re.findall(r"\]\(([^)\s#]+)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name}: {target}"


def test_runs_of_one_commit_get_no_caution_about_the_code(evidence_repo):
    h100, h200 = folders(evidence_repo)
    measured = rows(h200)
    sha = rows(h100)[0]["git_sha"]
    write_rows(h200, [{**row, "git_sha": sha} for row in measured])
    publish_all(evidence_repo)
    assert "different commits" not in (evidence_repo / "docs" / "results" / "gpus.md").read_text()


def test_the_run_s_time_is_each_measurement_s_wall_once_and_their_sum(evidence_repo):
    """Rows of one process share its wall seconds: counted once; a counters row's are ncu's."""
    h100 = folders(evidence_repo)[0]
    measured = rows(h100)
    for n, row in enumerate(measured):
        key = "ncu_wall_s" if row["job_name"].startswith("counters.") else "wall_s"
        row[key] = 95.0 if row["job_name"].endswith(".strict_fp32") and key == "wall_s" else 10.0 + n
        row.update(launch="20260101T000000Z", launch_s=100.0 + n)
    write_rows(h100, measured)
    publish_all(evidence_repo)
    page = (evidence_repo / "docs" / "results" / "h100.md").read_text().split("## The run's time")[1]
    strict = [r["job_name"] for r in measured if r.get("wall_s") == 95.0]
    walls = {r.get("wall_s", r.get("ncu_wall_s")) for r in measured}
    workloads = ",".join(job.removesuffix(".strict_fp32") for job in strict)
    assert len(strict) > 1 and f"| `{{{workloads}}}.strict_fp32` | 95.0 |" in page
    assert f"| all {len(walls)} | {sum(walls):.1f} ({sum(walls) / 60:.1f} min) |" in page
    last = 100.0 + max(n for n, r in enumerate(measured) if r.get("run_id") == H100)
    assert f"the last row, its own time between jobs included): `20260101T000000Z` {last:.1f} s." in page


def test_the_real_commands_time_adds_up_phase_by_phase_beside_its_target(evidence_repo):
    """Each e2e row's split, phase by phase in the order they run, adds up to its total; each figure says whether it
    met the project's target."""
    from bench.core.e2e import sample_split, train_split

    sample = sample_split({"run_start_s": 2.0, "device_ready_s": 2.25, "checkpoint_ready_s": 2.75,
                           "recipes_ready_s": 3.5, "model_ready_s": 5.0, "warmed_up_s": 8.0,
                           "first_mask_ready_s": 8.5, "first_volume_done_s": 10.5, "sampling_done_s": 16.5,
                           "total_s": 17.0, "volume_s": [2.0, 2.0, 2.0, 2.0], "volumes": 4, "write_busy_s": 3.0,
                           "write_wait_s": 0.0})
    train = train_split({"run_start_s": 2.0, "model_built_s": 2.5, "model_ready_s": 4.0, "warmed_up_s": 6.0, "data_ready_s": 7.0,
                         "data_build_s": 6.5, "loop_start_s": 7.25, "first_step_s": 8.0, "first_step_done_s": 15.25,
                         "ms_per_step": 110.0})
    h100 = folders(evidence_repo)[0]
    measured = rows(h100)
    for row in measured:
        if row["job_name"] == "e2e.sample4_warm":
            row.update(sample, masks=4, total_s=18.0)  # 1 s of teardown after the last mark
        elif row["job_name"] == "e2e.train_first_step_warm":
            row.update(train)
    write_rows(h100, measured)
    publish_all(evidence_repo)
    page = (evidence_repo / "docs" / "results" / "h100.md").read_text().split("## The real commands")[1]
    expected = ["| interpreter, imports, Hydra | 2.00 |", "| CUDA context | 0.25 |", "| recipes built | 0.75 |",
                "| compile cache loaded, recipes applied | 1.50 |", "| warm-up call on zeros (autotuning, graph capture) | 3.00 |",
                "| waiting for the first mask | 0.50 |", "the first call too) | 2.00 |", "| the later masks | 6.00 |",
                "| the last files written, exit | 1.50 |", "| total | 18.00 |"]
    assert all(line in page for line in expected), page
    assert "| `e2e.sample4_warm` | 4 masks, warm compile cache | 18.00 s | ≤ 15.00 s: missed |" in page
    expected = ["| recipes built, network and EMA on the device | 0.50 |", "recipes applied, resumed | 1.50 |",
                "graph capture) | 2.00 |", "| waiting for the dataset built beside them | 1.00 |", "| loader started | 0.25 |",
                "graph capture too) | 8.00 |", "| to the first step | 15.25 |"]
    assert all(line in page for line in expected), page
    assert "| to the first step, warm compile cache | 15.25 s | ≤ 20.00 s: met |" in page
    side_by_side = (evidence_repo / "docs" / "results" / "gpus.md").read_text()
    assert "| `e2e.sample4_warm` (4 masks, warm compile cache; target ≤ 15.00 s) | 18.00 s, missed |" in side_by_side


def test_the_readme_s_train_step_cell_shows_the_training_verdict_with_its_band(evidence_repo):
    publish(folders(evidence_repo), evidence_repo / "docs" / "results", evidence_repo / "README.md", "h200")
    cell = "pass (val. loss 0.0616, band 0.0557 ± 0.0025)"
    train_step = next(line for line in (evidence_repo / "README.md").read_text().splitlines()
                      if line.startswith("| `train_step` |"))
    assert train_step.split(" | ")[3].endswith(cell)  # the shipped stack's cell


@pytest.mark.e2e
def test_a_missing_headline_row_is_refused_in_one_line_naming_it(evidence_repo):
    h100 = folders(evidence_repo)[0]
    write_rows(h100, [r for r in rows(h100) if r["job_name"] not in ("forward.shipped", "ddpm250.torch_defaults")])
    readme = (evidence_repo / "README.md").read_text()
    proc = run_report("publish=true", cwd=evidence_repo)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"error: bench/results/h100/results.jsonl: run {H100} (the newest run) lacks headline rows forward.shipped "
        "(no row), ddpm250.torch_defaults (no row); finish it: rerun python -m bench.ladder preset=evidence "
        "out=bench/results/h100"], proc.stderr
    assert (evidence_repo / "README.md").read_text() == readme and not (evidence_repo / "docs").exists()


@pytest.fixture
def unsupported_headline(evidence_repo) -> Path:
    """The H100 run with a headline row ``unsupported``, as a 16 GiB card writes its strict-FP32 train step: the
    reason, no time."""
    h100 = folders(evidence_repo)[0]
    write_rows(h100, [{**r, "status": "unsupported", "message": MEMORY, "ms_median": None, "ms_p10": None,
                       "ms_p90": None} if r["job_name"] == "train_step.strict_fp32" else r for r in rows(h100)])
    return evidence_repo


def test_an_unsupported_headline_row_is_shown_with_its_reason_and_divides_no_speed_up(unsupported_headline):
    """The run is complete (the GPU cannot make that row); the row's cell says unsupported, its page its reason, and
    no speed-up or comparison across GPUs uses it."""
    lines = publish_all(unsupported_headline)
    assert lines[0].endswith(f"run `{H100}` at commit `111111111111`, the newest complete run")
    readme = (unsupported_headline / "README.md").read_text()
    assert ("| `train_step` | unsupported | 502.4 ms, 251.2 ms a volume, not gated | 112.2 ms (`fast_train_fp16`), "
            "56.10 ms a volume, not gated |  | 4.48× |") in readme
    docs = unsupported_headline / "docs" / "results"
    assert f"| `train_step.strict_fp32` (train step) | unsupported: {MEMORY} |" in (docs / "h100.md").read_text()
    train_step = next(line for line in (docs / "gpus.md").read_text().splitlines() if line.startswith("- `train_step`"))
    assert "strict_fp32" not in train_step and "`torch_defaults` 1.08× as fast on the H200" in train_step


def test_a_failed_headline_row_is_named_with_its_status(evidence_repo):
    h200 = folders(evidence_repo)[1]
    write_rows(h200, [{**r, "status": "oom", "ms_median": None} if r["job_name"] == "train_step.shipped" else r
                      for r in rows(h200)])
    with pytest.raises(DataError, match=r"lacks headline rows train_step\.shipped \(oom\); finish it"):
        publish_all(evidence_repo)


def test_a_folder_of_several_runs_shows_one_and_says_which(evidence_repo):
    h200 = folders(evidence_repo)[1]
    mine = rows(h200)
    older = [{**r, "run_id": "20251231T000000Z-older", "ms_median": r.get("ms_median") and r["ms_median"] * 3}
             for r in mine]
    newer = [{**r, "run_id": "20260103T000000Z-newer"} for r in mine[:3]]  # cut after three jobs
    write_rows(h200, older + mine + newer)
    lines = publish_all(evidence_repo)
    assert lines[1] == (f"{h200}: run `{H200}` at commit `222222222222`, the newest complete run; not shown: the "
                        "folder's other runs 20251231T000000Z-older, 20260103T000000Z-newer")
    page = (evidence_repo / "docs" / "results" / "h200.md").read_text()
    assert "| 197.3 ms |" in page and fmt_ms(197.3 * 3) not in page  # the older run's forward is on no table

    publish_all(evidence_repo, ["20251231T000000Z-older"])
    page = (evidence_repo / "docs" / "results" / "h200.md").read_text()
    assert "run `20251231T000000Z-older` at commit `222222222222`, named by run=" in page and f"| {fmt_ms(197.3 * 3)} |" in page
    gpus = (evidence_repo / "docs" / "results" / "gpus.md").read_text().splitlines()
    assert any(line.startswith("| `forward.strict_fp32` |") and f"| {fmt_ms(197.3 * 3)} |" in line for line in gpus)

    with pytest.raises(DataError, match=r"run 20260103T000000Z-newer \(named by run=\) lacks headline rows "
                                        r"train_step\.strict_fp32 \(no row\), .*; finish it: .*, or pass run= one of the "
                                        rf"complete runs 20251231T000000Z-older, {H200}$"):
        publish_all(evidence_repo, ["20260103T000000Z-newer"])
    with pytest.raises(ConfigError, match=r"^run=nope: no evidence run of that id in .*h100, .*h200; pass a run id"):
        publish_all(evidence_repo, ["nope"])


def test_a_readme_without_markers_is_refused_and_nothing_is_written(evidence_repo):
    (evidence_repo / "README.md").write_text("# project\n")
    with pytest.raises(DataError, match=r"README\.md: needs one <!-- results:begin --> line, then one "):
        publish_all(evidence_repo)
    assert not (evidence_repo / "docs").exists()


def test_dir_publishes_that_gpu_page_alone(evidence_repo):
    """``dir=FOLDER publish=true``, composed from configs/report.yaml as the command composes it."""
    with cli.configs():
        cfg = compose("report", overrides=[f"dir={evidence_repo}/bench/results/h200", "publish=true",
                                           f"docs={evidence_repo}/docs/results"])
    assert from_config(cfg) == [f"{evidence_repo}/bench/results/h200: run `{H200}` at commit `222222222222`, the "
                                f"newest complete run", f"wrote {evidence_repo}/docs/results/h200.md"]
    assert sorted(p.name for p in (evidence_repo / "docs" / "results").iterdir()) == ["h200.md"]


def test_one_gpu_folder_gets_no_side_by_side_tables_but_its_page(evidence_repo):
    publish(folders(evidence_repo)[:1], evidence_repo / "docs" / "results", evidence_repo / "README.md", "h100")
    gpus = (evidence_repo / "docs" / "results" / "gpus.md").read_text()
    assert "Only the H100 has an evidence run among the GPU folders (`gpus`): its tables are on [its page](h100.md)." in gpus
    assert "## `forward`" not in gpus and "Counters, `counters.tf32_channels_last_3d` against strict FP32" in gpus
