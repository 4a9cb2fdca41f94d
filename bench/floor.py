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

The rates are measured on the GPU that ran the profile (``measure=true``, which refuses without a CUDA GPU: a
8192³ bf16 matmul and a 2 GiB copy, medians of 20), not taken from a datasheet: they are what a kernel there can
reach. The table names that GPU (``peaks.json``'s ``env.gpu``).

Run (options in configs/floor.yaml; docs/benchmarking.md)::

    python -m bench.floor measure=true output_dir=results/peaks                    # on the GPU: peaks.json
    python -m bench.floor profile=PROFILE.json peaks=results/peaks/peaks.json      # anywhere: floor.md

``PROFILE.json`` is the JSON file (``<scenario>_<label>.json``) that ``bench.profile`` wrote for a train_step
or denoise_step. It records the network it timed (``model``), the batch and the network calls per step, and
the floor is counted for those; ``model=`` is needed only for a profile written before it recorded its network,
and must then name the network that profile timed. A ``model=`` other than the recorded one is refused, and so is
a floor above its measured time: either means the profile, the network and the peaks do not belong together.
Each run prints its result and writes it into ``output_dir`` (default: Hydra's run directory,
``outputs/floor/<time>``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from bench.core import kernels
from bench.core.timing import time_fn
from med_ddpm import cli
from med_ddpm.config_checks import ConfigError, check_bool, read_json_option
from med_ddpm.model import build_model
from med_ddpm.utils import atomic_write_text, env_info

BF16_BYTES = 2
GN_PASSES = {"denoise_step": 3, "train_step": 3 + 5}
CONVS = (torch.nn.Conv1d, torch.nn.Conv3d)  # the attention's qkv/proj are 1-D convs
CONV_PASSES = {"denoise_step": 1, "train_step": 3}
NORM_CATEGORIES = ("elementwise / activation", "normalisation")
ROWS = {"convolution": "convolution", "groupnorm": "GroupNorm and elementwise", "rest": "everything else (not modelled)"}
MATMUL_N, COPY_BYTES = 8192, 2 << 30
PEAKS_FIX = "pass the peaks.json that `python -m bench.floor measure=true` wrote on the GPU that ran the profile"
PROFILE_FIX = ("pass the peaks.json measured on the GPU that ran the profile (and, for a profile that does not "
               "record its network, the model= it timed)")


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
        raise ConfigError(f"profile: a {scenario} profile has no floor model; pass a profile of "
                          f"{' or '.join(GN_PASSES)}")
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


def measured_ms(profile: Mapping[str, Any]) -> dict[str, float]:
    """The profile's ms per step in the floor's rows (keys of :data:`ROWS`)."""
    cats = profile["categories_ms"]
    conv = cats["convolution"]  # bench.core.kernels names: a renamed category fails here, not as a silent 0
    norm = sum(cats[c] for c in NORM_CATEGORIES)
    return {"convolution": conv, "groupnorm": norm, "rest": profile["total_ms"] - conv - norm}


def check_below(measured: Mapping[str, float], floors: Mapping[str, float], path: str) -> None:
    """A floor above its measured time means the profile, the network and the rates do not belong together."""
    for key, floor_ms in floors.items():
        if floor_ms > measured[key]:
            raise ConfigError(f"profile={path}: the {ROWS[key]} floor ({floor_ms:.2f} ms) is above the "
                              f"{measured[key]:.2f} ms measured, so the profile, the network and peaks= do not "
                              f"belong together; {PROFILE_FIX}")


def table(profile: Mapping[str, Any], measured: Mapping[str, float], floors: Mapping[str, float],
          peaks: Mapping[str, Any]) -> str:
    """Markdown: measured ms per step (:func:`measured_ms`) against the floor, by the profile's categories."""
    rows = [(name, measured[key], floors.get(key, 0.0)) for key, name in ROWS.items()]
    rows.append(("**total**", profile["total_ms"], sum(floors.values())))
    calls = profile.get("model_calls", 1)
    lines = [f"## Floor of `{profile['label']}` ({profile['scenario']}, batch {profile['batch_size']}"
             + (f", {calls} micro-batches" if calls > 1 else "") + ")", "",
             f"Rates measured on the {peaks['env']['gpu']}: bf16 matmul {peaks['bf16_tflops']:.0f} TFLOP/s, "
             f"copy {peaks['copy_tb_s']:.2f} TB/s (read + write).", "",
             "| kernels | measured (ms/step) | floor (ms/step) | above the floor (ms) |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {ms:.2f} | {floor:.2f} | {ms - floor:.2f} |" for name, ms, floor in rows]
    return "\n".join(lines) + "\n"


def read_peaks(path: str) -> dict[str, Any]:
    """The rates a ``measure=true`` run wrote on a GPU (option ``peaks``)."""
    peaks = read_json_option("peaks", path, PEAKS_FIX)
    if not isinstance(peaks, dict) or not {"bf16_tflops", "copy_tb_s"} <= set(peaks):
        raise ConfigError(f"peaks={path}: no bf16_tflops and copy_tb_s; {PEAKS_FIX}")
    gpu = peaks["env"].get("gpu") if isinstance(peaks.get("env"), dict) else None
    if not isinstance(gpu, str):
        raise ConfigError(f"peaks={path}: not measured on a GPU (env.gpu is {gpu!r}); {PEAKS_FIX}")
    return peaks


def model_name(model_cfg: Mapping[str, Any]) -> str:
    """The configs/model/NAME.yaml that ``model_cfg`` is, or ``overridden`` for none."""
    files = sorted((cli.CONFIG_DIR / "model").glob("*.yaml"))
    return next((f.stem for f in files if OmegaConf.to_container(OmegaConf.load(f)) == model_cfg), "overridden")


def network(cfg: DictConfig, profile: Mapping[str, Any]) -> dict[str, Any]:
    """The model config the profile timed: the one it records, else (an older profile) ``model=``'s."""
    given = None if cfg.model is None else OmegaConf.to_container(cfg.model, resolve=True)
    recorded = profile.get("model")
    if recorded is None and given is None:
        raise ConfigError(f"profile={cfg.profile}: does not record the network it timed (written before profiles "
                          "did); pass model=NAME, the network that bench.profile run timed")
    if recorded is not None and given is not None and given != recorded:
        diffs = ", ".join(f"{k} {given.get(k)} here, {recorded.get(k)} there"
                          for k in sorted(given.keys() | recorded.keys()) if given.get(k) != recorded.get(k))
        raise ConfigError(f"model={model_name(given)}: not the network profile={cfg.profile} timed "
                          f"(model={model_name(recorded)}: {diffs}); leave model= out, the profile records its network")
    return recorded if recorded is not None else given


def floor_table(cfg: DictConfig) -> str:
    """The markdown table of ``cfg.profile`` against the floors of the network it timed at ``cfg.peaks``' rates."""
    profile = kernels.load_profile(Path(cfg.profile), "profile")
    peaks = read_peaks(cfg.peaks)
    if profile.get("activity") != "GPU kernels":
        raise ConfigError(f"profile={cfg.profile}: times {profile.get('activity')!r}, not GPU kernels; pass a "
                          "profile that bench.profile wrote on the GPU")
    volumes = int(profile["batch_size"]) * int(profile.get("model_calls", 1))
    floors = floors_ms(workload(network(cfg, profile), volumes), profile["scenario"], peaks)
    measured = measured_ms(profile)
    check_below(measured, floors, cfg.profile)
    return table(profile, measured, floors, peaks)


def check_mode(cfg: DictConfig) -> bool:
    """Whether to measure (``measure=true``) rather than read a profile; either one, with all it needs."""
    if check_bool(cfg, "measure"):
        if cfg.profile is not None:
            raise ConfigError(f"measure=true and profile={cfg.profile}: measure=true only measures this GPU's "
                              "rates; pass one of them")
        if not torch.cuda.is_available():
            raise ConfigError("measure=true: needs a CUDA GPU, and this machine has none; use the peaks.json "
                              "measured on the GPU that ran the profile (peaks=PEAKS.json)")
        return True
    for key in ("profile", "peaks"):
        if cfg[key] is None:
            raise ConfigError(f"{key}: has no value; pass profile=PROFILE.json peaks=PEAKS.json, or measure=true "
                              "on the GPU")
    return False


@hydra.main(config_path=cli.CONFIG_PATH, config_name="floor", version_base="1.3")
@cli.entry
def main(cfg: DictConfig) -> None:
    measure = check_mode(cfg)
    out = cli.output_dir(cfg)
    text = json.dumps(measure_peaks(torch.device("cuda")), indent=1) if measure else floor_table(cfg)
    print(text)
    print(atomic_write_text(out / ("peaks.json" if measure else "floor.md"), text))


if __name__ == "__main__":
    cli.run(main)
