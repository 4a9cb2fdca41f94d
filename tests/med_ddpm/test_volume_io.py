"""Writing model-order volumes back to NIfTI with the mask's affine/header, and PNG montages."""


import nibabel as nib
import numpy as np
import pytest
import torch

from med_ddpm.config_checks import DataError
from med_ddpm.data.datasets import load_condition
from med_ddpm.data.phantoms import SyntheticPhantoms
from med_ddpm.data.volume_io import cond_to_labels, save_montage_png, save_volume_like


@pytest.fixture
def reference(tmp_path):
    """A uint8 mask with an oblique affine and the real masks' qform/sform codes (0/2)."""
    angle = 0.3
    affine = np.array([[np.cos(angle) * 1.2, -np.sin(angle), 0, -40.5],
                       [np.sin(angle) * 1.2, np.cos(angle), 0, 12.25],
                       [0, 0, 2.5, -7.0],
                       [0, 0, 0, 1]])
    img = nib.Nifti1Image(np.zeros((8, 10, 12), np.uint8), affine)
    img.set_qform(None, code=0)
    img.set_sform(affine, code=2)
    path = tmp_path / "mask.nii.gz"
    nib.save(img, path)
    return path


def test_round_trip_affine_header_and_axis_order(reference, tmp_path):
    volume = torch.randn(1, 12, 10, 8)  # model (C, D, H, W) = NIfTI (k, j, i) reversed
    out = save_volume_like(volume, reference, tmp_path / "out" / "sample.nii.gz")
    saved, ref = nib.load(out), nib.load(reference)
    assert np.array_equal(saved.affine, ref.affine)
    assert int(saved.header["sform_code"]) == 2 and int(saved.header["qform_code"]) == 0
    assert saved.get_data_dtype() == np.float32 and saved.shape == (8, 10, 12)
    np.testing.assert_array_equal(saved.get_fdata(dtype=np.float32), volume[0].numpy().transpose(2, 1, 0))
    assert sorted(p.name for p in out.parent.iterdir()) == ["sample.nii.gz"]  # no temp file left behind


def test_real_mask_round_trips_exactly(whole_head_data, tmp_path):
    """load_condition -> labels -> save_volume_like reproduces the real mask file's voxels and affine."""
    path = whole_head_data / "mask" / "sample_1.nii.gz"
    cond, nifti = load_condition(path, "whole_head", (128, 128, 128))
    out = save_volume_like(cond_to_labels(cond), path, tmp_path / "labels.nii.gz")
    saved = nib.load(out)
    assert np.array_equal(saved.affine, nifti.affine) and saved.get_data_dtype() == np.uint8
    assert np.array_equal(np.asanyarray(saved.dataobj), np.asanyarray(nifti.dataobj))


def test_channels_affine_pair_and_grid_mapping(reference, tmp_path):
    volume = torch.rand(4, 12, 10, 8)
    saved = nib.load(save_volume_like(volume, (nib.load(reference).affine, None), tmp_path / "m.nii"))
    assert saved.shape == (8, 10, 12, 4)
    np.testing.assert_array_equal(saved.get_fdata(dtype=np.float32)[..., 2], volume[2].numpy().transpose(2, 1, 0))
    small = torch.rand(1, 10, 10, 8)
    with pytest.raises(DataError, match=r"does not match the reference grid \(12, 10, 8\)"):
        save_volume_like(small, reference, tmp_path / "x.nii.gz")
    padded = nib.load(save_volume_like(small, reference, tmp_path / "p.nii.gz", resize_mode="crop_or_pad"))
    data = padded.get_fdata(dtype=np.float32)
    assert data.shape == (8, 10, 12) and np.all(data[..., 0] == -1) and np.all(data[..., -1] == -1)
    np.testing.assert_array_equal(data[..., 1:11], small[0].numpy().transpose(2, 1, 0))


@pytest.mark.parametrize("variant", ["whole_head", "brats"])
def test_montage_png(tmp_path, variant):
    item = SyntheticPhantoms(1, (24, 24, 24), variant=variant)[0]
    out = save_montage_png(item["image"], item["cond"], tmp_path / "m.png", title=variant)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 150_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.png"]


def test_cond_to_labels_both_encodings():
    labels = torch.tensor([0, 1, 2, 1]).reshape(1, 1, 2, 2)
    onehot = torch.cat([labels == 1, labels == 2]).float()
    assert np.array_equal(cond_to_labels(onehot), labels[0].numpy())
    assert np.array_equal(cond_to_labels(onehot * 2 - 1), labels[0].numpy())


@pytest.mark.parametrize("ref_shape", [(5, 6, 7), (127, 3, 9), (2, 8, 1)])
def test_crop_or_pad_inverse_is_exact_for_odd_differences(ref_shape):
    """Loader: MONAI ResizeWithPadOrCrop ref -> (4, 4, 4); writer must put every voxel back in place."""
    from monai.transforms import ResizeWithPadOrCrop

    from med_ddpm.data.volume_io import invert_crop_or_pad

    ref = torch.arange(float(np.prod(ref_shape))).reshape(1, *ref_shape)
    model = torch.as_tensor(ResizeWithPadOrCrop((4, 4, 4), value=-1.0)(ref))
    back = invert_crop_or_pad(model, ref_shape, pad_value=-1.0)
    kept = back != -1
    assert back.shape == ref.shape
    assert torch.equal(back[kept], ref[kept]) and int(kept.sum()) == int((model != -1).sum())
