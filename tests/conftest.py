"""Shared fixtures: paths to ../shared (CI has it beside the checkout) and tiny models.

The suite runs on one CPU thread, here and in every command a test starts: on a 2-core box shared with other
work, two OpenMP threads spin-wait for each other (a 16³ training step of the tiny model took 4 to 8 s on two
threads, 0.2 s on one); on an idle box the test-sized tensors gain little from a second thread.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# torch's own choice (the CPU's cores, or $OMP_NUM_THREADS), kept in the environment for pytest-xdist's workers,
# which start with the OMP_NUM_THREADS=1 set below
TORCH_THREADS = int(os.environ.setdefault("TESTS_TORCH_THREADS", str(torch.get_num_threads())))
os.environ["OMP_NUM_THREADS"] = "1"  # the commands the tests start read it when torch loads
torch.set_num_threads(1)


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
def torch_threads():
    """torch's own thread count for a module whose bit-exact or 1e-4 comparisons hold in the summation order it
    gives: one thread sums convolutions in another order (the dense_conv_grads contract then differs by 2e-10, the
    parity chain's first step by 1.1e-4)."""
    torch.set_num_threads(TORCH_THREADS)
    yield
    torch.set_num_threads(1)
