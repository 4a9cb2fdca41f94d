"""The lean GroupNorm(+SiLU) autograd Function on CPU: the closed-form, group-chunked backward
against autograd of the torch composite, gradcheck, and what it keeps in memory.

The Function's forward kernel is pluggable; here it is ``forward_stats_torch`` (the Triton kernel
returns the same ``(y, mean, rstd)`` on CUDA), so this is the backward code CUDA runs.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from optim import FusedGroupNormAct
from optim.fused_groupnorm import (
    BACKWARD_CHUNKS,
    FORWARD_KERNELS,
    forward_stats_torch,
    group_chunks,
    group_norm_act_lean,
    group_norm_act_torch,
)

EPS = 1e-5
# (batch, channels, spatial, groups, backward chunks); min_chunk_elements=0 forces the chunks
CASES = [
    (2, 64, (4, 5, 6), 32, 8),
    (1, 48, (3, 4, 5), 12, 5),  # 12 groups in slices of 3: 4 slices, groups not divisible by chunks
    (2, 36, (3, 3, 4), 6, 4),  # slices of 2 groups, the last one too
    (1, 32, (5, 5, 5), 32, 1),  # one slice (no chunking)
    (3, 16, (2, 3, 4), 16, 16),  # one group per slice
    (2, 24, (7,), 6, 4),  # (B, C, T), as the attention block's norm
]


def _inputs(batch, channels, spatial, dtype, channels_last, affine, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, channels, *spatial, generator=g) * 3 + 2).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    w = torch.randn(channels, generator=g) if affine else None
    b = torch.randn(channels, generator=g) if affine else None
    grad = torch.randn(batch, channels, *spatial, generator=g).to(dtype)
    return x, w, b, grad


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]


def _grads(fn, x, w, b, grad):
    x, w, b = _leaves(x, w, b)
    y = fn(x, w, b)
    wanted = [t for t in (x, w, b) if t is not None]
    return y, torch.autograd.grad(y, wanted, grad), x


def _assert_scaled_close(name, got, ref, rtol):
    err = (got.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    assert err <= rtol * scale + 1e-12, f"{name}: max|diff| {err:.3g} > {rtol} * max|ref| {scale:.3g}"


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["ncdhw", "ndhwc"])
@pytest.mark.parametrize("silu", [True, False], ids=["silu", "plain"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "noaffine"])
def test_lean_backward_matches_autograd_of_the_composite(case, dtype, channels_last, silu, affine) -> None:
    batch, channels, spatial, groups, chunks = case
    if channels_last and len(spatial) != 3:
        pytest.skip("channels_last_3d is a 5-D layout")
    x, w, b, grad = _inputs(batch, channels, spatial, dtype, channels_last, affine)
    y, got, x_leaf = _grads(lambda x, w, b: group_norm_act_lean(x, groups, w, b, EPS, silu, "torch", chunks, 0),
                            x, w, b, grad)
    ref_y, ref, _ = _grads(lambda x, w, b: group_norm_act_torch(x, groups, w, b, EPS, silu), x, w, b, grad)
    if channels_last:  # the NDHWC composite rounds its statistics in another order: bf16 y may
        # then round one ulp apart (relative 2^-7 at most; near zero, one ulp of the pre-SiLU y)
        rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2**-7, 2**-8)
        torch.testing.assert_close(y, ref_y, rtol=rtol, atol=atol)
    else:
        assert torch.equal(y, ref_y), "the torch forward kernel must reproduce the composite exactly"
    assert got[0].dtype == dtype and got[0].stride() == x_leaf.stride(), "dx keeps x's dtype and layout"
    rtol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the composite rounds y and its grads to bf16
    for name, a, r in zip(("dx", "dw", "db"), got, ref):
        assert a.dtype == r.dtype
        _assert_scaled_close(name, a, r, rtol)


def test_lean_backward_in_bf16_is_closer_to_the_exact_gradient_than_the_tolerance() -> None:
    """bf16 input: against the float32 gradient of the same (bf16-valued) x, only dx's cast remains."""
    x, w, b, grad = _inputs(2, 64, (4, 4, 4), torch.bfloat16, False, True)
    _, got, _ = _grads(lambda x, w, b: group_norm_act_lean(x, 32, w, b, EPS, True, "torch", 8, 0), x, w, b, grad)
    _, exact, _ = _grads(lambda x, w, b: torch.nn.functional.silu(torch.nn.functional.group_norm(x, 32, w, b, EPS)),
                         x.float(), w, b, grad.float())
    _assert_scaled_close("dx", got[0], exact[0], 8e-3)  # one bf16 rounding
    _assert_scaled_close("dw", got[1], exact[1], 1e-5)
    _assert_scaled_close("db", got[2], exact[2], 1e-5)


