"""Recipe-specific behaviour the contract test cannot see: keys, layouts, deepcopy, swaps."""

from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_batch, tiny_unet

from optim import (
    AttentionCore,
    ChannelsLast3d,
    CudnnBenchmark,
    FusedGroupNorm,
    FusedGroupNormAct,
    RecipeConflictError,
    RecipeStack,
    SdpaAttentionCore,
    Tf32,
    TorchDefaults,
    apply_checkpointing,
    effective_flags,
    fuse_groupnorm,
    is_channels_last_3d,
    use_sdpa_attention,
)
from optim.amp import autocast_for
from optim.fused_groupnorm import group_norm_act_torch


def test_surgery_keeps_state_dict_keys_and_counts() -> None:
    model = tiny_unet()
    keys = list(model.state_dict())
    counts = fuse_groupnorm(model, impl="torch")
    assert counts["fused_silu"] > 0 and counts["plain"] > 0
    assert not [m for m in model.modules() if type(m) is torch.nn.GroupNorm or
                (isinstance(m, torch.nn.GroupNorm) and not isinstance(m, FusedGroupNormAct))]
    assert use_sdpa_attention(model) > 0 and not [m for m in model.modules() if type(m) is AttentionCore]
    assert len(apply_checkpointing(model, "all")) > 0
    assert list(model.state_dict()) == keys
    model.load_state_dict(tiny_unet(seed=3).state_dict())  # strict load still works


def test_checkpointing_all_includes_the_upsample() -> None:
    from med_ddpm.model import Upsample

    model = tiny_unet()
    upsamples = {n for n, m in model.named_modules() if isinstance(m, Upsample)}
    assert upsamples and upsamples <= set(apply_checkpointing(model, "all"))
    assert not upsamples & set(apply_checkpointing(tiny_unet(), "resblocks"))


def test_checkpointed_deepcopy_runs_the_copy() -> None:
    model = tiny_unet()
    with torch.no_grad():  # the output conv is zero-initialised: make the output non-zero
        for p in model.parameters():
            p.normal_(0, 0.05)
    apply_checkpointing(model, "resblocks")
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.zero_()
    x, t, _ = tiny_batch(batch=1)
    with torch.no_grad():
        assert ema(x, t).abs().max() == 0 and model(x, t).abs().max() > 0


def test_fused_groupnorm_matches_groupnorm32_under_bf16_autocast() -> None:
    x = torch.randn(2, 64, 4, 4, 4)
    norm = torch.nn.GroupNorm(32, 64)
    fused = FusedGroupNormAct.from_groupnorm(norm, "silu", "torch")
    with autocast_for("bfloat16", "cpu"):
        ref = F.silu(norm(x.bfloat16().float()).type(torch.bfloat16))
        out = fused(x.bfloat16())
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    assert torch.equal(group_norm_act_torch(x, 32, None, None, 1e-5, False), F.group_norm(x, 32))


@pytest.mark.parametrize("affine", [True, False])
def test_channels_last_group_norm_keeps_the_layout_and_the_maths(affine: bool) -> None:
    """NDHWC input: same values as GroupNorm32 on the NCDHW copy, and NDHWC out (no relayout)."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 48, 5, 6, 7, generator=gen) * 3 + 1).contiguous(memory_format=torch.channels_last_3d)
    w, b = (torch.randn(48, generator=gen), torch.randn(48, generator=gen)) if affine else (None, None)
    out = group_norm_act_torch(x, 16, w, b, 1e-5, True)
    ref = F.silu(F.group_norm(x.contiguous(), 16, w, b, 1e-5))
    assert out.is_contiguous(memory_format=torch.channels_last_3d) and not out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_sdpa_core_matches_reference_scale() -> None:
    q, k, v = (torch.randn(2, 1, 64, 16) for _ in range(3))
    torch.testing.assert_close(SdpaAttentionCore()(q, k, v), AttentionCore()(q, k, v), rtol=1e-5, atol=1e-6)


def test_sdpa_core_hands_the_fused_kernels_unit_stride_channels(monkeypatch) -> None:
    """Med-DDPM's q, k, v are transposed views (channel stride T); flash / efficient / cuDNN
    attention refuse those and PyTorch falls back to a float32 math kernel. The core must pass
    stride-1 channels, without changing the result."""
    b, c, t = 1, 8, 64
    qkv = torch.randn(b, 3 * c, t)
    q, k, v = qkv.reshape(b, 1, 3 * c, t).transpose(-1, -2).split(c, dim=-1)  # as AttentionBlock does
    assert q.stride(-1) == t
    expected = AttentionCore()(q, k, v)
    seen: list[int] = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: seen.extend(x.stride(-1) for x in a) or sdpa(*a, **kw))
    out = SdpaAttentionCore()(q, k, v)
    assert seen == [1, 1, 1]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_channels_last_audit_reports_where_layout_is_lost() -> None:
    recipe = ChannelsLast3d(audit=True)
    model = recipe.prepare_model(tiny_unet())
    x, t, _ = tiny_batch(batch=1)
    with torch.no_grad():
        model(recipe.prepare_input(x), t)
        report = recipe.describe()["layout_audit"]
        assert report["done"] and report["checked_5d_outputs"] > 0
        assert isinstance(report["lost_layout"], list)
        model(recipe.prepare_input(x), t)
        assert recipe.describe()["layout_audit"]["checked_5d_outputs"] == report["checked_5d_outputs"], \
            "the audit records the first forward only"
    assert is_channels_last_3d(recipe.prepare_input(x)) and recipe.prepare_input(t) is t


def test_channels_last_audit_does_nothing_while_dynamo_traces() -> None:
    """Under compile the audit's hooks are traced: they must record nothing and never change (no recompile)."""
    recipe = ChannelsLast3d(audit=True)
    model = recipe.prepare_model(torch.nn.Sequential(torch.nn.Conv3d(2, 4, 1), torch.nn.SiLU()))
    compiled = torch.compile(model, backend="eager")
    x = recipe.prepare_input(torch.randn(1, 2, 3, 3, 3))
    for _ in range(2):
        compiled(x)
    torch.compiler.reset()
    report = recipe.describe()["layout_audit"]
    assert report["done"] and report["checked_5d_outputs"] == 0


