"""Metrics on known inputs: perfect scores for identical volumes, closed forms for known perturbations."""

import math

import pytest
import scipy.linalg
import torch
from monai.networks.nets import resnet10

from med_ddpm.config_checks import CheckpointError
from med_ddpm.quality.features import MedicalNetFeatures, RandomConv3dFeatures
from med_ddpm.quality.metrics import (
    MAE,
    MSSSIM,
    PSNR,
    SSIM,
    MaxAbsError,
    VolumeMetric,
    frechet_distance,
    ms_ssim_weights,
    region_mask,
)


def _value(metric: VolumeMetric, pred, target=None, **kw) -> float:
    metric.reset()
    metric.update(pred, target, **kw)
    return metric.compute()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def vols():
    g = torch.Generator().manual_seed(0)
    return torch.rand(2, 1, 16, 16, 16, generator=g) * 1.6 - 0.8  # inside [-1, 1] after +0.02


@pytest.fixture(scope="module")
def cond():
    """Whole-head layout: ch0 brain, ch1 tumour, values in {-1, 1}; sample 1 has no tumour."""
    c = -torch.ones(2, 2, 16, 16, 16)
    c[:, 0, 4:12, 4:12, 4:12] = 1
    c[0, 1, 6:8, 6:8, 6:8] = 1
    return c


@pytest.mark.parametrize("metric, perfect", [
    (PSNR(), math.inf), (SSIM(), 1.0), (MSSSIM(), 1.0), (MAE(), 0.0), (MaxAbsError(), 0.0),
])
def test_identical_volumes_score_perfectly(metric, perfect, vols):
    assert _value(metric, vols, vols.clone()) == pytest.approx(perfect, abs=1e-6)


def test_constant_offset_gives_closed_form_psnr_mae_max(vols):
    pred = vols + 0.02
    assert _value(PSNR(data_range=2.0), pred, vols) == pytest.approx(20 * math.log10(2 / 0.02), abs=1e-3)  # 40 dB
    assert _value(MAE(), pred, vols) == pytest.approx(0.02, abs=1e-6)
    assert _value(MaxAbsError(), pred, vols) == pytest.approx(0.02, abs=1e-6)
    assert 0.9 < _value(SSIM(), pred, vols) < 1.0  # shifted into [0, 2]: a 1 % offset barely matters


def test_metrics_accumulate_over_updates_and_reset(vols):
    psnr = PSNR()
    psnr.update(vols + 0.02, vols)
    psnr.update(vols + 0.2, vols)
    assert psnr.compute() == pytest.approx((40 + 20) / 2, abs=1e-3)  # per-sample mean, 40 and 20 dB
    psnr.reset()
    assert math.isnan(psnr.compute())


def test_in_mask_variants_count_only_masked_voxels(vols, cond):
    tumour = region_mask(cond, "tumour")
    assert tumour.sum() == 8 and region_mask(cond, "brain").sum() == 2 * 8**3
    outside = vols + torch.where(tumour, 0.0, 0.5)
    assert _value(PSNR(region="tumour"), outside, vols, cond=cond) == math.inf
    assert _value(MAE(region="tumour"), outside, vols, cond=cond) == 0.0
    inside = vols + torch.where(tumour, 0.02, 0.0)
    assert _value(PSNR(region="tumour"), inside, vols, cond=cond) == pytest.approx(40.0, abs=1e-3)
    assert _value(MaxAbsError(region="tumour"), inside, vols, cond=cond) == pytest.approx(0.02, abs=1e-6)
    # an explicit mask works the same; sample 1 has an empty region and contributes nothing
    assert _value(PSNR(), inside, vols, mask=tumour) == pytest.approx(40.0, abs=1e-3)
    assert math.isnan(_value(PSNR(region="tumour"), inside[1:], vols[1:], cond=cond[1:]))
    assert PSNR(region="brain").name == "psnr_brain"


def test_region_errors_are_clear(vols, cond):
    with pytest.raises(ValueError, match="needs cond"):
        PSNR(region="tumour").update(vols, vols)
    with pytest.raises(ValueError, match="no in-mask variant"):
        SSIM().update(vols, vols, mask=region_mask(cond, "brain"))
    with pytest.raises(ValueError, match="unknown region"):
        region_mask(cond, "skull")
    with pytest.raises(ValueError, match="differ in shape"):
        MAE().update(vols, vols[:1])
    with pytest.raises(ValueError, match="needs a target"):
        MAE().update(vols)


