"""``pip install .`` gives what the checkout runs: every module, configs/ and the files the commands read ship in the
wheel; each console script is its command's ``cli.run`` (as ``python -m``); every third-party import is declared."""

from __future__ import annotations

import ast
import functools
import importlib
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from med_ddpm import cli

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGES = ("med_ddpm", "optim", "bench")
# The distribution each third-party import comes from; None: not ours to declare, with the reason.
DISTRIBUTIONS = {"torch": "torch", "monai": "monai", "nibabel": "nibabel", "hydra": "hydra-core",
                 "omegaconf": "omegaconf", "wandb": "wandb", "numpy": "numpy", "tqdm": "tqdm",
                 "matplotlib": "matplotlib", "scipy": "scipy", "yaml": "pyyaml", "submitit": "submitit",
                 "triton": None}  # torch's CUDA wheels bring it; CPU wheels have none (optim.fused_groupnorm checks)


def module_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py")
                  if "results" not in p.relative_to(REPO).parts)


def third_party_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - set(PACKAGES)


def declared() -> set[str]:
    project = PYPROJECT["project"]
    specs = [*project["dependencies"], *(s for extra in project["optional-dependencies"].values() for s in extra)]
    return {re.split(r"[<>=!~;\[ ]", s, maxsplit=1)[0].lower() for s in specs}


def test_every_third_party_import_is_a_declared_dependency():
    found = {name: path.relative_to(REPO).as_posix() for path in module_files() for name in third_party_imports(path)}
    assert not set(found) - set(DISTRIBUTIONS), f"imports with no distribution in DISTRIBUTIONS: {found}"
    missing = {name: found[name] for name in found if DISTRIBUTIONS[name] and DISTRIBUTIONS[name] not in declared()}
    assert not missing, f"imported but not in pyproject.toml's dependencies: {missing}"


def test_every_console_script_is_its_commands_cli_run():
    """A script bound to ``main`` itself would skip cli.run: a config error would end in Hydra's traceback."""
    scripts = PYPROJECT["project"]["scripts"]
    assert {"med-ddpm-train", "med-ddpm-sample", "med-ddpm-tune", "med-ddpm-evaluate", "med-ddpm-sweep",
            "med-ddpm-report", "med-ddpm-ladder"} <= set(scripts)
    for name, target in scripts.items():
        module_name, attr = target.split(":")
        module = importlib.import_module(module_name)
        console = getattr(module, attr)
        assert isinstance(console, functools.partial) and console.func is cli.run, name
        assert console.args == (module.main,), name
        assert 'if __name__ == "__main__":\n    console()' in Path(module.__file__).read_text(), name


def test_configs_are_found_through_the_package():
    """In a checkout med_ddpm/configs links the top-level folder; the wheel holds a copy at that place."""
    assert (REPO / "med_ddpm" / "configs").is_symlink() and cli.CONFIG_DIR == REPO / "configs"


def build_wheel(out: Path) -> zipfile.ZipFile:
    """The wheel of a copy of the checkout's packaging inputs (setuptools writes build/ beside its input)."""
    src = out / "src"
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, src / name)
    for name in (*PACKAGES, "configs"):
        shutil.copytree(REPO / name, src / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "results"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "-w", str(out / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return zipfile.ZipFile(next((out / "dist").glob("*.whl")))


@pytest.mark.e2e
def test_the_wheel_holds_every_module_every_config_and_the_cards(tmp_path):
    wheel = build_wheel(tmp_path)
    names = set(wheel.namelist())
    modules = {p.relative_to(REPO).as_posix() for p in module_files()}
    configs = {f"med_ddpm/configs/{p.relative_to(REPO / 'configs').as_posix()}" for p in (REPO / "configs").rglob("*.yaml")}
    assert not (modules | configs | {"optim/CARDS.md"}) - names
    info = next(n for n in names if n.endswith(".dist-info/METADATA")).rpartition("/")[0]
    assert "License-Expression: MIT" in wheel.read(f"{info}/METADATA").decode()
    assert "med-ddpm-train = med_ddpm.train:console" in wheel.read(f"{info}/entry_points.txt").decode()
