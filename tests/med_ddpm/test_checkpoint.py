"""Checkpoint import/export: exact round trips and clear errors for bad files."""

from __future__ import annotations

import gzip
import shutil

import nibabel as nib
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from med_ddpm.checkpoint import (
    infer_model_config,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
    save_medddpm_checkpoint,
    split_medddpm_state,
)
from med_ddpm.config_checks import CheckpointError
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.model import UNet3D


@pytest.fixture(scope="module")
def ckpt_path(reference_dir):
    return reference_dir / "wholehead_small_ckpt.pt"


def test_medddpm_export_round_trip_is_bit_exact(ckpt_path, tmp_path):
    original = read_checkpoint(ckpt_path)
    ema, raw = load_checkpoint(ckpt_path, "ema"), load_checkpoint(ckpt_path, "model")
    out = save_medddpm_checkpoint(tmp_path / "export.pt", raw.model.state_dict(), ema.model.state_dict(), ema.schedule, 3)
    exported = torch.load(out, weights_only=True)
    assert exported["step"] == 3
    for entry in ("model", "ema"):
        assert list(exported[entry]) == list(original[entry])  # same keys, same order (buffers first)
        for k, v in original[entry].items():
            assert torch.equal(exported[entry][k], v), (entry, k)


def test_own_format_round_trip(tmp_path):
    net = UNet3D(3, 1, 32, (1, 2), 1, (2,))
    schedule = NoiseSchedule(50)
    cfg = {"model": net.config, "diffusion": schedule.config}
    save_checkpoint(tmp_path / "c.pt", model_state=net.state_dict(), ema_state=net.state_dict(), config=cfg, step=7)
    loaded = load_checkpoint(tmp_path / "c.pt")
    assert loaded.step == 7 and loaded.config["model"] == net.config
    assert loaded.schedule.num_train_timesteps == 50
    for k, v in net.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[k], v)


def test_brats_attention_placement_read_from_keys():
    """BraTS: attention rate 12 matches no level, so only the middle block has attention."""
    net = UNet3D(8, 4, 32, (1, 1, 2), num_res_blocks=2, attention_ds=(12,))
    assert not any(".1.qkv" in k for k in net.state_dict() if k.startswith(("input_blocks", "output_blocks")))
    cfg = infer_model_config(net.state_dict())
    assert cfg["attention_ds"] == [] and cfg["num_res_blocks"] == 2 and cfg["in_channels"] == 8
    assert cfg["out_channels"] == 4 and cfg["channel_mult"] == [1, 1, 2]
    assert "output_blocks.2.1.conv.weight" in net.state_dict()  # upsample index with 2 res blocks


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        load_checkpoint(tmp_path / "nope.pt")


@pytest.mark.parametrize("kind, reason", [
    ("truncated", "a truncated or damaged zip archive"),
    ("empty", "the file is empty"),
    ("nifti", "gzip data, such as a .nii.gz volume"),
    ("plain_nifti", "a NIfTI volume"),
])
def test_unreadable_file_names_the_path_a_short_reason_and_the_fix(kind, reason, ckpt_path, tmp_path):
    """torch's own message advises loading with ``weights_only=False``: unsafe advice for a file of unknown origin."""
    nib.save(nib.Nifti1Image(np.zeros((4, 4, 4), np.uint8), np.eye(4)), tmp_path / "mask.nii.gz")
    nifti = (tmp_path / "mask.nii.gz").read_bytes()
    content = {"truncated": ckpt_path.read_bytes()[:5000], "empty": b"", "nifti": nifti,
               "plain_nifti": gzip.decompress(nifti)}[kind]
    bad = tmp_path / f"{kind}.pt"
    bad.write_bytes(content)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(bad)
    assert str(err.value) == (f"checkpoint={bad}: not a PyTorch checkpoint ({reason}); pass a checkpoint written by "
                              "med_ddpm.train or the published Med-DDPM weights")


def test_a_pickle_of_objects_is_refused_without_torchs_advice(tmp_path):
    torch.save({"model": {}, "config": OmegaConf.create({"a": 1})}, tmp_path / "objects.pt")
    with pytest.raises(CheckpointError, match=r"objects\.pt: not a PyTorch checkpoint \(UnpicklingError: Unsupported "
                                              r"global: GLOBAL omegaconf\.dictconfig\.DictConfig [^;]*\); pass a ") as err:
        read_checkpoint(tmp_path / "objects.pt")
    assert "weights_only" not in str(err.value) and "\n" not in str(err.value)


def test_not_a_checkpoint(tmp_path):
    torch.save({"weights": torch.zeros(3)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="other.pt: not a Med-DDPM checkpoint .*; pass a checkpoint written by"):
        load_checkpoint(tmp_path / "other.pt")


def test_missing_and_misshaped_keys_are_named(ckpt_path, tmp_path):
    ckpt = read_checkpoint(ckpt_path)
    ema = dict(ckpt["ema"])
    del ema["denoise_fn.middle_block.1.qkv.bias"]
    ema["denoise_fn.middle_block.1.proj_out.bias"] = torch.zeros(5)
    ema["denoise_fn.extra.weight"] = torch.zeros(1)
    torch.save({"step": 1, "model": ema, "ema": ema}, tmp_path / "broken.pt")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / "broken.pt")
    msg = str(info.value)
    assert "broken.pt" in msg
    assert "missing keys: middle_block.1.qkv.bias" in msg
    assert "unknown keys: extra.weight" in msg
    assert "shape mismatch: middle_block.1.proj_out.bias (5,)" in msg


def test_missing_schedule_buffer(ckpt_path, tmp_path):
    ckpt = read_checkpoint(ckpt_path)
    ema = {k: v for k, v in ckpt["ema"].items() if k != "posterior_mean_coef3"}
    torch.save({"step": 1, "ema": ema}, tmp_path / "nobuf.pt")
    with pytest.raises(CheckpointError, match="missing schedule buffers: posterior_mean_coef3"):
        load_checkpoint(tmp_path / "nobuf.pt")


def test_copy_keeps_loading(ckpt_path, tmp_path):
    shutil.copy(ckpt_path, tmp_path / "copy.pt")
    buffers, net = split_medddpm_state(read_checkpoint(tmp_path / "copy.pt")["ema"])
    assert len(buffers) == 13 and len(net) == 242