@pytest.mark.parametrize("silu", [True, False], ids=["silu", "plain"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "noaffine"])
def test_gradcheck_float64(silu, affine) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 8, 3, 2, 2, dtype=torch.float64, generator=g).requires_grad_()
    w = torch.randn(8, dtype=torch.float64, generator=g).requires_grad_() if affine else None
    b = torch.randn(8, dtype=torch.float64, generator=g).requires_grad_() if affine else None
    inputs = tuple(t for t in (x, w, b) if t is not None)

    def fn(*args):
        x, w, b = (*args, None, None) if len(args) == 1 else args
        return group_norm_act_lean(x, 4, w, b, EPS, silu, "torch", 3, 0)  # slices of 2, 2 groups

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, True), (False, True, False)],
                         ids=["x-only", "params-only", "weight-only"])
def test_only_the_wanted_gradients(needs) -> None:
    x, w, b, grad = _inputs(2, 32, (3, 4, 5), torch.float32, False, True)
    leaves = [t.detach().clone().requires_grad_(n) for t, n in zip((x, w, b), needs)]
    refs = [t.detach().clone().requires_grad_(n) for t, n in zip((x, w, b), needs)]
    got = torch.autograd.grad(group_norm_act_lean(*leaves[:1], 8, *leaves[1:], EPS, True, "torch", 4, 0),
                              [t for t in leaves if t.requires_grad], grad)
    ref = torch.autograd.grad(group_norm_act_torch(*refs[:1], 8, *refs[1:], EPS, True),
                              [t for t in refs if t.requires_grad], grad)
    for a, r in zip(got, ref):
        _assert_scaled_close("grad", a, r, 1e-5)


def _saved_bytes(fn, *args) -> tuple[int, list[tuple[torch.dtype, int]]]:
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(t.numel() * t.element_size() for t in saved), [(t.dtype, t.numel()) for t in saved]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_saves_x_in_its_own_dtype_and_no_float32_copy(dtype) -> None:
    x, w, b, _ = _inputs(2, 64, (8, 8, 8), dtype, False, True)
    x, w, b = _leaves(x, w, b)
    total, saved = _saved_bytes(lambda: group_norm_act_lean(x, 32, w, b, EPS, True, "torch"))
    x_bytes = x.numel() * x.element_size()
    small = 2 * 64 * 4 + 2 * 2 * 32 * 4  # weight, bias; (N, G) mean and rstd
    assert total <= x_bytes + small, saved
    assert [s for s in saved if s[1] >= x.numel()] == [(dtype, x.numel())], "x itself, nothing else full-size"
    if dtype == torch.bfloat16:  # the composite does keep float32 copies: the hook sees them
        composite, _ = _saved_bytes(lambda: group_norm_act_torch(x, 32, w, b, EPS, True))
        assert composite >= x_bytes + x.numel() * 4


