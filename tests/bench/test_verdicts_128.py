"""Every 128^3 cell's verdict comes from a gate at 128^3: pass / warn / fail with the worst p-value and the smallest
detectable bias; no such gate: `not gated`, and why (another size's verdict is named, never shown as the cell's).
The training cell's pass says the difference it fails and what more seeds would buy, from the run's records."""

import json
from pathlib import Path

import pytest

from bench.quality import training_power
from bench.quality.training_verdict import ALPHA, VAL_SHARE, check
from bench.reporting.evidence import choose_run, fmt_ms
from bench.reporting.pages import publish
from bench.reporting.verdicts import Gates, trained_detail

ROOT = Path(__file__).resolve().parents[2]


def gate_row(timed: dict, verdict: str, reference: dict, size=(128, 128, 128), p=0.004, run="20270101T000000Z-g") -> dict:
    """A gate's row judging the ``timed`` row's workload at ``size``: its identity, and a report."""
    identity = {k: timed[k] for k in ("scenario", "sampler", "steps", "recipes", "recipe_options")}
    candidate = {"name": "DPMSolverPPSampler", "steps": 100, "calls": 100}
    return {**identity, "image_size": list(size), "status": "ok", "run_id": run, "job_name": "g",
            "config": {"bench": {"checkpoint": "last.pt"}, "model": {"image_size": list(size)}},
            "quality": {"verdict": verdict, "n_samples": 32, "min_detectable_eps_bias": 0.015,
                        "reference_sampler": reference, "candidate_sampler": candidate,
                        "checks": {"kid_vs_ref": {"kind": "distribution", "p_value": p, "status": verdict},
                                   "mmd_vs_ref": {"kind": "distribution", "p_value": 0.5, "status": "pass"},
                                   "eps_scale_bias": {"kind": "bias", "p_value": 0.001, "status": "pass"}}}}


SAME = {"name": "DPMSolverPPSampler", "steps": 100, "calls": 100}
DDPM = {"name": "DDPMSampler", "steps": 250, "calls": 250}


@pytest.fixture(scope="module")
def timed():
    return choose_run(ROOT / "bench" / "results" / "h100", [])


def test_a_128_gate_gives_its_cell_the_verdict_worst_p_and_detectable_bias(timed, tmp_path):
    row = timed.ok("fast_sampler.shipped")
    where = tmp_path / "results.jsonl"
    stack, sampler = gate_row(row, "pass", SAME, p=0.17), gate_row(row, "warn", DDPM, p=0.004)
    found = Gates([(stack, where), (sampler, where)], []).verdict(row)
    assert found.word == "warn" and found.source == where
    assert found.detail.startswith("p 0.004, bias 0.015")
    assert "vs strict FP32, same sampler: pass (p 0.17, bias 0.015)" in found.detail
    assert "vs strict-FP32 DDPM-250: warn (p 0.004, bias 0.015)" in found.detail and "N=32" in found.detail
    one = Gates([(stack, where)], []).verdict(row)
    assert (one.word, one.detail.split(", N=")[0]) == ("pass", "p 0.17, bias 0.015")


def test_without_a_128_gate_the_cell_is_not_gated_and_says_why(timed, tmp_path):
    row = timed.ok("fast_sampler.shipped")
    found = Gates([], []).verdict(row)
    assert found.word == "not gated" and "no 128³ gate of this stack and sampler" in found.detail
    assert 'docs/quality.md, "The gate at 128³"' in found.detail
    small = Gates([(gate_row(row, "pass", DDPM, size=(64, 64, 64)), tmp_path / "r.jsonl")], []).verdict(row)
    assert small.word == "not gated" and small.detail.endswith("the 64³ quality model's: pass")
    other = Gates([(gate_row({**row, "recipes": ["amp_bf16"]}, "pass", DDPM), tmp_path / "r.jsonl")], []).verdict(row)
    assert other.word == "not gated", "another stack's gate is not this cell's"


def test_the_published_pages_read_128_gate_rows_from_the_quality_folder(tmp_path):
    folder = tmp_path / "bench" / "results" / "h100"
    (folder / "quality" / "gates_128").mkdir(parents=True)
    (folder / "results.jsonl").write_bytes((ROOT / "bench" / "results" / "h100" / "results.jsonl").read_bytes())
    readme = tmp_path / "README.md"
    readme.write_text("# p\n\n<!-- results:begin -->\n<!-- results:end -->\n")
    row = choose_run(folder, []).ok("fast_sampler.shipped")
    (folder / "quality" / "gates_128" / "results.jsonl").write_text(json.dumps(gate_row(row, "fail", DDPM)) + "\n")
    publish([folder], tmp_path / "docs" / "results", readme, "h100")
    page = (tmp_path / "docs" / "results" / "h100.md").read_text()
    cell = next(line for line in page.splitlines() if line.startswith("| `fast_sampler.shipped`"))
    assert "| fail (p 0.004, bias 0.015, N=32, gate run 20270101T000000Z-g, [results.jsonl]" in cell
    forward = next(line for line in page.splitlines() if line.startswith("| `forward.shipped`"))
    assert "| fail (as `fast_sampler.shipped`, p 0.004" in forward
    assert f"| {fmt_ms(row['ms_median'])}, fail |" in readme.read_text()
    ddpm = next(line for line in page.splitlines() if line.startswith("| `ddpm250.shipped`"))
    assert "not gated (as above)" in ddpm  # the reason stands in the first not-gated cell
    first = next(line for line in page.splitlines() if "| not gated (" in line and "as above" not in line)
    assert "not gated (no 128³ gate" in first


def test_the_edge_is_the_verdicts_own_fail_edge_and_more_draws_narrow_it():
    draws = {"a": 0.0575, "b": 0.0575, "c": 0.0520, "d": 0.0544, "e": 0.0572}
    band = check(0.0616, draws, ALPHA * VAL_SHARE, two_sided=True)["band"]
    edge = training_power.edge_pct(band["mean"], band["sd"], band["k"])
    assert edge == pytest.approx(100 * (band["fail_edge"][1] - band["mean"]) / band["mean"])
    k = training_power.draws_for(band["mean"], band["sd"], edge - 1)
    assert k > band["k"] and training_power.edge_pct(band["mean"], band["sd"], k) < edge - 1
    assert training_power.edge_pct(band["mean"], band["sd"], k - 1) >= edge - 1
    assert training_power.draws_for(band["mean"], band["sd"] * 10, 10.0) is None  # no seeds suffice


def test_the_h100_training_cell_states_its_power_from_the_committed_records():
    folder = ROOT / "bench" / "results" / "h100" / "quality" / "training"
    verdict = json.loads((folder / "training_verdict.json").read_text())
    power = training_power.val_loss_power(verdict, folder)
    assert power["difference_pct"] == pytest.approx(10.46, abs=0.01) and power["edge_pct"] == pytest.approx(14.68, abs=0.01)
    per_seed = training_power.seconds_per_seed(folder)
    assert power["seconds"] == pytest.approx((power["draws"] - power["k"]) * per_seed)
    assert power["within_budget"] == (power["seconds"] <= 600)
    detail = trained_detail(verdict, folder)
    assert detail.startswith("trained: within the band") and "val. loss +10.5 %, fails beyond ±14.7 % (5 draws)" in detail
    assert f"under 10 %: {power['draws']} draws" in detail
    assert "val. loss" not in trained_detail({**verdict, "verdict": "fail"}, folder), "the power of a pass only"
