"""How far a profiled step is from its floor: convolution FLOPs at the GPU's matmul rate and
GroupNorm traffic at its memory bandwidth, next to what ``bench.profile`` measured.

A profile says *which* kernels take the time; this says how much of that time is inherent. The
network is walked once on the ``meta`` device (no memory, no compute), so the counts are exact for
any model config and cost nothing:

* **Convolution floor** = FLOPs / matmul rate. A forward is 2·out·(C_in·k³) FLOPs per conv; a
  training step adds the data gradient and the weight gradient, each as large (3× in all).
* **GroupNorm floor** = passes × activation bytes / bandwidth, for the bf16 input of every norm.
  Forward: one read for the statistics, one read and one write to normalise (with SiLU): 3 passes.
  Backward: a read of dy and x for the two reductions (Σdy·γ, Σdy·γ·x̂), then a read of dy and x and
  a write of dx: 5 passes. A training step is 8.

Everything else (attention, up/down-sampling, layout copies, the optimiser) is not modelled: its
floor is taken as 0, so the gap it shows is an upper bound of what fusing it away would save.

The rates are measured on the GPU in use (``measure=true``: a 8192³ bf16 matmul and a 2 GiB copy,
medians of 20), not taken from a datasheet: they are what a kernel here can reach.

Usage:
    python -m bench.experiments.floor measure=true out=/tmp/peaks.json                      # on the GPU
    python -m bench.experiments.floor profile=DIR/train_step_....json peaks=/tmp/peaks.json  # anywhere
        [model=medddpm_whole_head] [out=DIR/floor.md]
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from bench import kernels
from bench.sweep import CONFIG_DIR
from bench.timing import time_fn
from med_ddpm.model import build_model
from med_ddpm.utils import atomic_write_text, env_info, resolve_device

BF16_BYTES = 2
GN_PASSES = {"denoise_step": 3, "train_step": 3 + 5}
CONVS = (torch.nn.Conv1d, torch.nn.Conv3d)  # the attention's qkv/proj are 1-D convs
CONV_PASSES = {"denoise_step": 1, "train_step": 3}
NORM_CATEGORIES = ("elementwise / activation", "normalisation")
MATMUL_N, COPY_BYTES = 8192, 2 << 30


def workload(model_cfg: Mapping[str, Any], batch_size: int = 1) -> dict[str, float]:
    """Forward-pass convolution FLOPs and GroupNorm input bytes (bf16) of one denoiser call."""
    with torch.device("meta"):
        model = build_model(model_cfg)
    counts = {"conv_flops": 0.0, "gn_bytes": 0.0}

    def conv_hook(module: torch.nn.Module, _inp: Any, out: torch.Tensor) -> None:
        counts["conv_flops"] += 2.0 * out.numel() * math.prod(module.weight.shape[1:])

    def norm_hook(_module: torch.nn.Module, inp: tuple[torch.Tensor, ...], _out: Any) -> None:
        counts["gn_bytes"] += BF16_BYTES * inp[0].numel()

    for module in model.modules():
        if isinstance(module, CONVS):
            module.register_forward_hook(conv_hook)
        elif isinstance(module, torch.nn.GroupNorm):
            module.register_forward_hook(norm_hook)
    x = torch.empty(batch_size, model_cfg["in_channels"], *model_cfg["image_size"], device="meta")
    model(x, torch.zeros(batch_size, dtype=torch.long, device="meta"))
    return counts


def floors_ms(counts: Mapping[str, float], scenario: str, peaks: Mapping[str, float]) -> dict[str, float]:
    """Convolution and GroupNorm floors of one step, in ms (see the module docstring)."""
    if scenario not in GN_PASSES:
        raise ValueError(f"bench.experiments.floor: no floor model for scenario {scenario!r}; known: {sorted(GN_PASSES)}")
    return {"convolution": CONV_PASSES[scenario] * counts["conv_flops"] / (peaks["bf16_tflops"] * 1e9),
            "groupnorm": GN_PASSES[scenario] * counts["gn_bytes"] / (peaks["copy_tb_s"] * 1e9)}


def measure_peaks(device: torch.device, n: int = MATMUL_N, nbytes: int = COPY_BYTES) -> dict[str, Any]:
    """The matmul rate (bf16, TFLOP/s) and copy bandwidth (read + write, TB/s) this GPU reaches."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm = time_fn(lambda: a @ a, device=device).median
    src = torch.empty(nbytes // BF16_BYTES, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy = time_fn(lambda: dst.copy_(src), device=device).median
    return {"bf16_tflops": 2 * n**3 / (mm * 1e9), "copy_tb_s": 2 * nbytes / (copy * 1e9), "env": env_info(device)}


def table(profile: Mapping[str, Any], floors: Mapping[str, float], peaks: Mapping[str, float]) -> str:
    """Markdown: measured ms per step against the floor, by the profile's categories."""
    cats = profile["categories_ms"]
    conv = cats["convolution"]  # bench.kernels names: a renamed category fails here, not as a silent 0
    norm = sum(cats[c] for c in NORM_CATEGORIES)
    rest = profile["total_ms"] - conv - norm
    rows = [("convolution", conv, floors["convolution"]), ("GroupNorm and elementwise", norm, floors["groupnorm"]),
            ("everything else (not modelled)", rest, 0.0),
            ("**total**", profile["total_ms"], floors["convolution"] + floors["groupnorm"])]
    lines = [f"## Floor of `{profile['label']}` ({profile['scenario']}, batch {profile['batch_size']})", "",
             f"Rates measured on the GPU: bf16 matmul {peaks['bf16_tflops']:.0f} TFLOP/s, "
             f"copy {peaks['copy_tb_s']:.2f} TB/s (read + write).", "",
             "| kernels | measured (ms/step) | floor (ms/step) | above the floor (ms) |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {ms:.2f} | {floor:.2f} | {ms - floor:.2f} |" for name, ms, floor in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    args = dict(arg.split("=", 1) for arg in argv if "=" in arg)
    if len(args) != len(argv) or not (args.get("measure") == "true" or {"profile", "peaks"} <= set(args)):
        raise SystemExit(__doc__.split("Usage:")[1])
    if args.get("measure") == "true":
        text = json.dumps(measure_peaks(resolve_device("auto")), indent=1)
    else:
        profile = kernels.load_profile(Path(args["profile"]), "bench.experiments.floor")
        peaks = json.loads(Path(args["peaks"]).read_text())
        model_cfg = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "model" / f"{args.get('model', 'medddpm_whole_head')}.yaml"))
        counts = workload(model_cfg, int(profile["batch_size"]))
        text = table(profile, floors_ms(counts, profile["scenario"], peaks), peaks)
    if "out" in args:
        atomic_write_text(Path(args["out"]), text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
