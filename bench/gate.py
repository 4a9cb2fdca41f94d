"""The speed-vs-quality gate for one bench job (``bench.quality=true``), built on ``med_ddpm.quality``.

The reference is Med-DDPM's own path: strict FP32 (``RecipeStack([])``) and 250-step DDPM. The
candidate is the job's recipe stack and sampler. Both share the weights (``bench.checkpoint`` or
a seeded random init), the masks, x_T and every per-step noise field, and the candidate's
denoiser is probed on the reference's recorded inputs, so any difference comes from the
recipes or the sampler (see ``med_ddpm/quality.py`` for the checks and verdict).

Example:
    >>> quality_report(cfg, torch.device("cuda"))["verdict"]
    'pass'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from bench.scenarios import make_inputs
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.model import build_model
from med_ddpm.quality import QualityGate, fixed_noise, randomize_zero_init, run_trajectory
from med_ddpm.samplers import build_sampler, sampler_from_config
from med_ddpm.utils import seed_everything
from optim import RecipeStack


def _weights(cfg: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The state dict both runs load: the checkpoint's (EMA) weights, or a seeded random init."""
    if cfg["bench"].get("checkpoint"):
        from med_ddpm.checkpoint import load_checkpoint

        return load_checkpoint(cfg["bench"]["checkpoint"]).model.state_dict()
    seed_everything(int(cfg["seed"]))
    return randomize_zero_init(build_model(cfg["model"]), int(cfg["seed"])).state_dict()


def _network(cfg: Mapping[str, Any], weights: dict[str, torch.Tensor], device: torch.device) -> nn.Module:
    model = build_model(cfg["model"])
    model.load_state_dict(weights)
    return model.to(device).eval()


def quality_report(cfg: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """Verdict and numbers of the job's stack + sampler against strict-FP32 DDPM (a JSON-able dict)."""
    weights = _weights(cfg)
    schedule = NoiseSchedule.from_config(cfg["diffusion"]).to(device)
    batch = int(cfg["bench"]["batch_size"])
    _, cond = make_inputs(cfg["model"], batch, device, int(cfg["seed"]))
    reference_sampler = build_sampler("ddpm", schedule)
    shape = (batch, int(cfg["model"]["out_channels"]), *cfg["model"]["image_size"])
    noise = fixed_noise(shape, steps=len(reference_sampler.timesteps), seed=int(cfg["seed"]), device=device)
    with RecipeStack([]).session():
        reference = run_trajectory(_network(cfg, weights, device), reference_sampler, cond, noise)
    stack = RecipeStack.from_config(cfg.get("recipe") or {})
    with stack.session():
        model = stack.prepare_model(_network(cfg, weights, device))
        candidate = run_trajectory(model, sampler_from_config(cfg["sampler"], schedule), stack.prepare_input(cond),
                                   noise, probe_inputs=reference.probe_inputs,
                                   forward_context=stack.forward_context)
    return QualityGate.from_config(cfg["quality"]).run(reference, candidate).to_dict()
