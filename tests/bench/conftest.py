"""Fixtures of the bench tests: the synthetic evidence run laid out as a repository holds it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench.reporting.pages import BEGIN, END

EVIDENCE = Path(__file__).parent / "fixtures" / "evidence"  # one synthetic run per GPU, every row of the contract


@pytest.fixture
def evidence_repo(tmp_path: Path) -> Path:
    """``tmp_path`` with bench/results/h100 and h200 (the fixture's runs and the H200's gate files) and a README
    holding the results markers."""
    shutil.copytree(EVIDENCE, tmp_path / "bench" / "results")
    (tmp_path / "README.md").write_text(f"# project\n\n## Results\n\n{BEGIN}\n{END}\n\n## Layout\n")
    return tmp_path
