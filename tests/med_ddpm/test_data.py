"""NIfTI data layer: the real whole-head sample, pairing, validation of bad inputs, BraTS layouts, caching."""

import gzip
import random
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.data import CacheDataset
from omegaconf import OmegaConf

from med_ddpm.config_checks import ConfigError, DataError
from med_ddpm.data import cache as data_cache
from med_ddpm.data.cache import dataset_bytes
from med_ddpm.data.datasets import BratsDataset, WholeHeadDataset, build_dataset, load_condition
from med_ddpm.data.discovery import list_brats_cases, list_pairs
from med_ddpm.data.encoding import VARIANTS, labels_to_cond, medddpm_slice_minmax
from med_ddpm.data.phantoms import SyntheticPhantoms, generate_phantom, write_phantom_niftis

REPO = Path(__file__).resolve().parents[2]
REAL = 128
SIZE = (16, 16, 16)


@pytest.fixture(scope="module")
def real_dataset(whole_head_data):
    with pytest.warns(UserWarning, match="3 masks have no image") as record:
        dataset = WholeHeadDataset(whole_head_data, (REAL, REAL, REAL))
    message = str(record[0].message)
    assert all(f"sample_{i}.nii.gz" in message for i in range(3)) and "sample_3" not in message
    return dataset


@pytest.fixture(scope="module")
def real_item(real_dataset):
    return real_dataset[0]


@pytest.fixture(scope="module")
def real_nifti(whole_head_data):
    image = nib.load(whole_head_data / "image" / "sample_3.nii.gz").get_fdata()
    mask = np.asanyarray(nib.load(whole_head_data / "mask" / "sample_3.nii.gz").dataobj)
    return image, mask


def test_real_pair_shape_range_labels(real_dataset, real_item):
    assert len(real_dataset) == 1 and real_dataset.num_skipped == 0
    assert real_item["name"] == "sample_3"
    image, cond = real_item["image"], real_item["cond"]
    assert type(image) is torch.Tensor and image.dtype == cond.dtype == torch.float32
    assert image.shape == (1, REAL, REAL, REAL) and cond.shape == (2, REAL, REAL, REAL)
    assert image.min() >= -1 and image.max() <= 1
    assert set(cond.unique().tolist()) == {-1.0, 1.0}
    assert int((cond[1] > 0).sum()) == 1145 and int((cond[0] > 0).sum()) == 1_152_632  # README counts
    assert not torch.any((cond[0] > 0) & (cond[1] > 0))


def test_real_axis_convention(real_item, real_nifti):
    """model[c, d, h, w] = nifti[w, h, d, c]: spatial axes fully reversed, as in the original."""
    image, mask = real_nifti
    np.testing.assert_allclose(real_item["image"][0].numpy(), image.transpose(2, 1, 0), atol=2e-7)
    assert np.array_equal(real_item["cond"][1].numpy() > 0, (mask == 2).transpose(2, 1, 0))


def test_real_orphan_masks_listed(whole_head_data):
    pairing = list_pairs(whole_head_data)
    assert [c.name for c in pairing.pairs] == ["sample_3"]
    assert [p.name for p in pairing.orphan_masks] == [f"sample_{i}.nii.gz" for i in range(3)]


def test_medddpm_slice_minmax_matches_sklearn_restatement(real_nifti, whole_head_data):
    """sklearn MinMaxScaler on the (i*j, k) reshape: every k-slice to [0, 1] on its own, constant -> 0."""
    with pytest.warns(UserWarning, match="masks have no image"):
        item = WholeHeadDataset(whole_head_data, (REAL,) * 3, intensity="medddpm_slice_minmax")[0]
    image = real_nifti[0]
    flat = image.reshape(-1, image.shape[-1])
    lo, span = flat.min(axis=0), flat.max(axis=0) - flat.min(axis=0)
    scale = 1.0 / np.where(span == 0, 1.0, span)
    expected = ((flat * scale - lo * scale) * 2 - 1).reshape(image.shape).transpose(2, 1, 0)
    np.testing.assert_allclose(item["image"][0].numpy(), expected, atol=1e-6)
    constant = span == 0
    assert constant.sum() == 8 and np.all(item["image"][0].numpy()[constant] == -1)  # README: 8 constant slices


def test_load_condition_real_mask(whole_head_data):
    cond, nifti = load_condition(whole_head_data / "mask" / "sample_0.nii.gz", "whole_head", (REAL,) * 3)
    assert cond.shape == (2, REAL, REAL, REAL) and int((cond[1] > 0).sum()) == 443
    expected = np.diag([1.5, 1.5, 1.5, 1.0])
    expected[:3, 3] = (-94.75, -112.75, -73.75)
    np.testing.assert_array_equal(nifti.affine, expected)


