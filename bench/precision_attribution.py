"""Where a reduced-precision ε error comes from: the error attributed to groups of modules.

bf16 autocast moves the network's ε away from strict FP32. To choose which modules to keep in float32 (an fp32
island) this command measures, on identical inputs x_t (phantoms noised to a few t), the ε error against strict
FP32 of:

* ``all``: the whole network under autocast;
* ``all but G``: autocast everywhere except the modules of group G, which run in float32 (their inputs cast
  up): the error G is responsible for is ``all`` minus this;
* ``only G``: float32 everywhere except group G under autocast.

Groups: ``groupnorm`` (every GroupNorm), ``time_embedding`` (the timestep MLP), ``attention`` (the attention
blocks), ``output_conv`` (the final GroupNorm + SiLU + conv), ``input_conv`` (the first conv, which reads
x_t), ``residual_convs`` (every other Conv3d). The error is the relative L2 of ε and the per-sample slope of ε
on the FP32 ε (a scale bias: see :mod:`med_ddpm.quality.gate`). The remainder not explained by any group is
accumulation across groups.

Run (options in configs/precision_attribution.yaml; docs/quality.md)::

    python -m bench.precision_attribution model=tiny device=cpu n=1
    python -m bench.precision_attribution model=quality_model checkpoint=runs/quality_model/checkpoints/last.pt

It prints the table and writes ``precision_attribution.json`` (the errors, the config, the environment and the
commit) into ``output_dir`` (default: Hydra's run directory, ``outputs/precision_attribution/<time>``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from bench.core.records import provenance
from med_ddpm import cli
from med_ddpm.config_checks import check_choice, check_device, check_int
from med_ddpm.data.phantoms import SyntheticPhantoms
from med_ddpm.model import INPUT_CONV
from med_ddpm.quality.probe import gate_model
from med_ddpm.quality.stats import per_sample_fit
from med_ddpm.utils import atomic_write_text, env_info, json_safe, resolve_device

GROUPS: dict[str, Callable[[str, nn.Module], bool]] = {
    "groupnorm": lambda name, m: isinstance(m, nn.GroupNorm),
    "time_embedding": lambda name, m: name == "time_embed",
    "attention": lambda name, m: type(m).__name__ == "AttentionBlock",
    "output_conv": lambda name, m: name == "out",
    "input_conv": lambda name, m: name == INPUT_CONV,
    "residual_convs": lambda name, m: isinstance(m, nn.Conv3d) and name != INPUT_CONV and not name.startswith("out."),
}
PROBE_FRACTIONS = (0.0, 0.5, 0.96)  # t / T: low noise, middle, near pure noise
DTYPES = ("bfloat16", "float16")  # the autocast dtypes measured against float32


def members(model: nn.Module, group: str) -> list[nn.Module]:
    """The modules of ``group`` (outermost ones: a member's children are not listed again)."""
    found: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if GROUPS[group](name, m) and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, m))
    return [m for _, m in found]


@contextlib.contextmanager
def autocast_except(modules: list[nn.Module], device: torch.device, dtype: torch.dtype,
                    inside: bool) -> Iterator[None]:
    """Autocast on everywhere but ``modules`` (``inside=False``: an fp32 island, inputs cast up), or only
    inside them (``inside=True``: their outputs cast back to float32 for the float32 network around them).
    Each module's own ``forward`` is restored on exit."""
    def wrapped(forward):
        def island(*args, **kwargs):
            args = tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
            with torch.autocast(device.type, dtype=dtype, enabled=inside):
                out = forward(*args, **kwargs)
            return out.float() if inside and torch.is_tensor(out) else out
        return island

    for m in modules:
        m.forward = wrapped(m.forward)
    try:
        with torch.autocast(device.type, dtype=dtype, enabled=not inside):
            yield
    finally:
        for m in modules:
            del m.forward  # the instance attribute: the class's forward again


def probe_inputs(model, schedule, n: int, image_size, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x, t) network inputs: ``n`` phantoms noised to each of :data:`PROBE_FRACTIONS` of T, seeded."""
    phantoms = SyntheticPhantoms(n, tuple(image_size), seed=0)
    image = torch.stack([phantoms[i]["image"] for i in range(n)]).to(device)
    cond = torch.stack([phantoms[i]["cond"] for i in range(n)]).to(device)
    g = torch.Generator().manual_seed(0)
    out = []
    for frac in PROBE_FRACTIONS:
        t = torch.full((n,), int(frac * (schedule.num_train_timesteps - 1)), device=device)
        noise = torch.randn(image.shape, generator=g).to(device)
        out.append((torch.cat([schedule.add_noise(image, noise, t), cond], 1), t))
    return out


@torch.no_grad()
def attribute(model: nn.Module, inputs, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """ε error vs FP32 (max over probes of rel. L2, and of |slope − 1|) for every variant of every group."""
    reference = [model(x, t).double() for x, t in inputs]

    def error(context: Callable[[], contextlib.AbstractContextManager]) -> dict[str, float]:
        rel, bias = [], []
        for (x, t), ref in zip(inputs, reference):
            with context():
                eps = model(x, t).double()
            rel.append(float((eps - ref).norm() / ref.norm().clamp_min(1e-30)))
            bias.append(float((per_sample_fit(eps, ref)[0] - 1).abs().max()))
        return {"eps_rel_l2": max(rel), "eps_scale_bias": max(bias)}

    result = {"all": error(lambda: torch.autocast(device.type, dtype=dtype)), "groups": {}}
    for group in GROUPS:
        mods = members(model, group)
        if not mods:
            continue
        result["groups"][group] = {
            "modules": len(mods),
            "all_but": error(lambda m=mods: autocast_except(m, device, dtype, inside=False)),
            "only": error(lambda m=mods: autocast_except(m, device, dtype, inside=True)),
        }
    return result


def table(result: dict[str, Any]) -> str:
    full = result["all"]["eps_rel_l2"]
    lines = [f"whole network under autocast: eps rel. L2 {full:.3e}, |slope - 1| {result['all']['eps_scale_bias']:.3e}",
             "", "| group | modules | only this group (rel. L2) | all but this group | share removed by an fp32 island |",
             "| --- | --- | --- | --- | --- |"]
    for name, g in result["groups"].items():
        removed = 1 - g["all_but"]["eps_rel_l2"] / full if full > 0 else 0.0
        lines.append(f"| {name} | {g['modules']} | {g['only']['eps_rel_l2']:.3e} | {g['all_but']['eps_rel_l2']:.3e} "
                     f"| {removed:.0%} |")
    return "\n".join(lines) + "\n"


@hydra.main(config_path=cli.CONFIG_PATH, config_name="precision_attribution", version_base="1.3")
@cli.entry
def main(cfg: DictConfig) -> None:
    n, dtype = check_int(cfg, "n", 1), getattr(torch, check_choice(cfg, "dtype", DTYPES))
    check_device(cfg)
    out = cli.output_dir(cfg)
    config = OmegaConf.to_container(cfg, resolve=True)
    device = resolve_device(cfg.device)
    model, schedule = gate_model(config, cfg.checkpoint, seed=0)
    model, schedule = model.to(device).eval(), schedule.to(device)
    result = attribute(model, probe_inputs(model, schedule, n, cfg.model.image_size, device), device, dtype)
    print(table(result), end="")
    record = {**result, "config": config, "env": env_info(device), **provenance()}
    print(atomic_write_text(out / "precision_attribution.json", json.dumps(json_safe(record), indent=2)))


if __name__ == "__main__":
    cli.run(main)
