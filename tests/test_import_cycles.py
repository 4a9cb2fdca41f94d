"""No import cycles among the modules of med_ddpm, optim and bench, imports inside functions included.

An import inside a function that dodges a cycle is still a cycle: the two modules cannot be read, tested or moved
apart. The graph is built from the sources with ``ast`` (nothing is imported); a package's ``__init__`` counts as a
module, so a submodule importing its own package while the package imports it is a cycle too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("med_ddpm", "optim", "bench")


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> its file, for every .py file under ``root/<package>``."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def import_graph(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its source (module level, functions, classes)."""
    modules = module_files(root, packages)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                # `from pkg import sub` imports the module pkg.sub; `from mod import name` imports mod
                targets.update(known(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules else known(base)
                               for alias in node.names)
        graph[name] = {t for t in targets if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import path per cycle: for each strongly connected component of more than one module (Tarjan), the
    shortest path from its first module back to itself, as [a, b, ..., a]."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [shortest_loop(graph, component) for component in components]


def shortest_loop(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(graph[path[-1]] & component):
            if w == start:
                return [*path, start]
            if w not in seen:
                seen.add(w)
                paths.append([*path, w])
    raise AssertionError(f"{sorted(component)} is no cycle")


def test_no_import_cycles():
    found = cycles(import_graph(REPO))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(loop) for loop in found)


def test_a_cycle_through_a_function_level_import_is_found_and_named(tmp_path):
    package = tmp_path / "med_ddpm"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from med_ddpm.sub.b import B\n")
    (package / "a.py").write_text("from med_ddpm.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from med_ddpm import a\n    return a\n")
    (package / "sub" / "c.py").write_text("from .. import a\n")  # one way only: no cycle
    assert cycles(import_graph(tmp_path, ["med_ddpm"])) == [["med_ddpm.a", "med_ddpm.sub.b", "med_ddpm.a"]]


def test_a_submodule_importing_its_own_package_is_a_cycle(tmp_path):
    package = tmp_path / "bench"
    package.mkdir()
    (package / "__init__.py").write_text("from bench.core import run\n")
    (package / "core.py").write_text("import bench\n")
    assert cycles(import_graph(tmp_path, ["bench"])) == [["bench", "bench.core", "bench"]]
