"""The bench scenarios on the tiny CPU config: the train step is the training loop's own function,
with its micro-batches and EMA, and the row's throughput counts what one call processes."""

from __future__ import annotations

import functools

import pytest
import torch

from bench.core.runner import compose_job
from bench.core.scenarios import model_calls, prepared_step, run_scenario, volumes_per_call
from med_ddpm import train


def bench_cfg(tmp_path, *overrides: str) -> dict:
    return compose_job(["experiment=bench_smoke", "bench=train_step", *overrides], tmp_path)["config"]


def test_the_timed_train_step_is_the_loops_train_step(tmp_path):
    cfg = bench_cfg(tmp_path, "train.grad_accum=2", "train.ema_every=2")
    with prepared_step(cfg, torch.device("cpu")) as (step, _stack):
        assert isinstance(step, functools.partial) and step.func is train.train_step
        state = step.args[0]
        forwards = []
        state.model.register_forward_hook(lambda *_: forwards.append(1))
        ema_before = [p.clone() for p in state.ema.module.parameters()]
        weights_before = [p.clone() for p in state.net.parameters()]
        loss = step()
        assert torch.isfinite(loss) and state.step == 1 and len(forwards) == 2  # two micro-batches, one step
        assert not any(torch.equal(a, b) for a, b in zip(weights_before, state.net.parameters()))
        # step 0 is on the EMA's cadence: it averaged (decay 0.995) towards the updated weights
        moved = [(e - b).abs().max().item() for e, b in zip(state.ema.module.parameters(), ema_before)]
        assert max(moved) > 0
        ema_after_first = [p.clone() for p in state.ema.module.parameters()]
        step()  # step 1 is off the cadence: the EMA stays
        assert state.step == 2 and all(torch.equal(a, b) for a, b in zip(ema_after_first, state.ema.module.parameters()))


def run_flops(tmp_path) -> int:
    from bench.core.scenarios import model_flops

    return model_flops(bench_cfg(tmp_path, "train.grad_accum=1"))


def test_the_ema_can_be_switched_off(tmp_path):
    with prepared_step(bench_cfg(tmp_path, "bench.ema=false"), torch.device("cpu")) as (step, _stack):
        assert step.args[0].ema is None and torch.isfinite(step())


@pytest.mark.filterwarnings("ignore:noisy timing")
def test_throughput_counts_every_micro_batch(tmp_path):
    cfg = bench_cfg(tmp_path, "train.grad_accum=2", "bench.warmup=0", "bench.iters=2")
    assert (model_calls(cfg), volumes_per_call(cfg)) == (2, 2)
    fields = run_scenario(cfg, torch.device("cpu"))
    assert fields["volumes_per_s"] == pytest.approx(2 / (fields["ms_median"] / 1e3))
    assert fields["flops"] == 2 * run_flops(tmp_path)  # two micro-batches: twice one forward + backward
    assert fields["compile_s"] is None  # no recipe compiles
    denoise = compose_job(["experiment=bench_smoke", "bench=denoise_step", "bench.batch_size=3"], tmp_path)["config"]
    assert (model_calls(denoise), volumes_per_call(denoise)) == (1, 3)


def network_input_strides(cfg: dict) -> set[tuple[int, ...]]:
    """The strides of every input the U-Net saw during one call of the bench step."""
    from med_ddpm.model import UNet3D

    seen: set[tuple[int, ...]] = set()

    def hook(module, args):
        if isinstance(module, UNet3D):
            seen.add(args[0].stride())

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        with prepared_step(cfg, torch.device("cpu")) as (step, _stack):
            step()
    finally:
        handle.remove()
    return seen


def test_the_denoise_step_feeds_the_network_what_sampling_feeds_it(tmp_path):
    """A compiled forward saved by med_ddpm.sample guards on its input's strides: the bench's forward must build its
    input as the sampler does, channels-last stack included, or it compiles a second graph."""
    common = ["experiment=bench_smoke", "recipe=[channels_last_3d]", "bench.warmup=0", "bench.iters=1"]
    forward = compose_job([*common, "bench=denoise_step"], tmp_path / "f")["config"]
    chain = compose_job([*common, "bench=full_sample", "sampler=ddim", "sampler.steps=2"], tmp_path / "s")["config"]
    assert network_input_strides(forward) == network_input_strides(chain)