# ---------------------------------------------------------------------------------------------------------
# Bad inputs: each a clear DataError naming the file and the problem, or skipped and counted
# ---------------------------------------------------------------------------------------------------------


def _save(path: Path, array: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(array, np.eye(4)), path)
    return path


def _random_volume(shape=SIZE) -> np.ndarray:
    return np.random.default_rng(0).random(shape, dtype=np.float32)


def _truncated(root: Path) -> Path:
    _save(root / "mask" / "bad.nii.gz", _label(1))
    path = _save(root / "image" / "bad.nii.gz", _random_volume())
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _bad_image(array: np.ndarray, mask: np.ndarray | None = None):
    def write(root: Path) -> Path:
        _save(root / "mask" / "bad.nii.gz", np.zeros(SIZE, np.uint8) if mask is None else mask)
        return _save(root / "image" / "bad.nii.gz", array)

    return write


def _bad_mask(mask: np.ndarray):
    def write(root: Path) -> Path:
        _save(root / "image" / "bad.nii.gz", _random_volume())
        return _save(root / "mask" / "bad.nii.gz", mask)

    return write


def _nan_volume():
    volume = _random_volume()
    volume[3, 4, 5] = np.nan
    return volume


def _label(value, dtype=np.uint8):
    mask = np.zeros(SIZE, dtype)
    mask[2:5, 2:5, 2:5] = value
    return mask


BAD_INPUTS = {
    "truncated": (_truncated, "unreadable NIfTI image"),
    "nan": (_bad_image(_nan_volume()), "1 NaN/inf voxels"),
    "4d": (_bad_image(np.zeros((*SIZE, 2), np.float32) + np.arange(2, dtype=np.float32)), "4 dimensions"),
    "label_7": (_bad_mask(_label(7)), "unexpected mask labels [7]"),
    "fractional_label": (_bad_mask(_label(0.5, np.float32)), "not a label map"),
    "no_mask": (lambda root: _save(root / "image" / "bad.nii.gz", _random_volume()), "image has no mask"),
    "shape_mismatch": (_bad_image(_random_volume((16, 16, 15))), "does not match mask"),
    "constant": (_bad_image(np.ones(SIZE, np.float32)), "image is constant"),
}


@pytest.fixture
def good_root(tmp_path):
    write_phantom_niftis(tmp_path, 2, SIZE)
    return tmp_path


@pytest.mark.parametrize("kind", sorted(BAD_INPUTS))
def test_bad_input_raises_naming_file_and_problem(good_root, kind):
    write, problem = BAD_INPUTS[kind]
    bad_file = write(good_root)
    with pytest.raises(DataError) as err:
        WholeHeadDataset(good_root, SIZE)
    assert str(bad_file) in str(err.value) and problem in str(err.value)


def test_skip_mode_counts_bad_pairs(tmp_path):
    for index, kind in enumerate(sorted(BAD_INPUTS)):
        root = tmp_path / kind
        BAD_INPUTS[kind][0](root)
        for sub in ("image", "mask"):  # gather every bad case in one folder under distinct names
            source = root / sub / "bad.nii.gz"
            if source.exists():
                (tmp_path / "all" / sub).mkdir(parents=True, exist_ok=True)
                shutil.move(source, tmp_path / "all" / sub / f"bad_{index}.nii.gz")
    write_phantom_niftis(tmp_path / "all", 2, SIZE)
    with pytest.warns(UserWarning, match=f"skipped {len(BAD_INPUTS)} bad input"):
        dataset = WholeHeadDataset(tmp_path / "all", SIZE, on_bad_file="skip")
    assert dataset.num_skipped == len(BAD_INPUTS) and len(dataset) == 2
    assert [dataset[i]["name"] for i in range(2)] == ["phantom_0000", "phantom_0001"]


def test_missing_root_and_empty_dataset(tmp_path):
    with pytest.raises(DataError, match="no such folder"):
        list_pairs(tmp_path / "nowhere")
    with pytest.raises(DataError, match=r"nowhere/image: no such folder; pass data\.root=<a folder with image/"):
        WholeHeadDataset(tmp_path / "nowhere", SIZE)
    with pytest.raises(DataError, match=r"nowhere: no such folder; pass data\.root=<a folder of BraTS cases>"):
        BratsDataset(tmp_path / "nowhere", SIZE)
    (tmp_path / "image").mkdir()
    with pytest.raises(DataError, match=r"no usable image/mask pairs \(skipped 0\); pass data\.root=<a folder with"):
        WholeHeadDataset(tmp_path, SIZE)


