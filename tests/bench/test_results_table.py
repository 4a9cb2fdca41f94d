"""README.md's results table: every number in it is a figure of the committed rows of the run it names.

The check reads the table as a reader would, without the generator's code: the line above the table names the run
(``run `ID```), its commit and its rows (``[rows](bench/results/<gpu>/results.jsonl)``); a column named after a
stack holds that stack's time (``<workload>.<stack>``'s ``ms_median``, or that per volume), a ``vs <baseline>``
column the shipped stack's speed-up over that baseline (two times of the run divided), and the real-command column
each named end-to-end job's figure. A number is a figure when it rounds to the row's value at the digits shown.

The README's table is checked, and a README whose table is gone fails; the synthetic fixture run
(tests/bench/fixtures/evidence/) is published into a temporary README to show that the check passes a generated table
and fails one with a number changed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.core.records import read_rows
from bench.reporting.pages import BEGIN, END, publish

ROOT = Path(__file__).resolve().parents[2]
README_LIMIT = 8000  # bytes: the README stays a page of usage, the tables live in docs/results/
FIGURE = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|×)")
SCALE = {"ms": 1.0, "s": 1000.0, "×": 1.0}  # to the rows' unit: ms, or a plain ratio


def block(text: str) -> str:
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "README.md needs its results markers, once each"
    return text.split(BEGIN)[1].split(END)[0]


def run_rows(rows_file: Path, run: str) -> dict[str, dict]:
    """job name -> the run's row (its last ok row when it has several)."""
    jobs: dict[str, dict] = {}
    for row in read_rows(rows_file):
        if row.get("run_id") == run and row.get("job_name"):
            if row["job_name"] not in jobs or row.get("status") == "ok":
                jobs[row["job_name"]] = row
    return jobs


def shown(text: str, value: float, unit: str) -> bool:
    """``text`` (a number as printed, in ``unit``) is ``value`` (in the rows' unit) rounded to the digits shown."""
    places = len(text.split(".")[1]) if "." in text else 0
    return abs(value / SCALE[unit] - float(text)) <= 0.5 * 10 ** -places * (1 + 1e-9)


def numbers(cell: str) -> tuple[list[tuple[str, str]], str]:
    """The figures of a cell (number, unit) and what is left once they and the `code` spans are taken out."""
    plain = re.sub(r"`[^`]*`", "", cell)
    return FIGURE.findall(plain), FIGURE.sub("", plain)


def cell_mismatches(where: str, cell: str, candidates: list[float]) -> list[str]:
    figures, rest = numbers(cell)
    bad = [f"{where}: {n} {u} is no figure of its row" for n, u in figures
           if not any(shown(n, c, u) for c in candidates)]
    return bad + ([f"{where}: a number without a unit: {rest!r}"] if re.search(r"\d", rest) else [])


BAND = re.compile(r"\(val\. loss (\S+), band (\S+) ± (\S+)\)")  # a training verdict's band (its own figures)


def band_mismatches(where: str, cell: str, rows_file: Path) -> tuple[list[str], str]:
    """A training verdict's band in ``cell`` checked against the training verdicts beside the rows (value, mean and
    sd as printed: 3, 3 and 2 significant digits); the cell without it."""
    found = BAND.search(cell)
    if found is None:
        return [], cell
    bands = [((v.get("checks") or {}).get("val_loss") or {}) for v in
             (json.loads(p.read_text()) for p in rows_file.parent.glob("quality/**/training_verdict.json"))]
    printed = [(f"{c['value']:.3g}", f"{c['band']['mean']:.3g}", f"{c['band']['sd']:.2g}") for c in bands if c]
    bad = [] if found.groups() in printed else [f"{where}: {found[0]} is no training verdict beside {rows_file}"]
    return bad, BAND.sub("", cell)


def time_candidates(row: dict | None) -> list[float]:
    if not row or row.get("status") != "ok":
        return []
    return [row["ms_median"], row["ms_median"] / (row.get("batch_size") or 1)]


def figures_of(row: dict | None) -> list[float]:
    """Every numeric field of an end-to-end row, each in ms as well when its name says seconds, and the command's
    time a volume (``total_s`` over ``volumes``)."""
    out = []
    for key, value in (row or {}).items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out += [value * 1000.0] if key.endswith("_s") else [value]
    if (row or {}).get("total_s") and (row or {}).get("volumes"):
        out.append(row["total_s"] * 1000.0 / row["volumes"])
    return out