def test_reduce_overhead_compile_marks_a_step_and_clones_the_output(monkeypatch) -> None:
    """CUDA-graph trees overwrite outputs on the next replay; samplers keep past eps, so the
    reduce-overhead wrapper must start a new step per call and hand back its own copy."""
    from optim.compile import compile_model

    marks: list[int] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)  # the wrapper, not inductor
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    shared = torch.zeros(3)

    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return shared.add_(x)  # returns the same storage every call, as a graph replay does

    graphed = compile_model(Net(), mode="reduce-overhead")
    first = graphed(torch.ones(3))
    second = graphed(torch.ones(3))
    assert marks == [1, 1]
    assert first.data_ptr() != shared.data_ptr() and torch.equal(first, torch.ones(3))
    assert torch.equal(second, torch.full((3,), 2.0))
    plain = compile_model(Net(), mode="default")
    assert plain(torch.ones(3)).data_ptr() == shared.data_ptr() and marks == [1, 1]


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compile_keeps_channels_last_3d_strides_by_switching_inductor_layout_optimisation_off(
        monkeypatch, mode) -> None:
    """Inductor's layout optimisation is 2-D only and, when on, unpins 3-D conv input strides, so
    an NDHWC model pays cuDNN layout conversions; ``auto`` must turn it off for NDHWC weights only,
    keep the mode's own options, and leave an NCDHW model to inductor's heuristic."""
    from optim.compile import Compile, compile_model

    calls: list[dict] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    compile_model(tiny_unet().to(memory_format=torch.channels_last_3d), mode=mode)
    mode_options = torch._inductor.list_mode_options(mode)
    assert calls[-1]["options"] == {**mode_options, "layout_optimization": False} and "mode" not in calls[-1]
    compile_model(tiny_unet(), mode=mode)
    assert calls[-1]["mode"] == mode and "options" not in calls[-1]
    compile_model(tiny_unet(), mode=mode, layout_optimization=True)
    assert calls[-1]["options"]["layout_optimization"] is True
    recipe = Compile(mode=mode)
    recipe.prepare_model(tiny_unet().to(memory_format=torch.channels_last_3d))
    assert recipe.describe()["inductor_layout_optimization"] is False
    with pytest.raises(ValueError, match="layout_optimization"):
        Compile(layout_optimization="sometimes")


def test_compile_passes_extra_inductor_config_with_the_mode_and_layout_options(monkeypatch) -> None:
    """``inductor={...}`` (e.g. coordinate-descent tuning of the Triton kernels) joins the mode's own
    options and the layout setting; names inductor does not know, or the layout key itself, are refused."""
    from optim.compile import Compile, compile_model

    calls: list[dict] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    tuned = {"coordinate_descent_tuning": True}
    compile_model(tiny_unet().to(memory_format=torch.channels_last_3d), mode="reduce-overhead", inductor=tuned)
    assert calls[-1]["options"] == {**torch._inductor.list_mode_options("reduce-overhead"),
                                    "layout_optimization": False, "coordinate_descent_tuning": True}
    compile_model(tiny_unet(), inductor=tuned)  # NCDHW: inductor keeps its layout heuristic
    assert calls[-1]["options"] == tuned and "mode" not in calls[-1]
    assert Compile(inductor=tuned).describe()["inductor"] == tuned
    with pytest.raises(ValueError, match="coordinate_descent_tunning"):
        Compile(inductor={"coordinate_descent_tunning": True})
    with pytest.raises(ValueError, match="layout_optimization option"):
        compile_model(tiny_unet(), inductor={"layout_optimization": True})
    with pytest.raises(ValueError, match="need backend 'inductor'"):
        Compile(backend="eager", inductor=tuned)


