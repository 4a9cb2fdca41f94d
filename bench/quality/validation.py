"""Held-out phantoms and the validation loss on them: how well a quality model denoises volumes it never saw.

The quality model's card (``python -m bench.quality_model``) draws its validation-loss curve with it, and
``preset=quality_training`` (:mod:`bench.quality.training`) compares the models it trains by it: every call uses the
same phantoms and the same (t, ε) draws, so two values differ only by the weights.
"""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from med_ddpm.cli import CONFIG_DIR
from med_ddpm.data.phantoms import SyntheticPhantoms
from med_ddpm.samplers import model_input

# Phantoms of experiment=quality_model come from seed 0; data=held_out_phantoms (med_ddpm.step_search's default
# data) names the seed of those it never trains on.
HELD_OUT_SEED = int(OmegaConf.load(CONFIG_DIR / "data" / "held_out_phantoms.yaml").seed)


def held_out_phantoms(n: int, image_size: tuple[int, ...], variant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(images, conds) of ``n`` phantoms the model never saw."""
    phantoms = SyntheticPhantoms(n, image_size, variant=variant, seed=HELD_OUT_SEED)
    items = [phantoms[i] for i in range(n)]
    return torch.stack([it["image"] for it in items]), torch.stack([it["cond"] for it in items])


@torch.no_grad()
def validation_loss(model, schedule, images: torch.Tensor, conds: torch.Tensor, device: torch.device,
                    draws: int = 1) -> float:
    """Mean ε-MSE over ``draws`` (t, ε) per phantom from one generator, seeded once: comparable across checkpoints
    (and across models of one architecture). Eight phantoms a forward."""
    g, squared = torch.Generator().manual_seed(HELD_OUT_SEED), 0.0
    for _ in range(draws):
        t = torch.randint(0, schedule.num_train_timesteps, (len(images),), generator=g)
        eps = torch.randn(images.shape, generator=g)
        for i in range(0, len(images), 8):
            part = slice(i, i + 8)
            x_t = schedule.add_noise(images[part].to(device), eps[part].to(device), t[part].to(device))
            pred = model(model_input(x_t, conds[part].to(device)), t[part].to(device))
            squared += float((pred.float() - eps[part].to(device)).square().sum())
    return squared / (draws * images.numel())
