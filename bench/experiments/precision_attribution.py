"""Where does a reduced-precision ε error come from? Attribute it to groups of modules.

bf16 autocast moves ε a few per cent from strict FP32 on the quality model. To find which modules to keep in
float32 (an fp32 island) this command measures, on identical inputs x_t (phantoms noised to a few t), the ε
error against strict FP32 of:

* ``all``: the whole network under autocast;
* ``all but G``: autocast everywhere except the modules of group G, which run in float32 (their inputs cast
  up): the error G is responsible for is ``all`` minus this;
* ``only G``: float32 everywhere except group G under autocast.

Groups: ``groupnorm`` (every GroupNorm), ``time_embedding`` (the timestep MLP), ``attention`` (the attention
blocks), ``output_conv`` (the final GroupNorm + SiLU + conv), ``input_conv`` (the first conv, which reads
x_t), ``residual_convs`` (every other Conv3d). The
error is the relative L2 of ε and the per-sample slope of ε on the FP32 ε (a scale bias: see
:mod:`med_ddpm.gate`). The remainder not explained by any group is accumulation across groups.

Example (CPU, the tiny model, seeded random weights):
    python -m bench.experiments.precision_attribution model=tiny device=cpu n=2
    python -m bench.experiments.precision_attribution model=quality_model checkpoint=runs/quality_model/checkpoints/last.pt dtype=bfloat16
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.records import provenance
from med_ddpm.model import INPUT_CONV
from med_ddpm.phantoms import SyntheticPhantoms
from med_ddpm.quality import gate_model
from med_ddpm.stats import per_sample_fit
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


def main(argv: list[str]) -> int:
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    known = {"model", "checkpoint", "device", "n", "dtype", "out"}
    if len(args) != len(argv) or set(args) - known:
        raise SystemExit(f"bench.experiments.precision_attribution: arguments are key=value with keys {sorted(known)}")
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from bench.sweep import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("bench", overrides=[f"model={args.get('model', 'tiny')}", "output_dir=unused"])
    device = resolve_device(args.get("device", "auto"))
    dtype = getattr(torch, args.get("dtype", "bfloat16"))
    node = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "diffusion")}
    model, schedule = gate_model(node, args.get("checkpoint"), seed=0)
    model, schedule = model.to(device).eval(), schedule.to(device)
    inputs = probe_inputs(model, schedule, int(args.get("n", 2)), cfg.model.image_size, device)
    result = attribute(model, inputs, device, dtype)
    print(table(result), end="")
    if "out" in args:  # with the command's arguments, the environment and the commit (bench.records)
        record = {**result, "args": args, "env": env_info(device), **provenance()}
        atomic_write_text(Path(args["out"]) / "precision_attribution.json", json.dumps(json_safe(record), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
