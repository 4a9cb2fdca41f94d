"""What a GPU can run, simulated on the CPU: a V100 (no bf16, no TF32) runs fast_train's fp16 variant and refuses
TF32 by name, a 16 GB card refuses a row that needs more memory, a GPU missing from the peak table is one note."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hydra import compose

from bench.core.gpu_fit import Gpu, fit, fp16_variant
from med_ddpm import cli
from optim import RecipeStack

V100 = {"name": "Tesla V100-SXM2-16GB", "capability": [7, 0], "memory_gib": 15.8}
H100 = {"name": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "memory_gib": 79.2}


def stack_of(overrides) -> RecipeStack:
    with cli.configs():
        return RecipeStack.from_config(compose("bench", overrides=[*overrides, "output_dir=."]).get("recipe"))


def test_detect_reads_torch_and_the_simulation_replaces_fields(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda index=0: "Tesla V100-PCIE-32GB")
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda index=0: (7, 0))
    monkeypatch.setattr("torch.cuda.get_device_properties", lambda index=0: SimpleNamespace(total_memory=32 * 2**30))
    assert Gpu.detect() == Gpu("Tesla V100-PCIE-32GB", (7, 0), 32.0)
    assert Gpu.detect({"memory_gib": 16, "name": None}) == Gpu("Tesla V100-PCIE-32GB", (7, 0), 16.0)


def test_without_cuda_only_a_whole_simulation_is_a_gpu(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert Gpu.detect() is None and Gpu.detect({"capability": [7, 0]}) is None
    assert Gpu.detect(V100) == Gpu("Tesla V100-SXM2-16GB", (7, 0), 15.8)


def test_a_gpu_without_bf16_runs_the_experiment_s_fp16_variant():
    v100, h100 = Gpu.detect(V100), Gpu.detect(H100)
    train = ["experiment=fast_train", "bench=train_step"]
    assert fit(train, stack_of, h100).overrides == tuple(train) and not fit(train, stack_of, h100).variant
    chosen = fit(train, stack_of, v100)
    assert chosen.overrides == ("experiment=fast_train_fp16", "bench=train_step") and not chosen.reason
    assert chosen.variant == "fast_train_fp16" and "fast_train_fp16" in chosen.note()
    sample = ["experiment=fast_sample", "bench=denoise_step"]  # fp16 already: runs as it is
    assert fit(sample, stack_of, v100) == fit(sample, stack_of, h100) and fp16_variant(sample) is None


@pytest.mark.parametrize(("overrides", "reason"), [
    (["recipe=[tf32,channels_last_3d]"], "recipe 'tf32' is unsupported on this device: TF32: needs CUDA compute "
                                         "capability >= 8.0; Tesla V100-SXM2-16GB has 7.0; drop tf32 on this GPU"),
    (["recipe=[amp_bf16]"], "recipe 'amp_bf16' is unsupported on this device: "),
])
def test_a_stack_the_gpu_refuses_without_a_variant_is_unsupported_with_the_reason(overrides, reason):
    chosen = fit(overrides, stack_of, Gpu.detect(V100))
    assert chosen.reason.startswith(reason) and chosen.overrides == tuple(overrides)
    assert fit(overrides, stack_of, Gpu.detect(H100)).reason == ""


def test_a_row_that_needs_more_memory_than_the_gpu_has_is_unsupported():
    chosen = fit(["recipe=[]", "bench=train_step"], stack_of, Gpu.detect(V100), needs_gib=37.1)
    assert chosen.reason == "needs 37.1 GiB of GPU memory (its measured peak); Tesla V100-SXM2-16GB has 15.8 GiB"
    assert fit(["recipe=[]"], stack_of, Gpu.detect(H100), needs_gib=37.1).reason == ""
    assert fit(["recipe=[amp_bf16]"], stack_of, None, needs_gib=1e6).reason == "", "no GPU to ask: a dry run lists it"


def test_a_gpu_missing_from_the_peak_table_is_one_note():
    assert Gpu.detect(H100).peak_note() is None and Gpu.detect(V100).peak_note() is None
    note = Gpu("NVIDIA RTX PRO 6000 Blackwell", (12, 0), 95.0).peak_note()
    assert note.startswith("note: NVIDIA RTX PRO 6000 Blackwell is not in") and "peak_fraction" in note
