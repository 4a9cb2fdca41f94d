"""Kernel microbenchmarks behind four choices: GroupNorm32 + SiLU forms and backwards, the end convolutions, upsampling.

The whole-step profiles (``bench.profile``) say *which* kernels cost; this times the candidates
for one of them in isolation, at the whole-head network's full-resolution shapes (batch 1, one
activation of C channels at size³), so a form can be chosen before a ladder run re-times the step:

* **GroupNorm32 + SiLU** (C = 64 and 128): ``F.group_norm`` on float32, eager and compiled
  (NCDHW, what Med-DDPM runs); ``fused_groupnorm``'s NDHWC form compiled
  (:func:`optim.fused_groupnorm.group_norm_act_channels_last`); on CUDA its Triton kernel in both
  layouts. Each row has the max abs error against float32 ``F.group_norm`` and the effective
  bandwidth of one read and one write of the activation (``tb_s_rw``; the real traffic is larger:
  the statistics read it once more).
* **GroupNorm32 + SiLU forward + backward in NDHWC** (``kinds=groupnorm_backward``): the compiled
  NDHWC form with autograd's backward and with :mod:`optim.groupnorm_ndhwc`'s closed form, each at
  inductor's default ``realize_reads_threshold`` and at 6 (where the closed form keeps the
  recomputed pre-activation inline instead of writing it in float32), with dx's error against
  float32 autograd.
* **The network's end convolutions** in NDHWC, forward and forward + backward: 3 -> 64 (input) and
  64 -> 1 (output) as cuDNN runs them, and the output one as ``narrow_conv_gemm``'s GEMM + col2im
  (compiled, as in the network).
* **Trilinear ×2 upsampling against batch size** (64 channels, size/2 -> size, NDHWC, batch 1/2/4,
  after a residual add as in the decoder): ``F.interpolate`` and ``gather_upsample``'s separable
  gather forward (:func:`optim.upsample.trilinear_x2_forward`), compiled; ``ms_per_volume`` shows
  whether a form's cost grows with the batch.

Run (options in configs/micro.yaml; docs/benchmarking.md)::

    python -m bench.micro                                       # every kind at 128³: bf16 (CUDA) / float32 (CPU)
    python -m bench.micro size=16 compile=false                 # a quick check
    python -m bench.micro 'kinds=[conv]'                        # only the end convolutions
    python -m bench.micro 'kinds=[groupnorm_backward]'          # only the GroupNorm backward forms

Prints each row as a JSON line and writes ``micro.json`` (environment and rows) atomically into ``output_dir``
(default: Hydra's run directory, ``outputs/micro/<time>``); a failing case becomes a row with ``error``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from bench.core.timing import time_fn
from med_ddpm import cli
from med_ddpm.config_checks import ConfigError, check_bool, check_int, check_one_of
from med_ddpm.utils import atomic_write_text, env_info, resolve_device
from optim.cudnn_benchmark import cudnn_benchmark_enabled
from optim.fused_groupnorm import (
    forward_stats_triton,
    group_norm_act_channels_last,
    group_norm_act_torch,
    triton_available,
)
from optim.groupnorm_ndhwc import group_norm_act_ndhwc_closed_form
from optim.narrow_conv import gemm_conv_forward
from optim.upsample import trilinear_x2_forward, trilinear_x2_reference

GROUPS, EPS = 32, 1e-5
CHANNELS = (64, 128)
UPSAMPLE_BATCHES = (1, 2, 4)
NDHWC_BACKWARDS = {"autograd": group_norm_act_channels_last, "closed_form": group_norm_act_ndhwc_closed_form}
REALIZE_READS_THRESHOLDS = (None, 6)  # None: inductor's default (4)
CL = torch.channels_last_3d
Case = tuple[str, Callable[..., torch.Tensor], torch.Tensor]


# Med-DDPM's GroupNorm32 (float32 statistics, cast back) + SiLU as the model runs it: on an NCDHW
# input ``group_norm_act_torch`` is exactly silu(F.group_norm(x.float()).type(x.dtype)).
group_norm_silu = functools.partial(group_norm_act_torch, silu=True)
_ndhwc = functools.partial(group_norm_act_channels_last, silu=True)


def _triton(x: torch.Tensor, groups: int, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    return forward_stats_triton(x, groups, w, b, eps, True)[0]


def _compiled(fn: Callable[..., torch.Tensor], **inductor: Any) -> Callable[..., torch.Tensor]:
    # layout optimisation off, as the compile recipe's "auto" does for NDHWC models
    return torch.compile(fn, options={"layout_optimization": False, **inductor})


def groupnorm_cases(x: torch.Tensor, compile: bool) -> Iterator[Case]:
    """(form, function, input) for each GroupNorm + SiLU form that runs on x's device."""
    x_cl = x.contiguous(memory_format=CL)
    yield "eager NCDHW composite", group_norm_silu, x
    if compile:
        yield "compiled NCDHW composite", _compiled(group_norm_silu), x
        yield "compiled NDHWC form (fused_groupnorm)", _compiled(_ndhwc), x_cl
    if x.is_cuda and triton_available():
        yield "eager Triton NCDHW", _triton, x
        yield "eager Triton NDHWC", _triton, x_cl


