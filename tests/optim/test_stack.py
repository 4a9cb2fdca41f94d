"""RecipeStack: ordering, conflicts, the strict-FP32 baseline, config loading, refusal; all from Capabilities."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import stack_of

from optim import (
    Amp,
    Capabilities,
    ChannelsLast3d,
    Checkpointing,
    Compile,
    DeviceInfo,
    FusedGroupNorm,
    Recipe,
    RecipeConflictError,
    RecipeStack,
    SdpaAttention,
    Tf32,
    UnsupportedRecipeError,
)
from optim.flags import effective_flags


def test_order_is_surgery_memory_format_amp_compile() -> None:
    stack = RecipeStack([Compile(), Amp(), ChannelsLast3d(), Checkpointing(), FusedGroupNorm(), Tf32(), SdpaAttention()])
    assert stack.names == ["tf32", "fused_groupnorm", "sdpa_attention", "checkpointing",
                           "channels_last_3d", "amp_bf16", "compile"]


@pytest.mark.parametrize(("names", "kind"), [
    (("amp_bf16", "amp_fp16"), "amp"),
    (("compile", "compile_cudagraphs"), "compile"),
], ids=["two_amp", "two_compile"])
def test_two_recipes_of_a_kind_are_refused_by_their_config_names(names, kind) -> None:
    with pytest.raises(RecipeConflictError, match=f"recipes '{names[0]}' and '{names[1]}' cannot be combined "
                                                  f"\\(at most one '{kind}' recipe per stack\\)"):
        stack_of(names)
    with pytest.raises(RecipeConflictError, match="at most one 'tf32'"):
        RecipeStack([Tf32(), Tf32()])


def test_bad_options_raise_clearly() -> None:
    for make in (lambda: Amp("float64"), lambda: Compile(mode="fast"), lambda: Compile(mode="max-autotune"),
                 lambda: Checkpointing("some"), lambda: FusedGroupNorm(impl="cuda"), lambda: SdpaAttention(["warp"])):
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
    assert stack_of(("compile", "tf32", "amp_bf16")).names == ["tf32", "amp_bf16", "compile"]
    with pytest.raises(RecipeConflictError, match="no _target_"):
        RecipeStack.from_config({"tf32": {"conv": True}})


def test_unsupported_is_refused_with_the_recipe_reason() -> None:
    v100 = DeviceInfo("cuda", (7, 0), "Tesla V100")
    stack = RecipeStack([Tf32(), Amp("bfloat16")])
    ok, reason = stack.supported(v100)
    assert not ok and reason.startswith("recipe 'tf32' is unsupported on this device: TF32: needs CUDA compute "
                                        "capability >= 8.0; Tesla V100 has 7.0; drop tf32 on this GPU")
    with pytest.raises(UnsupportedRecipeError, match="Tesla V100"):
        stack.require(v100)
    assert RecipeStack([Amp("float16")]).supported(v100) == (True, "")
    assert stack.supported(DeviceInfo("cuda", (9, 0)))[0]


def test_graph_capture_with_gradient_accumulation_is_refused_by_name() -> None:
    stack = stack_of(["amp_bf16", "compile_cudagraphs"])
    stack.require_training(1)
    with pytest.raises(RecipeConflictError, match=r"recipe 'compile_cudagraphs' cannot train with "
                                                  r"train.grad_accum=2: .*PyTorch issue 169545.*train.grad_accum=1"):
        stack.require_training(2)
    stack_of(["compile"]).require_training(2)


class _Declares(Recipe):
    """A recipe that is nothing but data, as a third-party recipe would be."""

    def __init__(self, name: str, **capabilities) -> None:
        self.name, self.capabilities = name, Capabilities(**capabilities)


def test_declared_flags_and_inductor_config_are_set_for_the_session_and_restored() -> None:
    from torch._inductor import config

    before = config.realize_reads_threshold
    stack = RecipeStack([_Declares("reads", inductor={"realize_reads_threshold": before + 3}),
                         _Declares("bench", flags={"cudnn.benchmark": True})])
    with stack.session():
        assert config.realize_reads_threshold == before + 3 and torch.backends.cudnn.benchmark
    assert config.realize_reads_threshold == before and not torch.backends.cudnn.benchmark
    assert stack.describe()["inductor"] == {"realize_reads_threshold": before + 3}
    with pytest.raises(RecipeConflictError, match="recipes 'reads' and 'other' cannot be combined: they set "
                                                  "inductor's realize_reads_threshold"):
        RecipeStack([stack.recipes[0], _Declares("other", inductor={"realize_reads_threshold": 8})])
    with pytest.raises(RecipeConflictError, match="they set the flag cudnn.benchmark"):
        RecipeStack([stack.recipes[1], _Declares("other", flags={"cudnn.benchmark": False})])


def test_grad_scaler_and_guard() -> None:
    assert not RecipeStack([]).grad_scaler("cpu").is_enabled()
    assert RecipeStack([_Declares("scaled", scales_loss=True)]).grad_scaler("cpu").is_enabled()
    stack = RecipeStack([])
    assert stack.finite_or_skip(torch.tensor(1.0))
    assert not stack.finite_or_skip(torch.tensor(float("nan")))
    assert json.loads(json.dumps(stack.describe()))["skipped_steps"] == 1


def test_compiling_stacks_say_their_first_call_is_slow() -> None:
    assert stack_of(["compile"]).describe()["slow_first_call"]
    assert not stack_of(["tf32"]).describe()["slow_first_call"]
