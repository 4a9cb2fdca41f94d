"""Parity with the original Med-DDPM: golden tensors from tests/data/reference (see its README).

Tolerances are the README's recommended ones (float32 CPU re-implementation).
"""

from __future__ import annotations

import pytest
import torch

from med_ddpm.checkpoint import load_checkpoint
from med_ddpm.diffusion import BUFFER_NAMES, NoiseSchedule, diffusion_loss
from med_ddpm.model import timestep_embedding
from med_ddpm.samplers import DDPMSampler, sample

EPS_ATOL = 1e-4
TRAJ_ATOL = 1e-4
TEMB_ATOL = 2e-5


@pytest.fixture(scope="module")
def ref(reference_dir):
    return torch.load(reference_dir / "wholehead_small_ref.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def ema(reference_dir):
    return load_checkpoint(reference_dir / "wholehead_small_ckpt.pt", weights="ema")


def test_architecture_inferred_from_keys(ema, ref):
    cfg = ref["config"]
    assert ema.config["model"] == dict(
        in_channels=3,
        out_channels=1,
        model_channels=cfg["num_channels"],
        channel_mult=list(cfg["channel_mult"]),
        num_res_blocks=cfg["num_res_blocks"],
        attention_ds=list(cfg["attention_ds"]),
        num_heads=1,
        dropout=0.0,
    )
    assert ema.schedule.num_train_timesteps == cfg["timesteps"] == 250
    assert sum(p.numel() for p in ema.model.parameters()) == 2_617_217
    assert not ema.model.training


def test_timestep_embedding(ref):
    """The README's tolerance: the float32 formula matches to the bit only on the CPU kernels that made the
    reference; ATen's AVX-512 sin/cos differ from its AVX2 ones in the last bits (3.6e-6 here)."""
    torch.testing.assert_close(timestep_embedding(ref["t"], 32), ref["temb_sinusoid"], atol=TEMB_ATOL, rtol=0)


@pytest.mark.parametrize("case", ["", "_nc"])
def test_denoiser_output(ema, ref, case):
    with torch.no_grad():
        eps = ema.model(torch.cat([ref[f"x_t{case}"], ref[f"cond{case}"]], 1), ref[f"t{case}"])
    assert eps.shape == ref[f"eps{case}"].shape
    assert (eps - ref[f"eps{case}"]).abs().max() < EPS_ATOL


def test_schedule_buffers_exact(ref):
    schedule = NoiseSchedule(250, "cosine", 0.008)
    for name in BUFFER_NAMES:
        assert getattr(schedule, name).dtype == torch.float32
        assert torch.equal(getattr(schedule, name), ref[name]), name
    assert schedule.betas[-1] == pytest.approx(0.999)
    assert torch.equal(schedule.betas.double(), ref["betas_float64"].float().double())


def test_training_loss_and_q_sample(ema, ref):
    s = ema.schedule
    assert torch.equal(s.add_noise(ref["x_start"], ref["loss_noise"], ref["loss_t"]), ref["loss_x_noisy"])
    with torch.no_grad():
        loss = diffusion_loss(ema.model, s, ref["x_start"], ref["loss_cond"], t=ref["loss_t"], noise=ref["loss_noise"])
    assert loss.item() == pytest.approx(ref["loss"].item(), rel=1e-6)


def test_model_weights_are_the_non_ema_entry(reference_dir, ref):
    raw = load_checkpoint(reference_dir / "wholehead_small_ckpt.pt", weights="model")
    with torch.no_grad():
        loss = diffusion_loss(raw.model, raw.schedule, ref["x_start"], ref["loss_cond"], t=ref["loss_t"], noise=ref["loss_noise"])
        eps = raw.model(torch.cat([ref["x_t"], ref["cond"]], 1), ref["t"])
    assert loss.item() == pytest.approx(0.9269, abs=1e-4)
    assert (eps - ref["eps"]).abs().max() > 1.0  # README: differs by up to 1.96


def test_first_ddpm_step_of_the_trajectory(ema, ref, torch_threads):
    """The chain's first step (t = 249) with the original's x_T and injected noise, at a 250th of the full
    chain's cost (the full chain is the slow test below)."""
    sampler = DDPMSampler(ema.schedule)
    sampler.timesteps = sampler.timesteps[:1]
    x = sample(ema.model, sampler, ref["traj_cond"], x_T=ref["traj_x_T"], step_noise=ref["traj_step_noise"],
               progress=False)
    assert (x - ref["traj_x_at"][249]).abs().max() < TRAJ_ATOL


@pytest.fixture(scope="module")
def trajectory(ema, ref, torch_threads):
    """The full 250-step chain with the original's injected noise; records x after t = 249, 125, 0."""
    seen = {}

    class Recording(DDPMSampler):
        def step(self, model_output, t, x_t, **kw):
            out = super().step(model_output, t, x_t, **kw)
            if int(t) in ref["traj_x_at"]:
                seen[int(t)] = out.prev_sample.clone()
            return out

    x0 = sample(ema.model, Recording(ema.schedule), ref["traj_cond"], x_T=ref["traj_x_T"],
                step_noise=ref["traj_step_noise"], progress=False)
    return x0, seen


@pytest.mark.slow
def test_full_250_step_trajectory(trajectory, ref):
    x0, seen = trajectory
    assert sorted(seen) == sorted(ref["traj_x_at"])
    for t, x in seen.items():
        assert (x - ref["traj_x_at"][t]).abs().max() < TRAJ_ATOL, t
    err = (x0 - ref["traj_x0"]).abs()
    assert err.max() < TRAJ_ATOL and err.mean() < 1e-5
