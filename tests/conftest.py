"""Shared fixtures: the golden reference (tests/data/reference), the real sample MRI volumes (outside the
clone, skipped when absent) and tiny models.

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
REFERENCE = REPO / "tests" / "data" / "reference"
# The Med-DDPM repository's sample volumes (GPL v3) stay out of the clone; CI keeps them in ../shared/data.
SAMPLE_DATA_ENV = "MED_DDPM_SAMPLE_DATA"
SAMPLE_DATA = Path(os.environ.get(SAMPLE_DATA_ENV) or REPO.parent / "shared" / "data")
WHOLE_HEAD = SAMPLE_DATA / "whole_head"
NO_SAMPLE_DATA = (f"the real sample MRI volumes are not at {WHOLE_HEAD}: set {SAMPLE_DATA_ENV} to the folder "
                  "holding whole_head/ (the Med-DDPM repository's dataset/)")

# torch's own choice (the CPU's cores, or $OMP_NUM_THREADS), kept in the environment for pytest-xdist's workers,
# which start with the OMP_NUM_THREADS=1 set below
TORCH_THREADS = int(os.environ.setdefault("TESTS_TORCH_THREADS", str(torch.get_num_threads())))
os.environ["OMP_NUM_THREADS"] = "1"  # the commands the tests start read it when torch loads
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def whole_head_data() -> Path:
    """The real whole-head sample (``image/``, ``mask/``); a test using it is skipped, always with the one reason
    :data:`NO_SAMPLE_DATA`, where it is absent."""
    if not WHOLE_HEAD.is_dir():
        pytest.skip(NO_SAMPLE_DATA)
    return WHOLE_HEAD


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    """The original-format checkpoint and the original code's tensors (tests/data/reference/README.md)."""
    return REFERENCE


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
