"""train.memory_cap_gib: the fraction of the GPU handed to torch's allocator, and the errors."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from med_ddpm.config_checks import ConfigError
from med_ddpm.memory_cap import ALLOC_CONF_VARS, cap_memory, check_cap_held, expandable_segments_under_cap


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


@pytest.fixture
def no_alloc_conf(monkeypatch):
    for var in ALLOC_CONF_VARS:  # set first, so teardown restores the variable whatever the test wrote
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)


def test_a_cap_turns_on_expandable_segments_before_cuda_starts(no_alloc_conf):
    """Cached-but-unallocated blocks count against the cap; expandable segments let freed memory serve any size."""
    expandable_segments_under_cap(16)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_no_cap_or_the_users_own_allocator_settings_are_left_alone(no_alloc_conf, monkeypatch):
    expandable_segments_under_cap(None)
    assert not any(var in os.environ for var in ALLOC_CONF_VARS)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:512")
    expandable_segments_under_cap(16)
    assert os.environ["PYTORCH_ALLOC_CONF"] == "max_split_size_mb:512" and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_too_late_to_change_the_allocator_says_so(no_alloc_conf, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    expandable_segments_under_cap(16)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "CUDA already started" in caplog.text


def test_a_peak_above_the_cap_is_flagged(caplog):
    """A cap the allocator did not hold (were expandable segments to ignore it) must not read as "fits 16 GiB"."""
    assert check_cap_held(16, 15.9) and check_cap_held(None, 40.0) and check_cap_held(16, None)
    assert not caplog.text
    assert not check_cap_held(16, 17.25)
    assert "train.memory_cap_gib=16: the allocator held up to 17.25 GiB, above the cap" in caplog.text
