"""The run's commands read bytecode from the run's folder: written by them, or compiled once at the run's start where
the environment forbids writing it (as the GPU image does)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.core import bytecode


@pytest.fixture
def environ(monkeypatch):
    """The process environment as a copy: what prepare sets ends with the test."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")}
    monkeypatch.setattr(os, "environ", env)
    return env


def test_where_bytecode_may_be_written_the_commands_write_it_into_the_run(tmp_path, environ):
    assert bytecode.prepare(tmp_path) == {"mode": "written", "prefix": str(tmp_path / "cache" / "pycache")}
    assert environ["PYTHONPYCACHEPREFIX"] == str(tmp_path / "cache" / "pycache")


def test_a_prefix_the_environment_names_is_kept(tmp_path, environ):
    environ["PYTHONPYCACHEPREFIX"] = "/elsewhere"
    assert bytecode.prepare(tmp_path) == {"mode": "environment", "prefix": "/elsewhere"}


@pytest.mark.e2e
def test_where_it_is_forbidden_it_is_compiled_once_and_a_command_reads_it(tmp_path, environ):
    environ["PYTHONDONTWRITEBYTECODE"] = "1"
    record = bytecode.prepare(tmp_path, modules=("colorsys",))  # a one-file module: seconds, not torch's minutes
    prefix = tmp_path / "cache" / "pycache"
    assert record["mode"] == "compiled" and record["packages"] >= 1 and record["prefix"] == str(prefix)
    assert list(prefix.rglob("colorsys*.pyc"))
    environ.pop("PYTHONPYCACHEPREFIX")
    assert bytecode.prepare(tmp_path, modules=("colorsys",)) == record  # once per run folder
    found = subprocess.run([sys.executable, "-c", "import colorsys, sys; print(colorsys.__cached__)"], env=environ,
                           capture_output=True, text=True, check=True).stdout
    assert found.startswith(str(prefix))
