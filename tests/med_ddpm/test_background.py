"""Training's dataset built in another process (med_ddpm.data.background): the same items, its errors, its fallback."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from med_ddpm.config_checks import DataError
from med_ddpm.data import background
from med_ddpm.data.background import DatasetBuild, SharedItems, build_training_dataset
from med_ddpm.data.datasets import WholeHeadDataset
from med_ddpm.data.phantoms import write_phantom_niftis

SIZE = (16, 16, 16)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whole_head")
    write_phantom_niftis(folder, 3, SIZE)
    return folder


def whole_head(root, cache="memory"):
    return {"name": "whole_head", "root": str(root), "cache": cache, "intensity": "volume_minmax",
            "resize_mode": "crop_or_pad"}


def assert_same_items(dataset, reference):
    assert len(dataset) == len(reference) and dataset.variant == reference.variant
    for index in range(len(reference)):
        got, want = dataset[index], reference[index]
        assert got["name"] == want["name"]
        assert torch.equal(got["image"], want["image"]) and torch.equal(got["cond"], want["cond"])


def test_a_memory_cache_is_read_once_into_shared_stacks(root):
    built = build_training_dataset(whole_head(root), SIZE, share=True)
    dataset = built.dataset
    assert isinstance(dataset, SharedItems) and built.seconds > 0 and built.error is None
    assert dataset.columns["image"].is_shared() and dataset.columns["image"].shape == (3, 1, *SIZE)
    assert_same_items(dataset, WholeHeadDataset(root, SIZE, cache="none"))
    with pytest.raises(IndexError):
        dataset[3]


def test_without_a_memory_cache_the_dataset_reads_its_files(root, tmp_path):
    """The items are the dataset's own, each read from its files when asked for: a file rewritten after the build is
    what the next read gives."""
    shutil.copytree(root, tmp_path / "data")
    dataset = build_training_dataset(whole_head(tmp_path / "data", cache="none"), SIZE, share=True).dataset
    assert not isinstance(dataset, SharedItems) and dataset.cache == "none"
    assert_same_items(dataset, WholeHeadDataset(root, SIZE, cache="none"))
    write_phantom_niftis(tmp_path / "other", 1, SIZE, seed=5)
    shutil.copy(tmp_path / "other" / "image" / "phantom_0000.nii.gz", tmp_path / "data" / "image")
    assert torch.equal(dataset[0]["image"], WholeHeadDataset(tmp_path / "other", SIZE, cache="none")[0]["image"])


def test_the_process_hands_over_the_items(root):
    build = DatasetBuild(whole_head(root), SIZE)
    assert build._process is not None, "fork is there on Linux: the build runs in another process"
    dataset = build.result()
    assert build.result() is dataset and build.seconds > 0
    assert isinstance(dataset, SharedItems) and dataset.columns["cond"].is_shared()
    assert_same_items(dataset, WholeHeadDataset(root, SIZE, cache="none"))


def test_the_process_error_is_raised_as_it_was_after_its_warnings(tmp_path):
    """A folder whose files are all left out: the warning naming them, then the one-line error, both here."""
    write_phantom_niftis(tmp_path, 1, SIZE)
    (tmp_path / "image" / "phantom_0000.nii.gz").write_bytes(b"not a NIfTI")
    build = DatasetBuild({**whole_head(tmp_path), "on_bad_file": "skip"}, SIZE)
    with pytest.warns(UserWarning, match="skipped 1 bad input"), pytest.raises(DataError, match="no usable image/mask"):
        build.result()
    with pytest.raises(DataError, match="nowhere"):
        DatasetBuild(whole_head(tmp_path / "nowhere"), SIZE).result()


def die(conn, cfg_data, image_size):
    """A dataset process killed before it answered (out of memory, a full /dev/shm)."""
    os._exit(9)


def test_a_process_that_died_is_replaced_by_a_build_here(root, monkeypatch, caplog):
    monkeypatch.setattr(background, "_serve", die)
    dataset = DatasetBuild(whole_head(root), SIZE).result()
    assert "stopped (exit code 9" in caplog.text and "building it in this process" in caplog.text
    assert isinstance(dataset, SharedItems) and not dataset.columns["image"].is_shared()
    assert_same_items(dataset, WholeHeadDataset(root, SIZE, cache="none"))


def test_the_process_is_a_daemon_ended_with_a_command_that_failed_before_it_needed_the_data(root):
    build = DatasetBuild(whole_head(root), SIZE)
    assert build._process.daemon
    build.result()
    assert build._process.exitcode == 0, "taken: the process ended on its own"
