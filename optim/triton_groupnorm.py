"""Triton GroupNorm(+SiLU) forward that fills the GPU at batch 1 (split reduction, two passes).

PyTorch's GroupNorm statistics kernel launches one block per (sample, group): N x G = 32 blocks
at batch 1 on a 132-SM GPU, each reducing Cg·D·H·W ≈ 4 M elements at 128³: the largest share of
an eager bf16 step's GPU time. Here every (n, g) group is split over ``SPLIT`` programs:

1. ``_partial_stats``: each program reduces one chunk to (count, mean, M2) with tile-wise
   Welford/Chan merging (numerically stable, unlike sum/sum-of-squares, for 4 M elements);
2. ``_normalize``: each program merges its group's SPLIT partials (Chan et al. 1979, parallel
   variance: mean = Σ nᵢ·meanᵢ / n, M2 = Σ M2ᵢ + nᵢ·(meanᵢ - mean)²), then normalises its chunk,
   applies the affine transform and SiLU and casts to the output dtype in one pass. The first
   program of each group also stores the merged float32 mean and rstd = 1/sqrt(var + eps), so
   the lean backward of :mod:`optim.fused_groupnorm` reuses them (``return_stats=True``).

A cold Triton cache compiles each kernel once per dtype, layout, SiLU and affine choice, not once per layer shape
(a cold sampling job's first call pays each compile): the split and the channels per group are runtime arguments
Triton does not specialise on, and ``_normalize`` merges its group's partials padded to ``PARTS`` (at least
:data:`MIN_PARTS`, masked).

Statistics and arithmetic are float32 whatever the input dtype (GroupNorm32 semantics).
Inputs are read as (N, C, S) with arbitrary strides, so NCDHW and channels_last_3d (and the
attention block's (B, C, T)) are handled without copies; the chunk walks channels-fastest when
channels are the contiguous dimension, spatial-fastest otherwise, so loads stay coalesced.

This module imports ``triton`` at import time; :mod:`optim.fused_groupnorm` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
PROGRAMS_PER_SM = 8
MAX_SPLIT = 1024
MIN_PARTS = 64  # the partials a program merges, padded: one compiled kernel for every split up to it


@triton.jit
def _element_offsets(idx, n, g, Cg, S, stride_n, stride_c, stride_s, CHANNELS_FAST: tl.constexpr):
    if CHANNELS_FAST:
        c = idx % Cg
        s = idx // Cg
    else:
        c = idx // S
        s = idx % S
    ch = g * Cg + c
    return n.to(tl.int64) * stride_n + ch.to(tl.int64) * stride_c + s.to(tl.int64) * stride_s, ch


@triton.jit(do_not_specialize=["Cg", "split"])
def _partial_stats(x_ptr, stats_ptr, G, Cg, S, chunk, split, stride_n, stride_c, stride_s,
                   BLOCK: tl.constexpr, CHANNELS_FAST: tl.constexpr):
    group = tl.program_id(0)
    part = tl.program_id(1)
    n = group // G
    g = group % G
    total = Cg * S
    start = part * chunk
    count = tl.zeros((), tl.float32)
    mean = tl.zeros((), tl.float32)
    m2 = tl.zeros((), tl.float32)
    for off in range(0, chunk, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = (idx < total) & (idx < start + chunk)
        ptrs, _ = _element_offsets(idx, n, g, Cg, S, stride_n, stride_c, stride_s, CHANNELS_FAST)
        x = tl.load(x_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
        tile_n = tl.sum(mask.to(tl.float32), axis=0)
        tile_mean = tl.sum(x, axis=0) / tl.maximum(tile_n, 1.0)
        tile_m2 = tl.sum(tl.where(mask, (x - tile_mean) * (x - tile_mean), 0.0), axis=0)
        new_n = count + tile_n
        delta = tile_mean - mean
        frac = tile_n / tl.maximum(new_n, 1.0)
        mean = mean + delta * frac
        m2 = m2 + tile_m2 + delta * delta * count * frac
        count = new_n
    base = (group * split + part) * 3
    tl.store(stats_ptr + base, count)
    tl.store(stats_ptr + base + 1, mean)
    tl.store(stats_ptr + base + 2, m2)


@triton.jit(do_not_specialize=["Cg", "split"])
def _normalize(x_ptr, y_ptr, w_ptr, b_ptr, stats_ptr, mean_ptr, rstd_ptr, G, Cg, S, chunk, split, eps,
               stride_n, stride_c, stride_s, ystride_n, ystride_c, ystride_s,
               PARTS: tl.constexpr, BLOCK: tl.constexpr, CHANNELS_FAST: tl.constexpr,
               SILU: tl.constexpr, AFFINE: tl.constexpr):
    group = tl.program_id(0)
    part = tl.program_id(1)
    n = group // G
    g = group % G
    parts = tl.arange(0, PARTS)
    live = parts < split  # a missing partial has count 0: it adds nothing below
    counts = tl.load(stats_ptr + (group * split + parts) * 3, mask=live, other=0.0)
    means = tl.load(stats_ptr + (group * split + parts) * 3 + 1, mask=live, other=0.0)
    m2s = tl.load(stats_ptr + (group * split + parts) * 3 + 2, mask=live, other=0.0)
    total_n = tl.sum(counts, axis=0)
    mean = tl.sum(counts * means, axis=0) / total_n
    m2 = tl.sum(m2s + counts * (means - mean) * (means - mean), axis=0)
    rstd = 1.0 / tl.sqrt(m2 / total_n + eps)  # biased variance, as nn.GroupNorm
    if part == 0:  # every program of the group computed the same values; one of them keeps them
        tl.store(mean_ptr + group, mean)
        tl.store(rstd_ptr + group, rstd)
    total = Cg * S
    start = part * chunk
    for off in range(0, chunk, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = (idx < total) & (idx < start + chunk)
        ptrs, ch = _element_offsets(idx, n, g, Cg, S, stride_n, stride_c, stride_s, CHANNELS_FAST)
        yptrs, _ = _element_offsets(idx, n, g, Cg, S, ystride_n, ystride_c, ystride_s, CHANNELS_FAST)
        x = tl.load(x_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
        y = (x - mean) * rstd
        if AFFINE:
            w = tl.load(w_ptr + ch, mask=mask, other=1.0).to(tl.float32)
            b = tl.load(b_ptr + ch, mask=mask, other=0.0).to(tl.float32)
            y = y * w + b
        if SILU:
            y = y * tl.sigmoid(y)
        tl.store(y_ptr + yptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _viewable_ncs(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it can be viewed as (N, C, S) (NCDHW, NDHWC, (B, C, T)), else a copy."""
    try:
        t.view(t.shape[0], t.shape[1], -1)
        return t
    except RuntimeError:
        return t.contiguous()


