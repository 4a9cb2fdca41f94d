"""Compare two folders of NIfTI volumes (the logic of ``python -m med_ddpm.evaluate``, :mod:`med_ddpm.evaluate`).

Writes ``metrics.json``, ``summary.md`` and ``montage.png`` to ``output_dir``:

* distribution: FID, KID and MMD (KID on the features of ``extractor``; MMD on voxels) and the
  W1 distance between the intensity histograms, each KID / MMD / W1 with a permutation p-value
  (:mod:`med_ddpm.quality.stats`: how often shuffling the real / generated labels gives a larger value;
  small p = the two sets differ by more than their own spread at this N);
* diversity: mean pairwise MS-SSIM inside each set (lower = more varied);
* paired: PSNR, SSIM and MAE for files whose names match in both folders;
* per region, with ``masks=DIR`` (label maps named like the volumes, ``<name>_<k>`` allowed for
  the ``num_samples > 1`` files of ``med_ddpm.sample``): the histogram W1 and the paired metrics
  inside each region of ``regions``.

The default extractor is a fixed-seed random-weight 3-D CNN: its FID / KID are *relative*
numbers, comparable only between runs of this command with the same extractor, never with
published values. ``extractor`` may name a MedicalNet ResNet with its weights file instead.

Example:
    python -m med_ddpm.evaluate real=data/whole_head/image generated=samples masks=data/whole_head/mask output_dir=eval
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from med_ddpm.config_checks import DataError
from med_ddpm.data.datasets import read_volume
from med_ddpm.data.discovery import nifti_stem
from med_ddpm.quality.features import FeatureExtractor
from med_ddpm.quality.metrics import MAE, MSSSIM, PSNR, SSIM, frechet_distance
from med_ddpm.quality.stats import (
    histogram_w1,
    intensity_histograms,
    linear_kernel,
    mmd2_unbiased,
    permutation_test,
    polynomial_kernel,
)
from med_ddpm.utils import atomic_write_text, json_safe, save_figure

log = logging.getLogger("med_ddpm.evaluate")
NIFTI_SUFFIXES = (".nii", ".nii.gz")
HIST_BINS = 256


# ----------------------------------------------------------------------------- input
def list_volumes(folder: str | Path, key: str) -> list[Path]:
    """The NIfTI files of ``folder``, sorted. Anything else (hidden files, subfolders, the log, PNG montages and
    ``timings.json`` that ``med_ddpm.sample`` writes beside its volumes) cannot be a volume and is passed over,
    with a log line that counts it."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{key}={folder}: not a folder; pass a folder of .nii/.nii.gz volumes")
    entries = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    files = [p for p in entries if p.is_file() and p.name.endswith(NIFTI_SUFFIXES)]
    if not files:
        raise DataError(f"{key}={folder}: folder has no .nii/.nii.gz volumes; point {key}= at a folder of NIfTI volumes")
    others = [p.name for p in entries if p not in files]
    if others:
        log.info("%s=%s: %d NIfTI volume(s); passed over %d other entries (%s)", key, folder, len(files), len(others),
                 ", ".join(others[:4]) + (", ..." if len(others) > 4 else ""))
    return files


def load_volumes(files: Sequence[Path], role: str, intensity: str, shape: tuple[int, ...] | None,
                 progress: bool) -> torch.Tensor:
    """(N, 1, i, j, k) float32 volumes; every file checked for readability, NaN, shape and range."""
    volumes = []
    for path in tqdm(files, desc=f"reading {role}", disable=not progress, leave=False):
        data, _ = read_volume(path, role)
        if shape is not None and data.shape != shape:
            raise DataError(f"{path}: shape {data.shape} differs from {shape} (the first file's); "
                            "resample every volume to one grid first")
        shape = data.shape
        volumes.append(torch.from_numpy(scale_intensity(np.asarray(data, np.float32), path, intensity)))
    return torch.stack(volumes)[:, None]


def scale_intensity(data: np.ndarray, path: Path, intensity: str) -> np.ndarray:
    """``none``: values must already lie in [-1, 1]; ``minmax``: each volume mapped to [-1, 1]."""
    if intensity == "minmax":
        lo, hi = float(data.min()), float(data.max())
        if hi == lo:
            raise DataError(f"{path}: volume is constant ({lo}); cannot scale it to [-1, 1]; remove it or pass intensity=none")
        return (data - lo) / (hi - lo) * 2 - 1
    if intensity != "none":
        raise DataError(f"intensity={intensity!r}: unknown; pass intensity=none or intensity=minmax")
    if data.min() < -1.001 or data.max() > 1.001:
        raise DataError(f"{path}: values in [{data.min():.4g}, {data.max():.4g}] are outside [-1, 1]; "
                        "pass intensity=minmax to scale each volume")
    return data


