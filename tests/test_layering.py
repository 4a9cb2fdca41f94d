"""The dependency direction is bench -> med_ddpm -> optim -> torch (README); check it from the sources."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = {"optim": {"med_ddpm", "bench"}, "med_ddpm": {"bench"}}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_imports(package):
    files = sorted((REPO / package).rglob("*.py"))
    assert files
    bad = {str(f.relative_to(REPO)): imported_packages(f) & FORBIDDEN[package] for f in files}
    assert not {k: v for k, v in bad.items() if v}, f"{package} must not import {FORBIDDEN[package]}: {bad}"


@pytest.mark.parametrize("library", ["core", "quality", "reporting"])
def test_bench_library_imports_no_bench_command(library):
    """bench/core, bench/quality and bench/reporting are what the commands (bench/*.py) are built from, never the
    other way."""
    commands = {f"bench.{p.stem}" for p in (REPO / "bench").glob("*.py") if p.stem != "__init__"}
    files = sorted((REPO / "bench" / library).rglob("*.py"))
    assert files
    bad = {str(f.relative_to(REPO)): imported_modules(f) & commands for f in files}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"bench/{library} imports bench commands: {bad}"


@pytest.mark.parametrize("room, above", [("samplers", {"quality", "tuning"}), ("quality", {"tuning"})])
def test_a_med_ddpm_room_imports_none_above_it(room, above):
    """med_ddpm.tuning runs the quality gate, which runs the samplers: the arrows point down that line, never back."""
    files = sorted((REPO / "med_ddpm" / room).rglob("*.py"))
    assert files
    rooms = {f"med_ddpm.{name}" for name in above}
    bad = {str(f.relative_to(REPO)): {m for m in imported_modules(f) if any(m == r or m.startswith(f"{r}.")
                                                                           for r in rooms)} for f in files}
    assert not {k: v for k, v in bad.items() if v}, f"med_ddpm/{room} imports {sorted(rooms)}: {bad}"


def test_wandb_is_imported_lazily():
    """logger=none must work without wandb: no module-level `import wandb` anywhere."""
    for path in [*REPO.glob("med_ddpm/**/*.py"), *REPO.glob("bench/**/*.py"), *REPO.glob("optim/**/*.py")]:
        top = ast.parse(path.read_text()).body
        mods = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
        assert "wandb" not in mods, path