def test_every_pair_skipped(tmp_path):
    write_phantom_niftis(tmp_path, 1, SIZE)
    (tmp_path / "mask" / "phantom_0000.nii.gz").unlink()
    with pytest.warns(UserWarning, match="skipped 1 bad input"), pytest.raises(
            DataError, match=r"no usable image/mask pairs \(skipped 1\); fix the files the warning lists"):
        WholeHeadDataset(tmp_path, SIZE, on_bad_file="skip")


def test_gzip_garbage_is_unreadable(tmp_path):
    write_phantom_niftis(tmp_path, 1, SIZE)
    (tmp_path / "mask" / "phantom_0000.nii.gz").write_bytes(gzip.compress(b"not a nifti header" * 30))
    with pytest.raises(DataError, match=r"phantom_0000.nii.gz: unreadable NIfTI mask"):
        WholeHeadDataset(tmp_path, SIZE)


# ---------------------------------------------------------------------------------------------------------
# Preprocessing options, caching, configs
# ---------------------------------------------------------------------------------------------------------


def test_phantom_files_round_trip_through_loader(good_root):
    dataset = WholeHeadDataset(good_root, SIZE)
    phantoms = SyntheticPhantoms(2, SIZE)
    for index in range(2):
        item, expected = dataset[index], phantoms[index]
        torch.testing.assert_close(item["image"], expected["image"], atol=1e-6, rtol=0)
        assert torch.equal(item["cond"], expected["cond"])


def test_crop_or_pad_fills_background(good_root):
    item = WholeHeadDataset(good_root, (20, 16, 12), resize_mode="crop_or_pad")[0]
    assert item["image"].shape == (1, 20, 16, 12) and item["cond"].shape == (2, 20, 16, 12)
    assert torch.all(item["image"][:, :2] == -1) and torch.all(item["cond"][:, :2] == -1)
    resampled = WholeHeadDataset(good_root, (8, 12, 20), resize_mode="resample")[0]
    assert resampled["image"].shape == (1, 8, 12, 20) and set(resampled["cond"].unique().tolist()) <= {-1.0, 1.0}


@pytest.mark.parametrize("cache", ["memory", "disk"])
def test_cache_gives_same_items(good_root, tmp_path_factory, cache):
    cache_dir = tmp_path_factory.mktemp("cache")
    plain = WholeHeadDataset(good_root, SIZE, cache="none")
    cached = WholeHeadDataset(good_root, SIZE, cache=cache, cache_dir=cache_dir)
    for _ in range(2):  # second pass reads the cache
        for index in range(2):
            assert torch.equal(cached[index]["image"], plain[index]["image"])
            assert torch.equal(cached[index]["cond"], plain[index]["cond"])
    assert (cache == "disk") == any(cache_dir.iterdir())


@pytest.mark.parametrize(("free_gib", "chosen"), [(1.0, "memory"), (1e-4, "none")])
def test_cache_auto_keeps_the_dataset_in_memory_when_it_fits(good_root, monkeypatch, free_gib, chosen):
    """2 items of 16^3 x (1 image + 2 mask channels) float32 = 98,304 bytes: memory when that is at most half
    the available RAM."""
    assert dataset_bytes(2, VARIANTS["whole_head"], SIZE) == 98_304
    monkeypatch.setattr(data_cache, "available_ram_bytes", lambda: int(free_gib * 2**30))
    dataset = WholeHeadDataset(good_root, SIZE)
    assert dataset.cache == chosen
    assert isinstance(dataset._data, CacheDataset) == (chosen == "memory")


def test_brats_memory_cache_keeps_every_modality(tmp_path):
    write_phantom_niftis(tmp_path, 2, SIZE, variant="brats")
    plain, cached = (BratsDataset(tmp_path, SIZE, cache=cache) for cache in ("none", "memory"))
    for index in range(2):
        assert cached[index]["image"].shape == (4, *SIZE)
        assert torch.equal(cached[index]["image"], plain[index]["image"])


def test_option_errors_name_the_key(good_root):
    with pytest.raises(ConfigError, match="^data.intensity='zscore': unknown value; pass one of volume_minmax, "):
        WholeHeadDataset(good_root, SIZE, intensity="zscore")
    with pytest.raises(ValueError, match="data.cache_dir"):
        WholeHeadDataset(good_root, SIZE, cache="disk")