def time_ms(fn: Callable[[], object], device: torch.device, iters: int) -> dict[str, float]:
    t = time_fn(fn, warmup=5, iters=iters, device=device)
    return {"ms_median": t.median, "ms_p10": t.p10, "ms_p90": t.p90}


def groupnorm_rows(size: int, dtype: torch.dtype, device: torch.device, compile: bool, iters: int) -> Iterator[dict]:
    gen = torch.Generator().manual_seed(0)
    for c in CHANNELS:
        x = (torch.randn(1, c, size, size, size, generator=gen) * 2 + 0.5).to(device, dtype)
        w, b = torch.randn(c, generator=gen).to(device), torch.randn(c, generator=gen).to(device)
        ref = group_norm_silu(x.float(), GROUPS, w, b, EPS)
        for form, fn, inp in groupnorm_cases(x, compile):
            row: dict[str, Any] = {"kind": "groupnorm_silu", "channels": c, "form": form}
            try:
                call = functools.partial(fn, inp, GROUPS, w, b, EPS)
                out = call()
                row.update(time_ms(call, device, iters),
                           max_abs_err=(out.float() - ref).abs().max().item(),
                           out_channels_last=out.is_contiguous(memory_format=CL) and not out.is_contiguous())
                row["tb_s_rw"] = 2 * x.numel() * x.element_size() / (row["ms_median"] * 1e-3) / 1e12
            except Exception as err:  # one failing form is a row, not the end of the run
                row["error"] = repr(err)[:300]
            yield row


