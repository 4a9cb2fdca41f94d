"""Which K timesteps should a stochastic sampler visit on a given checkpoint? An Align-Your-Steps search.

``python -m med_ddpm.step_search checkpoint=CKPT [data=whole_head data.root=DATA]`` writes one sampler config
per K (``<sampler_dir>/<name>_<K>.yaml``: SDE-DPM-Solver++ on the searched ``timesteps:``), plus
``step_search.md`` and ``step_search.json`` in ``output_dir`` with the bound of each searched grid next to the
named spacings'.

The search itself (the bound and its exact minimiser): :mod:`med_ddpm.samplers.search`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from med_ddpm import cli
from med_ddpm.checkpoint import load_checkpoint
from med_ddpm.config_checks import (
    ConfigError,
    check_checkpoint_options,
    check_int,
    check_int_value,
)
from med_ddpm.samplers.search import (
    describe_data,
    interval_costs,
    log_snr_weights,
    sampler_snippet,
    search,
    search_geometry,
    stack_distances,
    table,
)
from med_ddpm.utils import atomic_write_text, json_safe, resolve_device, seed_everything
from optim import RecipeStack

log = logging.getLogger("med_ddpm.step_search")


def check_options(cfg: DictConfig) -> list[int]:
    """Refuse, before the checkpoint is loaded, an option the search would fail on; returns the K to search."""
    check_checkpoint_options(cfg)
    for key, low in (("n", 1), ("batch", 1), ("seed", 0)):
        check_int(cfg, key, low)
    check_int(cfg, "order", 1, 3, " (the sampler's order: 2 is 2M, 3 is 3M)")
    if not str(cfg.name) or "/" in str(cfg.name):
        raise ConfigError(f"name={cfg.name!r}: must be a file stem; pass name=ays_mymodel")
    steps = cfg.steps if OmegaConf.is_list(cfg.steps) else [cfg.steps]
    return [check_int_value("steps", k, 1) for k in steps]


def run(cfg: DictConfig, steps: Sequence[int]) -> dict[int, dict[str, object]]:
    """Estimate M on the data with the checkpoint's network inside the recipe stack, then search each K."""
    device = resolve_device(cfg.device)
    seed_everything(cfg.seed)
    loaded = load_checkpoint(cfg.checkpoint, weights=cfg.weights)
    size = search_geometry(cfg, loaded)
    T = loaded.schedule.num_train_timesteps
    for k in steps:
        check_int_value("steps", k, 1, T, f" (the checkpoint's schedule has T = {T} training steps)")
    stack = RecipeStack.from_config(cfg.get("recipe"))
    stack.require(device)
    distances = stack_distances(cfg, loaded.model, loaded.schedule, size, stack, device)
    return search(interval_costs(distances, log_snr_weights(loaded.schedule)), steps)


def write_results(cfg: DictConfig, result: dict[int, dict[str, Any]], out_dir: Path) -> list[Path]:
    """One sampler config per K, ``step_search.md`` and ``step_search.json``; returns the sampler configs."""
    source = f"{cfg.checkpoint} over {cfg.n} {describe_data(cfg.data)}"
    sampler_dir = Path(cfg.sampler_dir)
    written = [atomic_write_text(sampler_dir / f"{cfg.name}_{k}.yaml",
                                 sampler_snippet(r["grid"], cfg.order, source, r["bound"], r["spacings"]["trailing"]))
               for k, r in result.items()]
    summary = {"checkpoint": cfg.checkpoint, "weights": cfg.weights, "data": describe_data(cfg.data), "n": cfg.n,
               "seed": cfg.seed, "recipes": list(cfg.get("recipe") or {}), "order": cfg.order,
               "sampler_configs": [str(p) for p in written], "results": result}
    atomic_write_text(out_dir / "step_search.json", json.dumps(json_safe(summary), indent=1) + "\n")
    atomic_write_text(out_dir / "step_search.md", f"# Align-Your-Steps search: {source}\n\nKL upper bound per grid "
                      f"(lower is better; same estimate for every column):\n\n{table(result)}")
    return written


def usage_hint(cfg: DictConfig, written: Sequence[Path]) -> str:
    """How to sample with the written configs: a built-in choice in configs/sampler, else through Hydra's search
    path (``<dir>/sampler/<name>_<K>.yaml`` is the ``sampler`` group's option ``<name>_<K>``)."""
    sampler_dir, k = Path(cfg.sampler_dir).resolve(), written[0].stem.rsplit("_", 1)[1]
    use = f"sampler={written[0].stem} sampler.steps={k}"
    if sampler_dir != cli.CONFIG_DIR / "sampler":
        if sampler_dir.name != "sampler":
            return f"sampler configs in {sampler_dir} (move them into a folder named sampler/ to select them)"
        use = f"'hydra.searchpath=[file://{sampler_dir.parent}]' " + use
    return f"sample with: python -m med_ddpm.sample checkpoint={cfg.checkpoint} masks=MASKS {use}"


@hydra.main(config_path=cli.CONFIG_PATH, config_name="step_search", version_base="1.3")
@cli.entry
def main(cfg: DictConfig) -> None:
    out_dir = cli.output_dir(cfg)
    cli.refuse_earlier_results(out_dir, "step_search.json", "a step search")
    steps = check_options(cfg)
    result = run(cfg, steps)
    written = write_results(cfg, result, out_dir)
    print(table(result), end="")
    log.info("wrote %s and %s/step_search.{md,json}", ", ".join(str(p) for p in written), out_dir)
    print(usage_hint(cfg, written))


console = cli.console(main)  # the med-ddpm-step-search command


if __name__ == "__main__":
    console()
