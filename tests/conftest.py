"""Shared fixtures: paths to ../shared (CI has it beside the checkout) and tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """../shared: reference checkpoint, golden tensors and sample NIfTI data. Never skipped."""
    assert SHARED.is_dir(), f"{SHARED} is missing: tests need the shared reference data beside the checkout"
    return SHARED


@pytest.fixture(scope="session")
def reference_dir(shared_dir: Path) -> Path:
    return shared_dir / "reference"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)



@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: two OpenMP threads on a loaded 2-core box spin-wait badly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
