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


def randomize_zero_init(net: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Re-initialise the layers Med-DDPM zero-initialises (as the reference checkpoint was made).

    A fresh U-Net predicts exactly 0, so a test comparing two code paths on it would pass
    whatever they compute; tests that check numerics call this first.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.abs().sum() == 0 and p.dim() > 1:
                bound = 1.0 / (p[0].numel() ** 0.5)
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
    return net
