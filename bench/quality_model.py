"""The quality model's card: its validation-loss curve, its fidelity to the phantom distribution, its samples.

``experiment=quality_model`` trains the network every GPU quality gate uses. Whether that network is fit for
the purpose is a measurement, not a claim, so this command writes one from a training run's folder:

* the loss curve: the ε-MSE of every saved checkpoint (``checkpoints/step_*.pt``), EMA and raw weights, on
  held-out phantoms (seed ``10_000 + k``, never trained on) with fixed t and ε per phantom, so points of the
  curve differ only by the weights (``last.pt`` alone when the run kept no intermediate checkpoints), and the
  logged training loss (``loss.jsonl``) as means over ten step ranges;
* fidelity: N = ``n`` DDPM-250 samples of the final EMA weights (strict FP32, ``n_masks`` held-out phantom masks
  x n / n_masks noise draws, ``batch`` at a time: 128³ in FP32 needs about 4 GiB a volume) against the n held-out phantom images: FID / KID / MMD / histogram W1 with
  permutation p-values and the MS-SSIM diversity of both sets (:mod:`med_ddpm.evaluate`; random-weight
  features: relative numbers);
* ``samples.png``: phantom images (top) and samples for their masks (bottom), and ``sample_mask.png``: the
  first sample with its mask overlaid.

Example (after ``python -m med_ddpm.train experiment=quality_model output_dir=runs/quality_model``):
    python -m bench.quality_model run=runs/quality_model out=bench/results/h200/quality/model
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from bench.core.records import provenance
from bench.quality.validation import held_out_phantoms, validation_loss
from med_ddpm import cli
from med_ddpm.checkpoint import load_checkpoint, read_checkpoint
from med_ddpm.config_checks import CheckpointError, ConfigError, check_int
from med_ddpm.data.encoding import VARIANT_BY_IMAGE_CHANNELS
from med_ddpm.data.volume_io import save_montage_png
from med_ddpm.quality.evaluate import distribution_metrics, diversity, save_montage
from med_ddpm.quality.features import RandomConv3dFeatures
from med_ddpm.quality.probe import batched_trajectory
from med_ddpm.samplers import DDPMSampler
from med_ddpm.train import read_loss_log
from med_ddpm.utils import atomic_write_text, json_safe, resolve_device
from optim import RecipeStack


def loss_curve(run: Path, images, conds, device) -> list[dict[str, Any]]:
    """One point per saved checkpoint (``step_*.pt``, else ``last.pt`` alone): step, EMA and raw-weight
    validation loss."""
    points = []
    paths = sorted((run / "checkpoints").glob("step_*.pt")) or [run / "checkpoints" / "last.pt"]
    for path in paths:
        point = {"checkpoint": path.name}
        for weights in ("ema", "model"):
            loaded = load_checkpoint(path, weights=weights)
            point["step"] = loaded.step
            model, schedule = loaded.model.to(device).eval(), loaded.schedule.to(device)
            point[f"val_loss_{weights}"] = validation_loss(model, schedule, images, conds, device)
        points.append(point)
    return points


def training_loss(run: Path, windows: int = 10) -> list[dict[str, Any]]:
    """The run's logged training loss (``loss.jsonl``) as means over ``windows`` equal step ranges: the curve
    of the loss the optimizer saw, which a run without intermediate checkpoints still has."""
    steps, losses = read_loss_log(run)
    size = max(1, -(-len(steps) // windows))
    return [{"first_step": steps[i], "last_step": steps[min(i + size, len(steps)) - 1],
             "mean_loss": sum(losses[i:i + size]) / len(losses[i:i + size])} for i in range(0, len(steps), size)]


def fidelity(checkpoint: Path, size: tuple[int, ...], n: int, n_masks: int, batch: int, device: torch.device,
             out: Path) -> dict[str, Any]:
    """DDPM samples of the EMA weights for held-out masks vs the held-out phantom images, ``batch`` at a time; PNGs."""
    loaded = load_checkpoint(checkpoint, weights="ema")
    model, schedule = loaded.model.to(device).eval(), loaded.schedule.to(device)
    variant = VARIANT_BY_IMAGE_CHANNELS[model.out_channels]
    images, conds = held_out_phantoms(n, size, variant)
    cond = conds[:n_masks].repeat_interleave(n // n_masks, dim=0).to(device)
    sampler = DDPMSampler(schedule)
    sampler.set_timesteps(schedule.num_train_timesteps)
    with RecipeStack([]).session():  # strict FP32: cuDNN's default TF32 convolutions off
        samples = batched_trajectory(model, sampler, cond, model.out_channels, 0, batch,
                                     on_batch=lambda done: print(f"{done} of {n} samples", flush=True)).samples
    per_mask = n // n_masks
    shown = min(4, n_masks)
    save_montage(images[:shown], samples[::per_mask][:shown], ([f"phantom {k}" for k in range(shown)],
                 [f"mask {k}" for k in range(shown)]), out / "samples.png")
    save_montage_png(samples[0], cond[0].cpu(), out / "sample_mask.png", title="DDPM-250 sample, mask 0")
    return {"n": n, "n_masks": n_masks, "sampler": "DDPM-250 (strict FP32)",
            "distribution": distribution_metrics(images, samples, RandomConv3dFeatures(), 1000, progress=False),
            "diversity": {"samples_same_mask": diversity(samples[:per_mask], 64, 7), "phantoms": diversity(images, 64, 7)},
            "extractor": RandomConv3dFeatures().describe()}


def summary_markdown(s: dict[str, Any]) -> str:
    lines = [f"# The quality model ({s['checkpoint']}, step {s['step']})", "",
             f"Code: commit `{s['git_sha'][:12]}`{' (dirty)' if s['dirty'] else ''}.", "",
             "## Validation loss (held-out phantoms)",
             "", "| step | EMA | raw weights |", "| --- | --- | --- |"]
    lines += [f"| {p['step']} | {p['val_loss_ema']:.5f} | {p['val_loss_model']:.5f} |" for p in s["loss_curve"]]
    if s["train_loss"]:
        lines += ["", "## Training loss (`loss.jsonl`, mean per step range)", "", "| steps | mean loss |",
                  "| --- | --- |"]
        lines += [f"| {w['first_step']}-{w['last_step']} | {w['mean_loss']:.5f} |" for w in s["train_loss"]]
    f = s["fidelity"]
    lines += ["", f"## Fidelity: {f['n']} {f['sampler']} samples vs {f['n']} held-out phantoms", "",
              f"Features `{f['extractor']['name']}`: random weights, relative numbers only.", "",
              "| metric | value | p-value (phantoms vs samples, permutation) |", "| --- | --- | --- |"]
    lines += [f"| {k} | {v['value']:.4g} | {v.get('p_value', '')} |" for k, v in f["distribution"].items()]
    lines += [f"| diversity, {k} (mean pairwise MS-SSIM) | {v:.4g} | |" for k, v in f["diversity"].items()]
    return "\n".join(lines) + "\n"


@hydra.main(config_path=cli.CONFIG_PATH, config_name="quality_card", version_base="1.3")
@cli.entry
def main(cfg: DictConfig) -> None:
    run, out = Path(cfg.run), Path(cfg.out)
    last = run / "checkpoints" / "last.pt"
    if not last.is_file():
        raise CheckpointError(f"run={run}: no checkpoints/last.pt; pass a med_ddpm.train output_dir "
                              "(python -m med_ddpm.train experiment=quality_model output_dir=DIR)")
    n, n_masks = check_int(cfg, "n", 2), check_int(cfg, "n_masks", 1)
    if n % n_masks:
        raise ConfigError(f"n={n}: not a multiple of n_masks={n_masks}; pass n=k*n_masks")
    batch = n if cfg.batch is None else check_int(cfg, "batch", 1)
    device = resolve_device(cfg.device)
    ckpt = read_checkpoint(last)
    size = tuple(ckpt["config"]["model"]["image_size"])
    images, conds = held_out_phantoms(16, size, VARIANT_BY_IMAGE_CHANNELS[ckpt["config"]["model"]["out_channels"]])
    summary = {**provenance(), "checkpoint": str(last), "step": int(ckpt["step"]),
               "train": {k: ckpt["config"].get(k) for k in ("seed", "train", "data", "model")},
               "loss_curve": loss_curve(run, images, conds, device), "train_loss": training_loss(run),
               "fidelity": fidelity(last, size, n, n_masks, batch, device, out)}
    atomic_write_text(out / "summary.json", json.dumps(json_safe(summary), indent=2) + "\n")
    atomic_write_text(out / "summary.md", summary_markdown(summary))
    print(summary_markdown(summary), end="")


if __name__ == "__main__":
    cli.run(main)
