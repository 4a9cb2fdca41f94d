"""bench.core.row_lines: a row stored whole or as its difference from an earlier row reads back as the same row;
bench.compact rewrites a file line for line; the committed results files are compact and small."""

import json
import math
from pathlib import Path

import pytest

from bench import compact
from bench.core import records
from bench.core.records import append_row, read_results, read_rows
from bench.core.row_lines import LIKE, SET, UNSET, compacted, difference, digest, line_for, restore, same
from med_ddpm.config_checks import DataError

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
SIZE_LIMIT = 500_000  # bytes of one committed rows file: a new run adds tens of KB, not a row's config each
CONFIG = {"bench": {"iters": 20, "scenario": "denoise_step", "checkpoint": None}, "model": {"channels": [1, 2, 4]},
          "a/b~c": {"x": 1}, "seed": 0}


def row(job: str, ms: float, run: str = "run-1", **extra) -> dict:
    return {"run_id": run, "git_sha": "0" * 40, "dirty": False, "job_name": job, "status": "ok", "message": "",
            "recipes": job.split("+") if job != "strict" else [], "ms_median": ms, "config": CONFIG,
            "describe": {"order": job.split("+"), "flags": {"tf32": False}}, "env": {"gpu": "H100", "torch": "2.11"},
            **extra}


ROWS = [
    row("strict", 50.0),
    row("tf32", 20.0, describe={"order": ["tf32"], "flags": {"tf32": True}}),
    row("amp_bf16", float("nan"), config={**CONFIG, "bench": {**CONFIG["bench"], "checkpoint": "w.pt"}}),
    row("strict", 1.0, config={**CONFIG, "seed": 1.0}, describe=None),  # 1.0 is not 1; a dict becomes null
    row("strict", 1.0, config={**CONFIG, "seed": True, "a/b~c": {}}, quality={"n": 8}),  # a key gone, one new
    row("tf32", 20.0, run="run-2", env={"gpu": "H100", "torch": "2.12"}, extra=[1, {"x": None}]),
]


@pytest.fixture
def stored(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "provenance", lambda: {})
    path = tmp_path / "results.jsonl"
    written = [append_row(path, r) for r in ROWS]
    return path, written


def text(rows: list[dict]) -> list[str]:
    return [json.dumps(r) for r in rows]  # key order too; NaN compares as text


def test_rows_read_back_as_written_and_most_lines_are_differences(stored):
    path, written = stored
    assert text(read_rows(path)) == text(written) == text(json.loads(json.dumps(r, sort_keys=True)) for r in ROWS)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert LIKE not in lines[0] and all(LIKE in line for line in lines[1:])
    assert [line.get(SET, line).get("/run_id", line.get("run_id")) for line in lines] == [r["run_id"] for r in ROWS]
    assert lines[4][UNSET] == ["/config/a~1b~0c/x"] and lines[4][SET]["/config/seed"] is True
    assert len(path.read_bytes()) < 0.6 * sum(len(json.dumps(r)) for r in ROWS)


def test_a_difference_is_the_smallest_that_rebuilds_the_row():
    put, gone = difference(ROWS[0], ROWS[3])
    assert put == {"/config/seed": 1.0, "/describe": None, "/ms_median": 1.0} and gone == []
    assert not same(1, 1.0) and not same(1, True) and same(float("nan"), float("nan")) and same([{"a": 1}], [{"a": 1}])
    whole = {"run_id": "r", "other": list(range(50))}
    assert line_for(whole, [ROWS[0]]) == json.dumps(whole, sort_keys=True), "a difference longer than the row"
    rebuilt = restore(json.loads(line_for(ROWS[1], ROWS)), {digest(r): r for r in ROWS})
    assert text([rebuilt]) == text([json.loads(json.dumps(ROWS[1], sort_keys=True))])
    assert math.isnan(restore(json.loads(line_for(ROWS[2], ROWS[:2])), {digest(r): r for r in ROWS})["ms_median"])


def test_a_line_like_a_row_no_line_above_holds_is_refused_naming_it(stored):
    path, _ = stored
    path.write_text("\n".join(path.read_text().splitlines()[1:]) + "\n")  # the first row removed: line 2's base
    with pytest.raises(DataError, match=r"results\.jsonl:1: stored as a difference from row [0-9a-f]{16}, which no "
                                        r"line above it holds"):
        read_rows(path)


def test_a_pointer_into_nothing_is_refused(stored):
    path, _ = stored
    lines = path.read_text().splitlines()
    bad = json.loads(lines[1])
    bad[SET]["/nothing/here"] = 1
    path.write_text("\n".join([lines[0], json.dumps(bad)]) + "\n")
    with pytest.raises(DataError, match=r"results\.jsonl:2: pointer '/nothing/here' is not in the row it is like"):
        read_rows(path)


def test_a_file_that_does_not_read_gets_the_row_whole(stored):
    path, written = stored
    with open(path, "a") as f:
        f.write("# a note\n")
    appended = append_row(path, ROWS[1])
    assert json.loads(path.read_text().splitlines()[-1]) == appended
    with pytest.raises(DataError, match=r"results\.jsonl:7: not a results row"):
        read_rows(path)


def test_a_line_cut_short_keeps_its_number_and_the_rows_after_it_read(stored):
    path, written = stored
    with open(path, "a") as f:
        f.write(json.dumps(ROWS[0])[:60])  # a writer killed mid-line
    written.append(append_row(path, ROWS[5]))
    rows, cut = read_results(path)
    assert text(rows) == text(written) and cut == ["results.jsonl:7"]


def test_compact_rewrites_whole_rows_line_for_line(stored):
    path, written = stored
    whole = [json.dumps(r, sort_keys=True) for r in written]
    path.write_text("\n".join([whole[0], "", *whole[1:3], json.dumps(ROWS[0])[:50], *whole[3:]]) + "\n")
    before = read_results(path)
    assert compact.main([str(path)]) == 0
    after = read_results(path)
    assert text(after[0]) == text(before[0]) == text(written) and after[1] == before[1] == ["results.jsonl:5"]
    assert path.read_text().splitlines()[1] == "" and compacted(path) == path.read_text()
    assert len(path.read_bytes()) < len("\n".join(whole))


COMMITTED = sorted(p for name in ("results.jsonl", "counters.jsonl") for p in RESULTS.rglob(name))


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(RESULTS)))
def test_a_committed_rows_file_is_compact_and_small(path: Path):
    assert len(path.read_bytes()) <= SIZE_LIMIT, f"{path}: over {SIZE_LIMIT} bytes"
    assert compacted(path) == path.read_text(), f"{path}: some rows are not in their shortest line: " \
                                                f"python -m bench.compact {path.relative_to(ROOT)}"