@pytest.mark.parametrize("name", ["synthetic", "whole_head", "brats"])
def test_build_dataset_from_config_files(tmp_path, name):
    cfg = OmegaConf.load(REPO / "configs" / "data" / f"{name}.yaml")
    cfg.image_size = list(SIZE)
    if name != "synthetic":
        cfg.root = str(tmp_path)
        write_phantom_niftis(tmp_path, 2, SIZE, variant=name)
    dataset = build_dataset(cfg)
    item = dataset[0]
    assert item["image"].shape == (dataset.variant.image_channels, *SIZE)
    assert item["cond"].shape == (dataset.variant.cond_channels, *SIZE)


# ---------------------------------------------------------------------------------------------------------
# BraTS layouts: pairing by case ID, raw-label remapping
# ---------------------------------------------------------------------------------------------------------

NAMES = ["BraTS2021_00017", "BraTS2021_00002", "BraTS2021_00101"]


def _check_brats_items(dataset, names):
    """Item named n must hold phantom names.index(n): the one written under that case ID."""
    assert len(dataset) == len(names) and dataset.variant.name == "brats"
    for item in (dataset[i] for i in range(len(dataset))):
        image, labels = generate_phantom(SIZE, "brats", index=names.index(item["name"]))
        torch.testing.assert_close(item["image"], torch.from_numpy(image), atol=1e-6, rtol=0)
        assert torch.equal(item["cond"], labels_to_cond(torch.from_numpy(labels)[None], dataset.variant))
        assert set(item["cond"].unique().tolist()) == {0.0, 1.0}


@pytest.mark.parametrize("layout", ["per_case", "per_modality"])
@pytest.mark.parametrize("raw", [True, False])
def test_brats_layouts_pair_by_case_id(tmp_path, layout, raw):
    names = random.Random(1).sample(NAMES, len(NAMES))
    write_phantom_niftis(tmp_path, 3, SIZE, variant="brats", layout=layout, raw_labels=raw, names=names)
    if layout == "per_modality":  # an extra seg that sorts first would shift a sort-and-zip pairing
        shutil.copy(tmp_path / "seg" / f"{NAMES[0]}_seg.nii.gz", tmp_path / "seg" / "BraTS2021_00000_seg.nii.gz")
        with pytest.warns(UserWarning, match="BraTS2021_00000_seg.nii.gz"):
            dataset = BratsDataset(tmp_path, SIZE)
    else:
        dataset = BratsDataset(tmp_path, SIZE)
    assert {r["seg_labels"] for r in dataset.records} == {"raw" if raw else "medddpm"}
    _check_brats_items(dataset, names)


def test_brats_missing_modality_and_raw_label_3(tmp_path):
    write_phantom_niftis(tmp_path, 2, SIZE, variant="brats", layout="per_case", names=NAMES[:2])
    (tmp_path / NAMES[1] / f"{NAMES[1]}_t2.nii.gz").unlink()
    assert [c.name for c in list_brats_cases(tmp_path).pairs] == [NAMES[0]]
    with pytest.raises(DataError, match=rf"case {NAMES[1]}: seg .* lacks modalities \['t2'\]"):
        BratsDataset(tmp_path, SIZE)
    processed = tmp_path / "processed"
    write_phantom_niftis(processed, 1, SIZE, variant="brats", raw_labels=False, names=NAMES[:1])
    seg = processed / NAMES[0] / f"{NAMES[0]}_seg.nii.gz"
    with pytest.raises(DataError, match=rf"{seg}: unexpected mask labels \[3\] for a raw BraTS seg"):
        BratsDataset(processed, SIZE, seg_labels="raw")


def test_brats_load_condition_needs_t1_for_raw_seg(tmp_path):
    write_phantom_niftis(tmp_path, 1, SIZE, variant="brats", layout="per_case", names=NAMES[:1])
    seg, t1 = (tmp_path / NAMES[0] / f"{NAMES[0]}_{m}.nii.gz" for m in ("seg", "t1"))
    with pytest.raises(DataError, match="needs its case's t1 volume .*; pass t1_path="):
        load_condition(seg, "brats", SIZE, seg_labels="raw")
    cond, _ = load_condition(seg, "brats", SIZE, t1_path=t1)
    expected = BratsDataset(tmp_path, SIZE)[0]["cond"]
    assert torch.equal(cond, expected)


def test_slice_minmax_constant_slice_is_minus_one():
    volume = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    volume[1, 2] = 7.0
    scaled = medddpm_slice_minmax(volume)
    assert torch.all(scaled[1, 2] == -1) and torch.all(scaled[0].amin(dim=(1, 2)) == -1)
    assert torch.all(scaled[0].amax(dim=(1, 2)) == 1)