class _LargestFloat32(TorchDispatchMode):
    """Records the largest float32 tensor any op produces while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def _largest_float32_in_backward(x, w, b, grad, groups, chunks, min_chunk_elements=0) -> int:
    x, w, b = _leaves(x, w, b)
    y = group_norm_act_lean(x, groups, w, b, EPS, True, "torch", chunks, min_chunk_elements)
    with _LargestFloat32() as mode:
        torch.autograd.grad(y, [x, w, b], grad)
    return mode.largest


@pytest.mark.parametrize("groups,chunks", [(32, 8), (12, 8), (6, 4)])
def test_backward_float32_temporaries_are_one_slice_of_groups(groups, chunks) -> None:
    x, w, b, grad = _inputs(1, 48 if groups != 32 else 64, (6, 6, 6), torch.bfloat16, False, True)
    slice_numel = math.ceil(groups / chunks) * x.numel() // groups
    assert _largest_float32_in_backward(x, w, b, grad, groups, chunks) <= slice_numel
    # the bound bites: unchunked, the backward makes float32 tensors the size of x
    assert _largest_float32_in_backward(x, w, b, grad, groups, 1) == x.numel()


def test_small_activations_are_not_split_below_the_minimum_slice() -> None:
    x, w, b, grad = _inputs(1, 64, (4, 4, 4), torch.bfloat16, False, True)
    assert _largest_float32_in_backward(x, w, b, grad, 32, 8, min_chunk_elements=x.numel()) == x.numel()
    assert _largest_float32_in_backward(x, w, b, grad, 32, 8, min_chunk_elements=x.numel() // 4) == x.numel() // 4


def test_group_chunks() -> None:
    assert group_chunks(32) == [(g, g + 4) for g in range(0, 32, 4)] and BACKWARD_CHUNKS == 8
    assert group_chunks(12, 5) == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert group_chunks(6, 8) == [(g, g + 1) for g in range(6)]
    assert group_chunks(32, 8, numel=100, min_chunk_elements=1000) == [(0, 32)]
    assert group_chunks(32, 8, numel=4000, min_chunk_elements=1000) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    with pytest.raises(ValueError):
        group_chunks(32, 0)


def test_module_triton_impl_runs_the_lean_function(monkeypatch) -> None:
    """FusedGroupNormAct(impl="triton") goes through the lean Function (kernel swapped for torch's
    here), also under bf16 autocast; "auto" on CPU stays on the composite."""
    monkeypatch.setitem(FORWARD_KERNELS, "triton", forward_stats_torch)
    norm = torch.nn.GroupNorm(32, 64)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(2, 64, 4, 4, 4).bfloat16()
    grad = torch.randn(2, 64, 4, 4, 4).bfloat16()
    results = []
    for impl in ("triton", "torch"):
        fused = FusedGroupNormAct.from_groupnorm(norm, "silu", impl)
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            y = fused(xi)
        assert y.dtype == torch.bfloat16
        is_lean = type(y.grad_fn).__name__.startswith("_GroupNormActFn")
        assert is_lean == (impl == "triton")
        results.append((y, *torch.autograd.grad(y, [xi, norm.weight, norm.bias], grad)))
    assert torch.equal(results[0][0], results[1][0])
    for name, a, r in zip(("dx", "dw", "db"), results[0][1:], results[1][1:]):
        _assert_scaled_close(name, a, r, 2e-2)
    assert FusedGroupNormAct(32, 64, impl="auto").resolved_impl(x) == "torch"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["ncdhw", "ndhwc"])
def test_triton_kernel_stats_and_lean_backward_on_gpu(dtype, channels_last) -> None:
    """On CUDA: the Triton kernel's mean/rstd match torch's, and the Function with the Triton
    forward gives the composite's gradients (chunked backward, 12 groups in slices of 3)."""
    from optim.fused_groupnorm import forward_stats_triton

    if not torch.cuda.is_available():
        pytest.fail("gpu-marked test run without CUDA")
    x, w, b, grad = (t.cuda() for t in _inputs(2, 48, (8, 12, 10), dtype, channels_last, True))
    y, mean, rstd = forward_stats_triton(x, 12, w, b, EPS, True)
    _, ref_mean, ref_rstd = forward_stats_torch(x, 12, w, b, EPS, True)
    assert mean.shape == rstd.shape == (2, 12) and mean.dtype == rstd.dtype == torch.float32
    torch.testing.assert_close(mean, ref_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd, ref_rstd, rtol=1e-5, atol=1e-5)
    _, got, x_leaf = _grads(lambda x, w, b: group_norm_act_lean(x, 12, w, b, EPS, True, "triton", 5, 0),
                            x, w, b, grad)
    _, ref, _ = _grads(lambda x, w, b: group_norm_act_torch(x, 12, w, b, EPS, True), x, w, b, grad)
    assert got[0].dtype == dtype and got[0].stride() == x_leaf.stride()
    rtol = 1e-4 if dtype == torch.float32 else 2e-2
    for name, a, r in zip(("dx", "dw", "db"), got, ref):
        _assert_scaled_close(name, a, r, rtol)


@pytest.mark.gpu
def test_lean_backward_peak_memory_on_gpu() -> None:
    """bf16 x of 16 Mi elements, 8 slices: backward allocates dx (1 x the bytes of x) plus at most
    three float32 slices (3 x 2/8), far below the composite's full-size float32 copies."""
    if not torch.cuda.is_available():
        pytest.fail("gpu-marked test run without CUDA")
    x, w, b, grad = (t.cuda() for t in _inputs(1, 64, (64, 64, 64), torch.bfloat16, False, True))
    x, w, b = _leaves(x, w, b)
    y = group_norm_act_lean(x, 32, w, b, EPS, True, "triton", 8, 0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y.backward(grad)
    torch.cuda.synchronize()
    x_bytes = x.numel() * x.element_size()
    assert torch.cuda.max_memory_allocated() - before <= 2.25 * x_bytes
