"""One micro-batch of 2 volumes is Med-DDPM's optimizer step of 2 micro-batches of 1 (experiment=fast_train).

Why it holds for this network: GroupNorm normalises each sample over its own channels and voxels (no
statistic crosses the batch, unlike BatchNorm), attention mixes voxels of one sample, and the L1 loss is a
mean over all elements, so for two volumes of equal size mean(batch of 2) = (mean_1 + mean_2) / 2, which is
what accumulation computes with each micro-batch's loss divided by ``grad_accum``. The t and noise of a
sample are keyed by its global position and the data order by the global sample stream, so both settings
see the same samples, times and noise. What differs is float32 summation order: tolerance 1e-5 of the
largest gradient entry (measured: 2.6e-6 here).

Med-DDPM's trainer also divides the mean by the batch size (``divide_loss_by_batch_size``): at batch 2 that
halves the gradient, so fast_train turns it off; the last test shows the difference is caught.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from med_ddpm.train import batch_stream, build, train_step

CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")
SMALL = ["model=tiny", "model.image_size=[16,16,16]", "model.channel_mult=[1,2]", "model.attention_ds=[2]",
         "device=cpu", "data.num_volumes=4", "train.progress=false"]
RTOL = 1e-5


def step_gradients(tmp_path: Path, batch_size: int, grad_accum: int, *extra: str) -> tuple[float, list[torch.Tensor]]:
    """One optimizer step's loss and gradients from the real config and loop, from perturbed weights
    (the zero-initialised output conv would leave every other layer without a gradient)."""
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("train", overrides=[*SMALL, f"output_dir={tmp_path}", f"train.batch_size={batch_size}",
                                          f"train.grad_accum={grad_accum}", *extra])
    job = build(cfg)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in job.net.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    loss = train_step(job, batch_stream(job))
    return loss.item(), [p.grad.clone() for p in job.net.parameters()]


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory):
    return step_gradients(tmp_path_factory.mktemp("accum"), 1, 2)


def max_relative_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    scale = max(g.abs().max().item() for g in a)
    return max((x - y).abs().max().item() for x, y in zip(a, b)) / scale


def test_batch_2_is_the_step_of_2_accumulated_micro_batches(accumulated, tmp_path):
    loss, grads = step_gradients(tmp_path, 2, 1)
    assert loss == pytest.approx(accumulated[0], rel=RTOL)
    assert sum(int(g.count_nonzero()) for g in grads) > 0.9 * sum(g.numel() for g in grads)  # every layer learns
    assert max_relative_difference(accumulated[1], grads) < RTOL


def test_dividing_the_mean_by_the_batch_size_breaks_it(accumulated, tmp_path):
    _, grads = step_gradients(tmp_path, 2, 1, "train.divide_loss_by_batch_size=true")
    ratio = sum(g.abs().sum() for g in grads) / sum(g.abs().sum() for g in accumulated[1])
    assert ratio.item() == pytest.approx(0.5, rel=RTOL)
