"""Every relative link in README.md and docs/**/*.md points at a file of the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
         *sorted((ROOT / "bench" / "results").rglob("README.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links():
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            resolved = (page.parent / target.split("#")[0]).resolve()
            yield page.relative_to(ROOT).as_posix(), target, resolved


def as_param(page: str, target: str, resolved: Path):
    return pytest.param(resolved, id=f"{page}->{target}")


@pytest.mark.parametrize("resolved", [as_param(*link) for link in relative_links()])
def test_link_target_exists(resolved: Path):
    assert resolved.is_relative_to(ROOT), f"{resolved} is outside the repository"
    assert resolved.exists(), f"{resolved} does not exist"


def test_links_are_found():
    """The pattern finds relative links, and the README links the docs index."""
    assert ("README.md", "docs/README.md", ROOT / "docs" / "README.md") in set(relative_links())