def test_brats_layout_reads_four_channel_masks():
    c = torch.zeros(1, 4, 4, 4, 4)
    c[0, 3, :2] = 1  # healthy brain
    c[0, 2, 3, 3, 3] = 1  # enhancing tumour
    assert region_mask(c, "brain", "brats").sum() == 33 and region_mask(c, "tumour", "brats").sum() == 1


def test_a_broken_sample_is_never_averaged_away(vols):
    pred = vols.clone()
    pred[0, 0, 0, 0, :3] = math.nan
    assert math.isnan(_value(PSNR(), pred, vols)) and math.isnan(_value(MAE(), pred, vols))
    assert math.isnan(float(frechet_distance(pred.flatten(1), vols.flatten(1))))


def test_ms_ssim_scales_for_paper_and_tiny_volumes():
    assert len(ms_ssim_weights((128, 128, 128))) == 5
    assert len(ms_ssim_weights((144, 192, 192))) == 5
    assert [len(ms_ssim_weights((s,) * 3)) for s in (64, 32, 16, 8)] == [4, 3, 2, 1]
    assert sum(ms_ssim_weights((32,) * 3)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="smaller than the kernel"):
        ms_ssim_weights((4, 4, 4))


def test_frechet_distance_closed_forms():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(400, 6, generator=g, dtype=torch.float64) @ torch.randn(6, 6, generator=g, dtype=torch.float64)
    shift = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, 1.0], dtype=torch.float64)
    assert float(frechet_distance(a, a)) == pytest.approx(0.0, abs=1e-8)
    assert float(frechet_distance(a, a + shift)) == pytest.approx(float(shift @ shift), rel=1e-8)
    # b = 2a + shift: Σb = 4Σa, so tr(Σa + Σb − 2(ΣaΣb)^½) = tr(Σa)
    expected = float((a.mean(0) + shift) @ (a.mean(0) + shift)) + float(torch.cov(a.T).trace())
    assert float(frechet_distance(a, 2 * a + shift)) == pytest.approx(expected, rel=1e-8)


def test_frechet_distance_matches_scipy_sqrtm():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(50, 5, generator=g, dtype=torch.float64), torch.rand(60, 5, generator=g, dtype=torch.float64)
    ca, cb = torch.cov(a.T).numpy(), torch.cov(b.T).numpy()
    out = scipy.linalg.sqrtm(ca @ cb)
    covmean = (out[0] if isinstance(out, tuple) else out).real
    ref = float(((a.mean(0) - b.mean(0)) ** 2).sum()) + ca.trace() + cb.trace() - 2 * covmean.trace()
    assert float(frechet_distance(a, b)) == pytest.approx(ref, rel=1e-7)


def test_random_features_are_seeded_and_leave_global_rng_alone(vols):
    state = torch.random.get_rng_state()
    f1, f2 = RandomConv3dFeatures(seed=0), RandomConv3dFeatures(seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert "relative metric only" in f1.name  # a random CNN's FID / KID compare runs, never papers
    assert torch.equal(f1(vols), f2(vols)) and not torch.equal(f1(vols), RandomConv3dFeatures(seed=1)(vols))
    assert f1(vols.expand(-1, 3, -1, -1, -1)).shape == (2, 3 * 240)  # per-channel features, concatenated


def test_medicalnet_loads_released_layout(tmp_path, vols):
    torch.manual_seed(0)
    net = resnet10(spatial_dims=3, n_input_channels=1, feed_forward=False, conv1_t_size=7, conv1_t_stride=2,
                   shortcut_type="B", bias_downsample=False).eval()
    path = tmp_path / "resnet_10.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in net.state_dict().items()}}, path)
    feats, small = MedicalNetFeatures(path, depth=10, normalize="none"), vols[:, :, :8, :8, :8]
    with torch.no_grad():
        assert torch.allclose(feats(small), net(small))
    with pytest.raises(CheckpointError, match="not found"):
        MedicalNetFeatures(tmp_path / "missing.pth")
    torch.save({"state_dict": {"conv1.weight": torch.zeros(1)}}, tmp_path / "bad.pth")
    with pytest.raises(CheckpointError, match="keys do not match"):
        MedicalNetFeatures(tmp_path / "bad.pth")