def _split(groups: int, elements: int, device: torch.device) -> tuple[int, int]:
    """How many programs per group (a power of two) and the chunk each one reduces."""
    # (the interpreter, TRITON_INTERPRET=1, runs on CPU tensors: pretend to have a few SMs)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    want = max(1, (sms * PROGRAMS_PER_SM) // groups)
    most = max(1, triton.cdiv(elements, BLOCK))
    split = triton.next_power_of_2(min(want, most))
    split = min(split, MAX_SPLIT)
    chunk = triton.cdiv(triton.cdiv(elements, split), BLOCK) * BLOCK
    return split, chunk


def group_norm_act_triton(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None,
                          bias: torch.Tensor | None, eps: float, silu: bool,
                          out_dtype: torch.dtype, return_stats: bool = False
                          ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GroupNorm (fp32 statistics) + optional SiLU, output in ``out_dtype`` and ``x``'s layout.

    With ``return_stats``, returns ``(y, mean, rstd)``: the per-(sample, group) float32 mean and
    1/sqrt(biased var + eps), each of shape (N, num_groups), as the kernel used them.
    """
    n, c = x.shape[:2]
    if c % num_groups:
        raise ValueError(f"GroupNorm: {c} channels not divisible by {num_groups} groups")
    x = _viewable_ncs(x)
    y = torch.empty_like(x, dtype=out_dtype)  # keeps x's memory format (dense x)
    x3, y3 = x.view(n, c, -1), y.view(n, c, -1)
    cg, s = c // num_groups, x3.shape[2]
    split, chunk = _split(n * num_groups, cg * s, x.device)
    stats = torch.empty(n * num_groups * split * 3, device=x.device, dtype=torch.float32)
    mean = torch.empty(n, num_groups, device=x.device, dtype=torch.float32)
    rstd = torch.empty(n, num_groups, device=x.device, dtype=torch.float32)
    channels_fast = x3.stride(1) < x3.stride(2)
    grid = (n * num_groups, split)
    _partial_stats[grid](x3, stats, num_groups, cg, s, chunk, split, *x3.stride(),
                         BLOCK=BLOCK, CHANNELS_FAST=channels_fast)
    affine = weight is not None
    _normalize[grid](x3, y3, weight if affine else x3, bias if affine else x3, stats, mean, rstd,
                     num_groups, cg, s, chunk, split, eps, *x3.stride(), *y3.stride(),
                     PARTS=max(MIN_PARTS, split), BLOCK=BLOCK, CHANNELS_FAST=channels_fast, SILU=silu, AFFINE=affine)
    return (y, mean, rstd) if return_stats else y
