"""Synthetic head phantoms: determinism by (seed, index), shapes, ranges, labels, speed, NIfTI export."""

import time
from functools import partial

import numpy as np
import pytest
import torch

from med_ddpm.data.datasets import WholeHeadDataset
from med_ddpm.data.encoding import medddpm_slice_minmax
from med_ddpm.data.phantoms import SyntheticPhantoms, generate_phantom, write_phantom_niftis

SIZE = (16, 20, 24)  # non-cubic on purpose: catches axis mix-ups


def test_item_depends_only_on_seed_and_index():
    short, long = SyntheticPhantoms(3, SIZE, seed=5), SyntheticPhantoms(10, SIZE, seed=5)
    assert torch.equal(short[1]["image"], long[1]["image"]) and torch.equal(short[1]["cond"], long[1]["cond"])
    assert not torch.equal(short[1]["image"], short[2]["image"])
    assert not torch.equal(short[1]["image"], SyntheticPhantoms(3, SIZE, seed=6)[1]["image"])
    assert short[2]["name"] == "phantom_0002"


@pytest.mark.parametrize(("variant", "channels", "labels"), [("whole_head", (1, 2), {0, 1, 2}),
                                                             ("brats", (4, 4), {0, 1, 2, 3, 4})])
def test_shapes_ranges_labels(variant, channels, labels):
    item = SyntheticPhantoms(2, SIZE, variant=variant)[0]
    image, cond = item["image"], item["cond"]
    assert image.dtype == cond.dtype == torch.float32
    assert image.shape == (channels[0], *SIZE) and cond.shape == (channels[1], *SIZE)
    assert torch.all(image.amin(dim=(1, 2, 3)) == -1) and torch.all(image.amax(dim=(1, 2, 3)) == 1)
    on = cond > 0
    assert set(cond.unique().tolist()) == ({-1.0, 1.0} if variant == "whole_head" else {0.0, 1.0})
    assert on.sum(0).max() == 1  # one label per voxel
    _, label_map = generate_phantom(SIZE, variant)
    assert set(np.unique(label_map).tolist()) == labels
    assert torch.all(image[:, torch.from_numpy(label_map == 0)] == -1)
    assert torch.all(image[:, torch.from_numpy(label_map > 0)] > -1)  # the "t1 > -1" healthy-brain rule holds


def test_modalities_have_different_contrasts():
    image, labels = generate_phantom((32, 32, 32), "brats")
    means = np.array([[image[c][labels == k].mean() for k in (1, 2, 3, 4)] for c in range(4)])
    assert np.linalg.matrix_rank(means - means.mean(axis=1, keepdims=True)) >= 3  # not one contrast rescaled
    assert means[1, 2] > means[0, 2] and means[3, 1] > means[3, 3]  # t1ce lights enhancing; flair oedema


def test_slice_minmax_option():
    raw, scaled = SyntheticPhantoms(1, SIZE)[0], SyntheticPhantoms(1, SIZE, intensity="medddpm_slice_minmax")[0]
    assert torch.equal(scaled["image"], medddpm_slice_minmax(raw["image"]))


def test_memory_cache_returns_the_generated_items_and_guards_them(monkeypatch):
    """``cache=memory`` generates each phantom once, at construction, and hands out copies: the same items as
    generation on every read, so the cache never changes what a run trains on."""
    made = []
    generate = SyntheticPhantoms.generate
    monkeypatch.setattr(SyntheticPhantoms, "generate", lambda self, i: made.append(i) or generate(self, i))
    cached, plain = SyntheticPhantoms(3, SIZE, seed=2, cache="memory"), SyntheticPhantoms(3, SIZE, seed=2)
    assert cached.cache == "memory" and plain.cache == "none" and made == [0, 1, 2]
    for index in (2, 0, 2):
        item, fresh = cached[index], plain[index]
        assert torch.equal(item["image"], fresh["image"]) and torch.equal(item["cond"], fresh["cond"])
        assert item["name"] == fresh["name"]
        item["image"].add_(1)  # a caller that edits its batch in place
    assert made == [0, 1, 2, 2, 0, 2], "the cached set generated nothing after construction"
    assert torch.equal(cached[2]["image"], plain[2]["image"])


def test_the_synthetic_config_caches_a_set_that_fits_and_refuses_disk():
    from hydra import compose, initialize_config_dir

    from med_ddpm.cli import CONFIG_DIR
    from med_ddpm.config_checks import ConfigError
    from med_ddpm.data.datasets import build_dataset

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["model=tiny", "output_dir=/tmp/x"])
    assert cfg.data.name == "synthetic" and cfg.data.cache == "auto"
    assert build_dataset(cfg.data, SIZE).cache == "memory"  # a few small phantoms fit any machine's RAM
    with pytest.raises(ConfigError, match=r"^data.cache='disk': unknown value; pass one of auto, memory, none$"):
        build_dataset({**cfg.data, "cache": "disk"}, SIZE)


def test_fast_at_64_cubed():
    generate_phantom((64, 64, 64))
    best = min(_timed(partial(generate_phantom, (64, 64, 64), "brats", index=i)) for i in range(3))
    assert best < 0.2, f"64^3 phantom took {best:.3f} s"


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_written_niftis_load_back_identically(tmp_path):
    write_phantom_niftis(tmp_path, 2, SIZE, seed=3)
    dataset, phantoms = WholeHeadDataset(tmp_path, SIZE), SyntheticPhantoms(2, SIZE, seed=3)
    for index in range(2):
        assert torch.equal(dataset[index]["cond"], phantoms[index]["cond"])
        torch.testing.assert_close(dataset[index]["image"], phantoms[index]["image"], atol=1e-6, rtol=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="data.variant='knee'"):
        SyntheticPhantoms(2, SIZE, variant="knee")
    with pytest.raises(IndexError):
        SyntheticPhantoms(2, SIZE)[2]