def load_regions(mask_dir: str | Path, files: Sequence[Path], regions: Mapping[str, Sequence[int]],
                 shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Region -> (N, 1, i, j, k) bool masks for ``files``, from label maps matched by name."""
    masks = {nifti_stem(p): p for p in list_volumes(mask_dir, "masks")}
    labels = []
    for path in files:
        stem = nifti_stem(path)
        match = masks.get(stem) or masks.get(re.sub(r"_\d+$", "", stem))
        if match is None:
            raise DataError(f"{path}: no mask named {stem}.nii.gz (or without its _k suffix) in masks={mask_dir}; "
                            "name each mask like its volume, or leave masks= unset")
        data, _ = read_volume(match, "mask")
        if data.shape != shape:
            raise DataError(f"{match}: mask shape {data.shape} differs from the volumes' {shape}; "
                            "resample the masks to the volumes' grid")
        labels.append(torch.from_numpy(np.rint(data).astype(np.int16)))
    stacked = torch.stack(labels)[:, None]
    return {name: torch.isin(stacked, torch.tensor(list(values), dtype=torch.int16)) for name, values in regions.items()}


# ----------------------------------------------------------------------------- metrics
def distribution_metrics(real: torch.Tensor, generated: torch.Tensor, extractor: FeatureExtractor,
                         n_perm: int, progress: bool) -> dict[str, Any]:
    """FID, KID, MMD and histogram W1 between the sets; KID / MMD / W1 with permutation p-values."""
    pooled = torch.cat([real, generated])
    is_gen = np.r_[np.zeros(len(real), bool), np.ones(len(generated), bool)]
    feats = torch.cat([extractor(v[None]) for v in tqdm(pooled, desc="features", disable=not progress, leave=False)])
    hists = intensity_histograms(pooled, HIST_BINS)
    out: dict[str, Any] = {"histogram_w1": {"value": histogram_w1(hists, is_gen, 2.0 / HIST_BINS)}}
    if min(len(real), len(generated)) < 2:  # a covariance and an unbiased MMD need two volumes a side
        return {"fid": {"value": None, "skipped": "needs >= 2 volumes in each folder"}, **out}
    out["fid"] = {"value": float(frechet_distance(feats[~is_gen], feats[is_gen]))}
    k_feat, k_vox = polynomial_kernel(feats), linear_kernel(pooled)
    for name, stat in (("kid", lambda b: mmd2_unbiased(k_feat, b)), ("mmd", lambda b: mmd2_unbiased(k_vox, b)),
                       ("histogram_w1", lambda b: histogram_w1(hists, b, 2.0 / HIST_BINS))):
        out[name] = permutation_test(stat, is_gen, n_perm=n_perm).to_dict()
    return out


def diversity(volumes: torch.Tensor, max_pairs: int, kernel_size: int) -> float | None:
    """Mean MS-SSIM over (up to ``max_pairs``, evenly spread) pairs of a set; None below 2 volumes."""
    pairs = list(itertools.combinations(range(len(volumes)), 2))
    if not pairs:
        return None
    pairs = [pairs[int(i)] for i in np.linspace(0, len(pairs) - 1, min(max_pairs, len(pairs)))]
    i, j = map(list, zip(*pairs))
    metric = MSSSIM(kernel_size=kernel_size)
    metric.update(volumes[i], volumes[j])
    return metric.compute()


def paired_metrics(real: torch.Tensor, generated: torch.Tensor, regions: Mapping[str, torch.Tensor] | None,
                   kernel_size: int) -> dict[str, float]:
    """PSNR / SSIM / MAE of matched pairs, and PSNR / MAE inside each region."""
    out = {}
    for name, metric in (("psnr", PSNR()), ("ssim", SSIM(kernel_size=kernel_size)), ("mae", MAE())):
        metric.update(generated, real)
        out[name] = metric.compute()
    for region, mask in (regions or {}).items():
        for name, metric in (("psnr", PSNR()), ("mae", MAE())):
            metric.update(generated, real, mask=mask)
            out[f"{name}_{region}"] = metric.compute()
    return out


def region_histograms(real, generated, real_regions, gen_regions) -> dict[str, float]:
    """Intensity-histogram W1 inside each region (each set's own masks)."""
    out = {}
    for region in gen_regions:
        sets = [torch.where(m, v, torch.nan).flatten(1) for v, m in ((real, real_regions[region]),
                                                                    (generated, gen_regions[region]))]
        hists = np.stack([intensity_histograms(s[:, None], HIST_BINS).sum(0) for s in sets])
        out[region] = histogram_w1(hists, np.array([False, True]), 2.0 / HIST_BINS)
    return out


# ----------------------------------------------------------------------------- outputs
def save_montage(real: torch.Tensor, generated: torch.Tensor, names: tuple[list[str], list[str]], path: Path,
                 columns: int = 4) -> Path:
    """Mid-axial slices: the first ``columns`` real volumes on top, generated below."""
    fig = Figure(figsize=(2 * columns, 4.4), dpi=72)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, columns, squeeze=False)
    for row, (volumes, labels) in enumerate(zip((real, generated), names)):
        for col in range(columns):
            ax = axes[row, col]
            ax.set_axis_off()
            if col < len(volumes):
                v = volumes[col, 0].numpy()
                ax.imshow(v[:, :, v.shape[2] // 2].T, cmap="gray", vmin=-1, vmax=1, origin="lower")
                ax.set_title(f"{'real' if row == 0 else 'generated'}: {labels[col]}", fontsize=7)
    return save_figure(fig, path)


def summary_markdown(m: Mapping[str, Any]) -> str:
    """The metrics as a short markdown report."""
    d = m["distribution"]
    def cell(x: Mapping[str, Any]) -> str:
        if x["value"] is None:
            return f"not computed: {x['skipped']}"
        return f"{x['value']:.4g}" + (f" (p = {x['p_value']:.3g})" if "p_value" in x else "")

    lines = [f"# {m['n_generated']} generated vs {m['n_real']} real volumes, shape {m['shape']}", "",
             f"Features: `{m['extractor']['name']}`"
             + (" (random weights: relative numbers, comparable only with the same extractor)."
                if m["extractor"]["relative_only"] else "."), "",
             "| metric | value |", "| --- | --- |"]
    lines += [f"| {k} | {cell(v)} |" for k, v in d.items()]
    lines += [f"| diversity ({k}, mean pairwise MS-SSIM) | {v:.4g} |" for k, v in m["diversity"].items() if v is not None]
    lines += [f"| histogram W1 in {k} | {v:.4g} |" for k, v in m.get("region_histogram_w1", {}).items()]
    if m["paired"]:
        lines += ["", f"Paired ({m['paired']['n']} files with matching names):", "", "| metric | value |",
                  "| --- | --- |"]
        lines += [f"| {k} | {v:.4g} |" for k, v in m["paired"].items() if k != "n"]
    return "\n".join(lines) + "\n"


def evaluate(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Read both folders (and masks), compute every metric, write metrics.json, summary.md, montage.png."""
    from hydra.utils import instantiate

    progress = bool(cfg.get("progress", True))
    real_files, gen_files = list_volumes(cfg["real"], "real"), list_volumes(cfg["generated"], "generated")
    real = load_volumes(real_files, "real image", cfg["intensity"], None, progress)
    shape = tuple(real.shape[2:])
    generated = load_volumes(gen_files, "generated image", cfg["intensity"], shape, progress)
    extractor: FeatureExtractor = instantiate(cfg["extractor"])
    ks = int(cfg["ssim_kernel"])
    metrics: dict[str, Any] = {
        "real": str(cfg["real"]), "generated": str(cfg["generated"]), "n_real": len(real),
        "n_generated": len(generated), "shape": list(shape), "extractor": extractor.describe(),
        "distribution": distribution_metrics(real, generated, extractor, int(cfg["n_perm"]), progress),
        "diversity": {"generated": diversity(generated, int(cfg["max_pairs"]), ks),
                      "real": diversity(real, int(cfg["max_pairs"]), ks)},
    }
    regions = dict(cfg["regions"])
    real_regions = gen_regions = None
    if cfg.get("masks"):
        real_regions = load_regions(cfg["masks"], real_files, regions, shape)
        gen_regions = load_regions(cfg["masks"], gen_files, regions, shape)
        metrics["region_histogram_w1"] = region_histograms(real, generated, real_regions, gen_regions)
    real_index = {nifti_stem(p): k for k, p in enumerate(real_files)}
    matched = [(real_index[nifti_stem(p)], k) for k, p in enumerate(gen_files) if nifti_stem(p) in real_index]
    metrics["paired"] = {}
    if matched:
        ri, gi = map(list, zip(*matched))
        pair_regions = {r: m[gi] for r, m in gen_regions.items()} if gen_regions else None
        metrics["paired"] = {"n": len(matched), **paired_metrics(real[ri], generated[gi], pair_regions, ks)}
    out = Path(cfg["output_dir"])
    atomic_write_text(out / "metrics.json", json.dumps(json_safe(metrics), indent=2, allow_nan=False) + "\n")
    atomic_write_text(out / "summary.md", summary_markdown(metrics))
    save_montage(real, generated, ([nifti_stem(p) for p in real_files], [nifti_stem(p) for p in gen_files]),
                 out / "montage.png")
    return metrics