def _gn_grads(form: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
              grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(form(x, GROUPS, w, b, EPS, True), (x, w, b), grad)


def groupnorm_backward_rows(size: int, dtype: torch.dtype, device: torch.device, compile: bool,
                            iters: int) -> Iterator[dict]:
    """NDHWC GroupNorm32 + SiLU, forward + backward (dx, dw, db), per backward form and inductor threshold."""
    gen = torch.Generator().manual_seed(0)
    thresholds = REALIZE_READS_THRESHOLDS if compile else (None,)
    for c in CHANNELS:
        x = (torch.randn(1, c, size, size, size, generator=gen) * 2 + 0.5).to(device, dtype).contiguous(memory_format=CL)
        w, b = torch.randn(c, generator=gen).to(device), torch.randn(c, generator=gen).to(device)
        grad = torch.randn(x.shape, generator=gen).to(device, dtype).contiguous(memory_format=CL)
        x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
        ref = _gn_grads(group_norm_act_channels_last, x.detach().float().requires_grad_(), w, b, grad.float())[0]
        for (name, form), threshold in ((f, t) for f in NDHWC_BACKWARDS.items() for t in thresholds):
            row: dict[str, Any] = {"kind": "groupnorm_silu_fwd_bwd", "channels": c, "backward": name,
                                   "compiled": compile, "realize_reads_threshold": threshold}
            try:
                inductor = {} if threshold is None else {"realize_reads_threshold": threshold}
                fn = _compiled(functools.partial(_gn_grads, form), **inductor) if compile else functools.partial(
                    _gn_grads, form)
                call = functools.partial(fn, x, w, b, grad)
                row.update(time_ms(call, device, iters), max_abs_err=(call()[0].float() - ref).abs().max().item())
            except Exception as err:
                row["error"] = repr(err)[:300]
            yield row


def end_conv_cases(size: int, dtype: torch.dtype, device: torch.device, compile: bool
                   ) -> Iterator[tuple[str, nn.Conv3d, Callable[[torch.Tensor], torch.Tensor], torch.Tensor]]:
    """(label, conv, form, input) for each way of computing the two end convolutions: as cuDNN runs
    them, and the output conv as ``narrow_conv_gemm``'s GEMM + col2im (compiled, as in the network)."""
    gen = torch.Generator().manual_seed(0)
    for label, cin, cout in (("input 3->64", 3, 64), ("output 64->1", 64, 1)):
        conv = nn.Conv3d(cin, cout, 3, padding=1).to(device, dtype, memory_format=CL)
        x = torch.randn(1, cin, size, size, size, generator=gen).to(device, dtype).contiguous(memory_format=CL)
        x.requires_grad_(cin == 64)  # the network's input takes no gradient; its last activation does
        yield label, conv, conv, x
        if cout == 1:
            gemm = functools.partial(gemm_conv_forward, conv=conv)
            yield f"{label} via narrow_conv_gemm (col2im)", conv, _compiled(gemm) if compile else gemm, x


def _forward_backward(form: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grad: torch.Tensor) -> None:
    form(x).backward(grad)


def conv_rows(size: int, dtype: torch.dtype, device: torch.device, compile: bool, iters: int) -> Iterator[dict]:
    """Each end-convolution form's forward, and forward + backward as a training step runs it (the
    weight gradient, and the input gradient for the output conv), with its error against the conv."""
    for label, conv, form, x in end_conv_cases(size, dtype, device, compile):
        for pass_ in ("forward", "forward+backward"):
            row: dict[str, Any] = {"kind": "conv3d", "conv": label, "pass": pass_}
            try:
                if pass_ == "forward":
                    with torch.no_grad():
                        row.update(time_ms(functools.partial(form, x), device, iters),
                                   max_abs_err=(form(x).float() - conv(x).float()).abs().max().item())
                else:
                    row.update(time_ms(functools.partial(_forward_backward, form, x, torch.ones_like(form(x))),
                                       device, iters))
            except Exception as err:
                row["error"] = repr(err)[:300]
            yield row


def upsample_rows(size: int, dtype: torch.dtype, device: torch.device, compile: bool, iters: int) -> Iterator[dict]:
    """``add + trilinear x2`` (64 channels, NDHWC) per batch size, as ``F.interpolate`` and as the gather
    forward; ``ms_per_volume`` shows whether a form scales with the batch."""
    gen = torch.Generator().manual_seed(0)
    forms = {"F.interpolate": trilinear_x2_reference, "gather forward": trilinear_x2_forward}
    for form, upsample in forms.items():
        def block(a: torch.Tensor, b: torch.Tensor, up: Callable[..., torch.Tensor] = upsample) -> torch.Tensor:
            return up(a + b)
        fn = _compiled(block) if compile else block
        for batch in UPSAMPLE_BATCHES:
            a, b = (torch.randn(batch, 64, *(3 * [size // 2]), generator=gen).to(device, dtype).contiguous(memory_format=CL)
                    for _ in range(2))
            row: dict[str, Any] = {"kind": "upsample_x2", "form": form, "batch": batch, "compiled": compile}
            try:
                call = functools.partial(fn, a, b)
                out = call()
                row.update(time_ms(call, device, iters),
                           max_abs_err=(out.float() - trilinear_x2_reference((a + b).float())).abs().max().item(),
                           out_channels_last=out.is_contiguous(memory_format=CL))
                row["ms_per_volume"] = row["ms_median"] / batch
            except Exception as err:
                row["error"] = repr(err)[:300]
            yield row


KINDS = {"groupnorm": groupnorm_rows, "groupnorm_backward": groupnorm_backward_rows, "conv": conv_rows,
         "upsample": upsample_rows}


def run(out: Path, size: int = 128, compile: bool = True, iters: int = 30, kinds: tuple[str, ...] = tuple(KINDS)) -> Path:
    """Time the ``kinds`` of rows (keys of :data:`KINDS`) and write ``out/micro.json``."""
    device = resolve_device("auto")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with cudnn_benchmark_enabled():  # as the cudnn_benchmark recipe: the convs' best algorithm
        rows = [row for kind in kinds for row in KINDS[kind](size, dtype, device, compile, iters)]
    for row in rows:
        print(json.dumps(row), flush=True)
    record = {"env": env_info(device), "size": size, "dtype": str(dtype), "groups": GROUPS, "rows": rows}
    return atomic_write_text(out / "micro.json", json.dumps(record, indent=1))


def check_kinds(cfg: DictConfig) -> tuple[str, ...]:
    """``kinds``: a list of :data:`KINDS` keys (or one key)."""
    kinds = tuple(cfg.kinds) if OmegaConf.is_list(cfg.kinds) else (cfg.kinds,)
    if not kinds:
        raise ConfigError(f"kinds=[]: no rows to time; pass kinds=[...] with some of {', '.join(KINDS)}")
    return tuple(check_one_of("kinds", kind, list(KINDS)) for kind in kinds)


@hydra.main(config_path=cli.CONFIG_PATH, config_name="micro", version_base="1.3")
@cli.entry
def main(cfg: DictConfig) -> None:
    kinds, size, iters = check_kinds(cfg), check_int(cfg, "size", 2), check_int(cfg, "iters", 1)
    print(run(cli.output_dir(cfg), size, check_bool(cfg, "compile"), iters, kinds))


if __name__ == "__main__":
    cli.run(main)
