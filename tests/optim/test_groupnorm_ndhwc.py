"""The NDHWC GroupNorm(+SiLU) with a closed-form backward: the exact gradient, and fewer float32 buffers compiled."""

from __future__ import annotations

import pytest
import torch
from conftest import float32_buffers, tiny_batch, tiny_unet, train_step

from optim import ChannelsLast3d, FusedGroupNorm, RecipeConflictError, RecipeStack
from optim.groupnorm_ndhwc import group_norm_act_channels_last, group_norm_act_ndhwc_closed_form

CL = torch.channels_last_3d


def _inputs(dtype: torch.dtype, c: int = 16, affine: bool = True, shape=(2, 3, 4, 5)):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape[0], c, *shape[1:], generator=g, dtype=torch.float64) * 2 + 1)
    x = x.to(dtype).contiguous(memory_format=CL).requires_grad_()
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    w = torch.randn(c, generator=g, dtype=torch.float64).to(pdt).requires_grad_() if affine else None
    b = torch.randn(c, generator=g, dtype=torch.float64).to(pdt).requires_grad_() if affine else None
    return x, w, b


@pytest.mark.parametrize("silu", [True, False], ids=["silu", "plain"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-affine"])
def test_closed_form_backward_is_the_gradient(silu: bool, affine: bool) -> None:
    x, w, b = _inputs(torch.float64, affine=affine)
    inputs = tuple(t for t in (x, w, b) if t is not None)

    def fn(*args):
        return group_norm_act_ndhwc_closed_form(args[0], 4, *(args[1:] if affine else (None, None)), 1e-5, silu)

    assert torch.autograd.gradcheck(fn, inputs)
    dy = torch.randn_like(x)
    ref = torch.autograd.grad(group_norm_act_channels_last(x, 4, w, b, 1e-5, silu), inputs, dy)
    new = torch.autograd.grad(fn(*inputs), inputs, dy)
    for r, n in zip(ref, new, strict=True):
        torch.testing.assert_close(n, r, rtol=0, atol=1e-12 * r.abs().max().item())


def test_bf16_gradients_match_autograds_and_keep_the_layout() -> None:
    x, w, b = _inputs(torch.bfloat16, c=64, shape=(1, 8, 8, 8))
    dy = torch.randn(x.shape, dtype=torch.bfloat16).contiguous(memory_format=CL)
    y_ref = group_norm_act_channels_last(x, 32, w, b, 1e-5, True)
    y = group_norm_act_ndhwc_closed_form(x, 32, w, b, 1e-5, True)
    assert torch.equal(y, y_ref) and y.is_contiguous(memory_format=CL)  # the same forward
    ref = torch.autograd.grad(y_ref, (x, w, b), dy)
    new = torch.autograd.grad(y, (x, w, b), dy)
    assert new[0].dtype == torch.bfloat16 and new[0].is_contiguous(memory_format=CL)
    for r, n in zip(ref, new, strict=True):  # both float32 arithmetic; dx rounds once to bf16
        torch.testing.assert_close(n.float(), r.float(), rtol=0, atol=1e-2 * r.abs().max().item())


@pytest.mark.slow
def test_recipe_option_reaches_every_norm_and_the_step_matches_autograds() -> None:
    x, t, target = tiny_batch()
    results = [train_step(RecipeStack([ChannelsLast3d(), FusedGroupNorm("torch", backward)]), tiny_unet(), x, t, target)
               for backward in ("autograd", "closed_form")]
    # one gradient vector: a conv bias that feeds a GroupNorm has a ~0 gradient (rounding noise)
    ref, new = (torch.cat([r.grads[n].flatten() for n in results[0].grads]) for r in results)
    torch.testing.assert_close(new, ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    torch.testing.assert_close(results[1].output, results[0].output, rtol=0, atol=0)
    recipe = FusedGroupNorm("torch", "closed_form")
    model = recipe.prepare_model(tiny_unet())
    assert {m.ndhwc_backward for m in model.modules() if hasattr(m, "ndhwc_backward")} == {"closed_form"}
    assert recipe.options() == {"impl": "torch", "ndhwc_backward": "closed_form"}
    with pytest.raises(RecipeConflictError, match="ndhwc_backward"):
        FusedGroupNorm(ndhwc_backward="analytic")


def _full_size_float32_buffers(fn, c: int, monkeypatch) -> int:
    """Full-size float32 buffers in inductor's compiled backward of ``fn`` (CPU code, GPU reuse rule,
    realize_reads_threshold 6)."""
    import torch._inductor.ir as ir
    from torch._inductor.utils import run_and_get_code

    # inductor's CPU backend also writes out any reused value that calls sigmoid; its GPU backend
    # decides by read count and size alone (StorageBox.should_realize_on_reuse): use the GPU rule
    monkeypatch.setattr(ir, "is_cpu", lambda *args, **kwargs: False)
    x, w, b = _inputs(torch.bfloat16, c=c, shape=(1, 8, 8, 8))
    dy = torch.randn(x.shape, dtype=torch.bfloat16).contiguous(memory_format=CL)

    def step(x, w, b, dy):
        return torch.autograd.grad(fn(x, 32, w, b, 1e-5, True), (x, w, b), dy)

    torch.compiler.reset()
    _, codes = run_and_get_code(torch.compile(step, options={"realize_reads_threshold": 6}), x, w, b, dy)
    torch.compiler.reset()
    return len(float32_buffers(codes, "cpu", x.numel()))


@pytest.mark.slow  # inductor compiles the forward and backward on the CPU
def test_compiled_closed_form_backward_writes_no_full_size_float32_buffer(monkeypatch) -> None:
    """With inductor's realize_reads_threshold at 6 (compile's ``inductor`` option), the closed form
    compiles to a reduction and a pointwise pass with no float32 intermediate; autograd's form
    writes one (the recomputed pre-activation, 128 channels) whatever the threshold."""
    assert _full_size_float32_buffers(group_norm_act_channels_last, 128, monkeypatch) >= 1
    assert _full_size_float32_buffers(group_norm_act_ndhwc_closed_form, 128, monkeypatch) == 0