def table_mismatches(readme: Path) -> list[str] | None:
    """What in ``readme``'s results table is not a figure of its run; None when it holds no table."""
    text = block(readme.read_text(encoding="utf-8"))
    lines = [line for line in text.splitlines() if line.startswith("|")]
    if not lines:
        return None
    run = re.search(r"run `([^`]+)`", text)[1]
    rows_file = readme.parent / re.search(r"\[rows\]\(([^)]+)\)", text)[1]
    jobs = run_rows(rows_file, run)
    if not jobs:
        return [f"{rows_file} holds no row of run {run}"]
    commit = re.search(r"at commits? `([0-9a-f]{12})", text)[1]
    bad = [] if any(r.get("git_sha", "").startswith(commit) for r in jobs.values()) else [f"commit {commit}: no row"]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        workload = cells[0].strip("`")
        for column, cell in zip(header[1:], cells[1:]):
            where = f"{workload} / {column}"
            if column.startswith("vs "):
                base, shipped = jobs.get(f"{workload}.{column[3:]}"), jobs.get(f"{workload}.shipped")
                ratio = [base["ms_median"] / shipped["ms_median"]] if time_candidates(base) and time_candidates(shipped) else []
                bad += cell_mismatches(where, cell, ratio)
            elif column == "real command":
                for part in cell.split(";"):
                    name = re.search(r"`([^`]+)`", part)
                    bad += cell_mismatches(where, part, figures_of(jobs.get(name[1])) if name else [])
            else:
                banded, cell = band_mismatches(where, cell, rows_file)
                bad += banded + cell_mismatches(where, cell, time_candidates(jobs.get(f"{workload}.{column}")))
    return bad


def published(repo: Path, readme_gpu: str = "h100") -> Path:
    """The fixture's two GPU folders published in ``repo``; its README."""
    folders = [repo / "bench" / "results" / gpu for gpu in ("h100", "h200")]
    publish(folders, repo / "docs" / "results", repo / "README.md", readme_gpu)
    return repo / "README.md"


def test_the_readme_has_its_results_markers_and_fits_its_size():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block(text)
    assert len(text.encode()) <= README_LIMIT


def test_every_number_of_the_readme_table_is_in_the_rows_of_the_run_it_names():
    """The README holds the table published from committed evidence rows (None: it was deleted)."""
    assert table_mismatches(ROOT / "README.md") == []


def test_the_check_passes_a_generated_table_and_fails_a_changed_number(evidence_repo):
    readme = published(evidence_repo)
    assert table_mismatches(readme) == []
    text = readme.read_text()
    for old, new in (("20.02 ms", "20.12 ms"), ("10.0×", "10.2×"), ("24.20 s", "24.30 s"), ("49.90 s once", "49.90 s once, 7")):
        assert old in text
        readme.write_text(text.replace(old, new, 1))
        assert table_mismatches(readme), f"{old} -> {new} went unnoticed"
    readme.write_text(text.replace("synth1", "synth9", 1))
    assert table_mismatches(readme) == [f"{evidence_repo}/bench/results/h100/results.jsonl holds no row of run "
                                        "20260101T000000Z-synth9"]


def test_a_training_verdict_s_band_is_checked_against_its_verdict_file(evidence_repo):
    readme = published(evidence_repo, "h200")  # the fixture's H200 has a training verdict
    text = readme.read_text()
    assert "(val. loss 0.0616, band 0.0557 ± 0.0025)" in text and table_mismatches(readme) == []
    for old, new in (("0.0616,", "0.0615,"), ("band 0.0557", "band 0.0558"), ("± 0.0025", "± 0.0035")):
        readme.write_text(text.replace(old, new, 1))
        assert table_mismatches(readme), f"{old} -> {new} went unnoticed"


def test_a_readme_without_a_table_is_told_apart(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\n{END}\n")
    assert table_mismatches(readme) is None
    readme.write_text("no markers\n")
    with pytest.raises(AssertionError, match="markers"):
        table_mismatches(readme)
