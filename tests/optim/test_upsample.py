"""gather_upsample: the closed-form gather is the exact gradient of trilinear x2 interpolation."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_batch, tiny_unet

from med_ddpm.model import Upsample
from optim import use_gather_upsample
from optim.upsample import (
    GatherUpsample,
    adjoint_x2,
    interpolate_x2,
    trilinear_x2_backward,
    trilinear_x2_forward,
    trilinear_x2_gather,
    trilinear_x2_gather_both,
    trilinear_x2_reference,
)

SHAPES = [(1, 1, 1, 1, 1), (2, 3, 1, 2, 3), (1, 2, 4, 5, 6), (2, 1, 3, 3, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gather_backward_is_the_gradient_of_f_interpolate(shape) -> None:
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    g = torch.randn(*shape[:2], *(2 * s for s in shape[2:]), dtype=torch.float64)
    (ref,) = torch.autograd.grad(trilinear_x2_reference(x), x, g)
    torch.testing.assert_close(trilinear_x2_backward(g, torch.float64), ref, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(trilinear_x2_gather, (x[:, :, :3, :3, :3].detach().requires_grad_(),))


def test_one_axis_adjoint_by_hand() -> None:
    """n = 2: out = [x0, .75x0 + .25x1, .25x0 + .75x1, x1], so dx = (g0 + .75g1 + .25g2, .25g1 + .75g2 + g3)."""
    g = torch.tensor([[1.0, 10.0, 100.0, 1000.0]], dtype=torch.float64)
    assert adjoint_x2(g, 1).tolist() == [[1 + 7.5 + 25, 2.5 + 75 + 1000]]
    torch.testing.assert_close(adjoint_x2(torch.ones(1, 6), 1), torch.full((1, 3), 2.0))  # weights sum to 2


def test_forward_is_bit_identical_and_bf16_gradient_is_within_rounding() -> None:
    x = torch.randn(1, 4, 5, 6, 7).contiguous(memory_format=torch.channels_last_3d).requires_grad_()
    assert torch.equal(trilinear_x2_gather(x), trilinear_x2_reference(x))
    xb = x.detach().bfloat16().requires_grad_()
    g = torch.randn(1, 4, 10, 12, 14)
    (ours,) = torch.autograd.grad(trilinear_x2_gather(xb), xb, g.bfloat16())
    (ref,) = torch.autograd.grad(trilinear_x2_reference(x), x, g.bfloat16().float())
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), ref, rtol=1e-2, atol=1e-2)  # one bf16 rounding of the float32 sum
    with pytest.raises(ValueError, match="N, C, D, H, W"):
        trilinear_x2_gather(torch.randn(1, 2, 3, 4))


def test_one_axis_interpolation_by_hand() -> None:
    """n = 3: out = [x0, .75x0 + .25x1, .25x0 + .75x1, .75x1 + .25x2, .25x1 + .75x2, x2] (clamped edges)."""
    x = torch.tensor([[4.0, 8.0, 16.0]], dtype=torch.float64)
    assert interpolate_x2(x, 1).tolist() == [[4.0, 5.0, 7.0, 10.0, 14.0, 16.0]]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gather_forward_matches_f_interpolate_and_keeps_the_layout(shape) -> None:
    x = torch.randn(shape, dtype=torch.float64)
    torch.testing.assert_close(trilinear_x2_forward(x), trilinear_x2_reference(x), rtol=1e-12, atol=1e-12)
    xc = torch.randn(2, 8, 3, 4, 5).contiguous(memory_format=torch.channels_last_3d)
    assert trilinear_x2_forward(xc).stride() == trilinear_x2_reference(xc).stride()
    assert trilinear_x2_forward(xc.contiguous()).is_contiguous()
    xb = xc.bfloat16()  # float32 inside, one rounding to bf16: within one bf16 ulp of F.interpolate
    torch.testing.assert_close(trilinear_x2_forward(xb), trilinear_x2_reference(xb), rtol=8e-3, atol=1e-6)
    xr = x[:, :, :3, :3, :3].detach().requires_grad_()
    assert torch.autograd.gradcheck(trilinear_x2_gather_both, (xr,))


def test_recipe_option_picks_the_forward_and_rejects_unknown_ones() -> None:
    model = tiny_unet()
    recipe = GatherUpsample(forward="gather")
    recipe.prepare_model(model)
    assert recipe.describe()["forward"] == "gather" and recipe.swapped > 0
    assert all(m.interpolate is trilinear_x2_gather_both for m in model.modules() if isinstance(m, Upsample))
    with pytest.raises(ValueError, match="forward must be one of"):
        GatherUpsample(forward="nearest")
    with pytest.raises(ValueError, match="forward must be one of"):
        use_gather_upsample(model, forward="scatter")


@pytest.mark.slow
def test_the_unet_upsamples_are_swapped_keys_kept_and_gradients_equal() -> None:
    ref, model = tiny_unet(), tiny_unet()  # identical, every layer non-zero (randomize_zero_init)
    keys = list(model.state_dict())
    upsamples = [m for m in model.modules() if isinstance(m, Upsample)]
    assert use_gather_upsample(model) == len(upsamples) > 0 and list(model.state_dict()) == keys
    assert all(m.interpolate is trilinear_x2_gather for m in upsamples)
    assert all(m.interpolate is not trilinear_x2_gather for m in copy.deepcopy(ref).modules() if isinstance(m, Upsample))
    x, t, target = tiny_batch(batch=2)
    grads = []
    for net in (ref, model):
        torch.nn.functional.l1_loss(net(x, t), target).backward()
        grads.append([p.grad for p in net.parameters()])
    scale = max(a.abs().max().item() for a in grads[0])  # the whole gradient vector's, as the contract test
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6 * scale)
    ema = copy.deepcopy(model)
    assert all(m.interpolate is trilinear_x2_gather for m in ema.modules() if isinstance(m, Upsample))


@pytest.mark.slow
def test_compiled_training_traces_the_gather_backward() -> None:
    """Under torch.compile (what the recipe is for) dynamo traces the autograd.Function and inductor
    compiles its backward; the gradients still match eager F.interpolate (about 40 s on 2 CPU cores)."""
    from optim.compile import compile_model

    ref = tiny_unet()
    model = copy.deepcopy(ref)
    use_gather_upsample(model)
    compile_model(model)
    x, t, target = tiny_batch(batch=2)
    for net in (ref, model):
        torch.nn.functional.l1_loss(net(x, t), target).backward()
    scale = max(p.grad.abs().max().item() for p in ref.parameters())
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5 * scale)
