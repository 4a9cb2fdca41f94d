"""RecipeStack: ordering, conflicts, the strict-FP32 baseline, config loading, refusal."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import stack_of

from optim import (
    Amp,
    ChannelsLast3d,
    Checkpointing,
    Compile,
    CudaGraphs,
    DeviceInfo,
    FusedGroupNorm,
    RecipeConflictError,
    RecipeStack,
    SdpaAttention,
    Tf32,
    UnsupportedRecipeError,
)
from optim.flags import effective_flags


def test_order_is_surgery_memory_format_amp_compile_graphs() -> None:
    stack = RecipeStack([CudaGraphs(), Compile(), Amp(), ChannelsLast3d(), Checkpointing(),
                         FusedGroupNorm(), Tf32(), SdpaAttention()])
    assert stack.names == ["tf32", "fused_groupnorm", "sdpa_attention", "checkpointing",
                           "channels_last_3d", "amp", "compile", "cuda_graphs"]


def test_compile_turns_layout_audit_off_with_a_note() -> None:
    cl = ChannelsLast3d(audit=True)
    stack = RecipeStack([Compile(), cl])
    assert not cl.audit and any("audit" in n for n in stack.describe()["notes"])


@pytest.mark.parametrize("pair", [
    (Amp("bfloat16"), Amp("float16")),
    (Tf32(), Tf32()),
    (Compile(mode="reduce-overhead"), CudaGraphs()),
], ids=["two_amp", "duplicate", "reduce_overhead_vs_graphs"])
def test_conflicts_name_both_recipes(pair) -> None:
    with pytest.raises(RecipeConflictError) as err:
        RecipeStack(list(pair))
    for recipe in pair:
        assert type(recipe).__name__ in str(err.value)


def test_bad_options_raise_clearly() -> None:
    for make in (lambda: Amp("float64"), lambda: Compile(mode="fast"), lambda: Checkpointing("some"),
                 lambda: FusedGroupNorm(impl="cuda"), lambda: SdpaAttention(["warp"])):
        with pytest.raises(RecipeConflictError, match="must be one of|unknown"):
            make()
    with pytest.raises(TypeError, match="optim.Recipe"):
        RecipeStack(["tf32"])


def test_baseline_is_strict_fp32_and_restores() -> None:
    before = (torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision)
    stack = RecipeStack([])
    with stack.session():
        assert torch.backends.cudnn.conv.fp32_precision == "ieee"
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        flags = stack.describe()["effective_flags"]
        assert flags["cudnn.conv.fp32_precision"] == flags["cuda.matmul.fp32_precision"] == "ieee"
    assert (torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision) == before
    assert stack.exact and stack.session_flags() == {"cuda.matmul.fp32_precision": "ieee",
                                                     "cudnn.conv.fp32_precision": "ieee"}


def test_session_restores_when_body_raises() -> None:
    before = effective_flags()
    with pytest.raises(RuntimeError, match="boom"), RecipeStack([Tf32()]).session():
        assert effective_flags()["cudnn.conv.fp32_precision"] == "tf32"
        raise RuntimeError("boom")
    assert effective_flags() == before


def test_from_config_empty_and_multi_select() -> None:
    assert RecipeStack.from_config(None).recipes == [] == RecipeStack.from_config({}).recipes
    assert stack_of(("compile", "tf32", "amp_bf16")).names == ["tf32", "amp", "compile"]
    with pytest.raises(RecipeConflictError, match="no _target_"):
        RecipeStack.from_config({"tf32": {"conv": True}})


def test_unsupported_is_refused_with_the_recipe_reason() -> None:
    v100 = DeviceInfo("cuda", (7, 0), "Tesla V100")
    stack = RecipeStack([Tf32(), Amp("bfloat16")])
    ok, reason = stack.supported(v100)
    assert not ok and "tf32" in reason and "7.0" in reason
    with pytest.raises(UnsupportedRecipeError, match="Tesla V100"):
        stack.require(v100)
    assert RecipeStack([Amp("float16")]).supported(v100) == (True, "")
    assert not RecipeStack([CudaGraphs()]).supported("cpu")[0]
    assert stack.supported(DeviceInfo("cuda", (9, 0)))[0]


def test_grad_scaler_and_guard() -> None:
    assert not RecipeStack([]).grad_scaler("cpu").is_enabled()
    assert RecipeStack([Amp("float16")]).grad_scaler("cpu").is_enabled()
    stack = RecipeStack([])
    assert stack.finite_or_skip(torch.tensor(1.0))
    assert not stack.finite_or_skip(torch.tensor(float("nan")))
    assert json.loads(json.dumps(stack.describe()))["skipped_steps"] == 1
