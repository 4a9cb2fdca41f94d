"""train.memory_cap_gib: the fraction of the GPU handed to torch's allocator, and the errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from med_ddpm.errors import ConfigError
from med_ddpm.train import cap_memory


@pytest.fixture
def h200(monkeypatch):
    """A fake 140 GiB GPU 0: what cap_memory reads and the fraction it sets."""
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=140 * 2**30))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda fraction, index: calls.append((fraction, index)))
    return calls


def test_a_16_gib_cap_is_that_share_of_the_gpu(h200):
    cap_memory(torch.device("cuda"), 16)
    cap_memory(torch.device("cuda", 3), 14)
    assert h200 == [(16 / 140, 0), (14 / 140, 3)]


def test_no_cap_and_cpu_runs_set_nothing(h200):
    cap_memory(torch.device("cuda"), None)
    cap_memory(torch.device("cpu"), 16)
    assert h200 == []


@pytest.mark.parametrize("gib", [0, 200])
def test_a_cap_the_gpu_cannot_give_names_the_option(h200, gib):
    with pytest.raises(ConfigError, match=rf"train.memory_cap_gib={gib}: must be in \(0, 140.0\], .*; pass a smaller"):
        cap_memory(torch.device("cuda"), gib)