def test_closed_form_groupnorm_declares_its_inductor_threshold(monkeypatch) -> None:
    """``fused_groupnorm(ndhwc_backward=closed_form)`` needs inductor's ``realize_reads_threshold`` 6
    (tests/optim/test_groupnorm_ndhwc.py): it declares it, the stack's session sets it for every compile, and a
    compile's own ``inductor`` option goes to ``torch.compile`` (so it wins)."""
    from torch._inductor import config

    from optim.compile import Compile

    calls: list[dict] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    stack = RecipeStack([Compile(mode="reduce-overhead"), FusedGroupNorm(ndhwc_backward="closed_form")])
    assert stack.inductor_options() == {"realize_reads_threshold": 6}
    with stack.session():
        assert config.realize_reads_threshold == 6
    assert RecipeStack([Compile(), FusedGroupNorm()]).inductor_options() == {}
    RecipeStack([Compile(inductor={"realize_reads_threshold": 4})]).prepare_model(tiny_unet())
    assert calls[-1]["options"]["realize_reads_threshold"] == 4


def test_fused_groupnorm_resolves_triton_once_outside_forward(monkeypatch) -> None:
    """``triton_available`` is cached; called in forward, Dynamo warns when it traces the call. It is asked once,
    when the module is built, and forward reads the answer."""
    import optim.fused_groupnorm as fgn

    calls: list[int] = []
    monkeypatch.setattr(fgn, "triton_available", lambda: calls.append(1) or True)
    norm = FusedGroupNormAct(4, 8, impl="auto")
    assert calls == [1]
    assert norm.resolved_impl(SimpleNamespace(is_cuda=True)) == "triton"
    assert norm.resolved_impl(SimpleNamespace(is_cuda=False)) == "torch"
    assert FusedGroupNormAct(4, 8, impl="torch").resolved_impl(SimpleNamespace(is_cuda=True)) == "torch"
    assert calls == [1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_fused_groupnorm_traces_without_a_dynamo_warning(device: str) -> None:
    model = torch.nn.Sequential(torch.nn.GroupNorm(4, 8), torch.nn.SiLU()).to(device)
    fuse_groupnorm(model, impl="auto")
    torch._dynamo.utils.warn_once_cache.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = torch.compile(model, backend="eager")(torch.randn(1, 8, 4, 4, 4, device=device))
    torch.compiler.reset()
    assert y.shape == (1, 8, 4, 4, 4)
    assert not [str(w.message) for w in caught if "Dynamo" in str(w.message)]


def test_cudnn_benchmark_limit_times_every_engine_and_restores() -> None:
    before = (torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit)
    with RecipeStack([CudnnBenchmark(limit=0)]).session():
        assert torch.backends.cudnn.benchmark and torch.backends.cudnn.benchmark_limit == 0
    assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit) == before
    assert "cudnn.benchmark_limit" not in CudnnBenchmark().capabilities.flags  # null keeps torch's default
    with pytest.raises(ValueError, match="limit must be a non-negative int"):
        CudnnBenchmark(limit=-1)


def test_torch_defaults_sets_torch_defaults_over_the_strict_baseline_and_restores() -> None:
    """Inside the session: conv TF32 on, matmul IEEE, benchmark off, whatever the process set before; the previous
    raw values come back on exit. tf32 and cudnn_benchmark set those flags otherwise: the stack refuses each pair."""
    with RecipeStack([CudnnBenchmark()]).session():  # a process that changed the defaults earlier
        before = effective_flags()
        with RecipeStack([TorchDefaults()]).session():
            inside = effective_flags()
        assert effective_flags() == before
    assert (inside["cudnn.conv.fp32_precision"], inside["cuda.matmul.fp32_precision"]) == ("tf32", "ieee")
    assert inside["cudnn.benchmark"] is False
    for other in (Tf32(), CudnnBenchmark()):
        with pytest.raises(RecipeConflictError, match="'torch_defaults' and|and 'torch_defaults'"):
            RecipeStack([TorchDefaults(), other])
