"""A tuning run's options and state: what a run depends on (its key), the state an interrupted run resumes from,
and the checkpoint it tunes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from med_ddpm.checkpoint import Loaded, load_checkpoint
from med_ddpm.config_checks import (
    ConfigError,
    OutputError,
    as_config_error,
    check_checkpoint_options,
    check_int,
    check_int_value,
)
from med_ddpm.data.encoding import VARIANT_BY_IMAGE_CHANNELS
from med_ddpm.quality.gate import QualityGate
from med_ddpm.quality.probe import default_probe_timesteps
from med_ddpm.samplers import make_timesteps, sampler_from_config
from med_ddpm.samplers.search import describe_data, search_geometry
from med_ddpm.samplers.tuned import file_sha256
from med_ddpm.utils import atomic_write_text, json_safe, resolve_device

STATE, DISTANCES, RESULT = "tune.json", "search_distances.npy", "sampler.yaml"


# ----------------------------------------------------------------------------------------------------- options
def check_budgets(value: Any) -> list[int]:
    """``budgets``: a non-empty, strictly increasing list of model calls per sample."""
    items = list(value) if OmegaConf.is_list(value) or isinstance(value, list | tuple) else [value]
    example = "budgets=[10,15,20,25,35,50]"
    if not items:
        raise ConfigError(f"budgets=[]: empty; pass the model calls per sample to try, increasing, e.g. {example}")
    for k in items:
        check_int_value("budgets", k, 1)
    if any(b <= a for a, b in zip(items, items[1:])):
        fix = ",".join(str(k) for k in sorted(set(items)))
        raise ConfigError(f"budgets={items}: not increasing; the first budget that passes is kept, so pass them in "
                          f"increasing order, e.g. budgets=[{fix}]")
    return items


def check_options(cfg: DictConfig) -> list[int]:
    """Refuse, before the checkpoint is loaded, an option the run would fail on; returns the budgets."""
    check_checkpoint_options(cfg)
    budgets = check_budgets(cfg.budgets)
    for key, low in (("search.n", 1), ("search.batch", 1), ("search.seed", 0), ("gate.seed", 0), ("gate.batch", 1),
                     ("quality.n_masks", 1)):
        check_int(cfg, key, low)
    n, n_masks = check_int(cfg, "quality.n_samples", 2), cfg.quality.n_masks
    if n % n_masks:
        raise ConfigError(f"quality.n_samples={n}: not a multiple of quality.n_masks={n_masks} (each mask gets "
                          f"N / n_masks noise draws); pass quality.n_samples={max(n - n % n_masks, n_masks)}")
    if cfg.gate.seed == cfg.search.seed:
        raise ConfigError(f"gate.seed={cfg.gate.seed}: the search's noise seed (search.seed); the gate's noise is held "
                          f"out from the search, so pass another, e.g. gate.seed={cfg.search.seed + 1}")
    return budgets


def base_sampler(cfg: DictConfig, loaded: Loaded, budgets: Sequence[int]) -> dict[str, Any]:
    """The ``sampler`` node without its grid, checked to take a grid of K points for K model calls."""
    node = {k: v for k, v in OmegaConf.to_container(cfg.sampler, resolve=True).items() if k not in ("steps", "timesteps")}
    T = loaded.schedule.num_train_timesteps
    for k in budgets:
        check_int_value("budgets", k, 1, T, f" (the checkpoint's schedule has T = {T} training steps)")
    k, name = budgets[0], node["name"]
    grid = make_timesteps(T, k).tolist()
    try:
        sampler_from_config(grid_node({"name": name}, grid), loaded.schedule)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"sampler={name}: takes no timestep grid; tune one that does, e.g. sampler=dpm_solver_pp "
                          "sampler.variant=sde (experiment=fast_sample's)") from err
    with as_config_error("sampler", f"see configs/sampler/{name}.yaml for its options", errors=(ValueError, TypeError)):
        sampler = sampler_from_config(grid_node(node, grid), loaded.schedule)
    if len(sampler.timesteps) != k:
        raise ConfigError(f"sampler={name}: makes {len(sampler.timesteps)} model calls on a {k}-point grid; "
                          "tune a sampler whose calls are its grid's points, e.g. sampler=dpm_solver_pp")
    return node


def check_gate_power(cfg: DictConfig, loaded: Loaded) -> None:
    """Refuse, before anything is sampled, an N (``quality.n_samples``) or ``quality.n_perm`` at which the gate's bias
    checks could never fail at the checkpoint's probed timesteps (:meth:`QualityGate.check_bias_power`)."""
    probed = default_probe_timesteps(loaded.schedule.num_train_timesteps)
    gate = QualityGate(OmegaConf.to_container(cfg.quality, resolve=True))
    gate.check_bias_power(cfg.quality.n_samples, len(probed))


def grid_node(base: dict[str, Any], grid: Sequence[int]) -> dict[str, Any]:
    return {**base, "steps": len(grid), "timesteps": [int(t) for t in grid]}


# ----------------------------------------------------------------------------------------------------- state
@dataclass
class Tuning:
    """One tuning run: the loaded checkpoint, its geometry and the state written to ``out_dir``."""

    cfg: DictConfig
    out_dir: Path
    device: torch.device
    loaded: Loaded
    sha256: str
    size: list[int]
    budgets: list[int]
    sampler: dict[str, Any]
    state: dict[str, Any]

    @property
    def T(self) -> int:
        return self.loaded.schedule.num_train_timesteps

    @property
    def variant(self) -> str:
        return VARIANT_BY_IMAGE_CHANNELS[self.loaded.model.out_channels]

    @property
    def recipe(self) -> dict[str, Any]:
        return recipe_node(self.cfg)

    def save_state(self) -> None:
        atomic_write_text(self.out_dir / STATE, json.dumps(json_safe(self.state), indent=1) + "\n")


def recipe_node(cfg: DictConfig) -> dict[str, Any]:
    """The recipe stack's config (``{}``: strict FP32; ``'~experiment'`` leaves no ``recipe`` key)."""
    node = cfg.get("recipe")
    return OmegaConf.to_container(node, resolve=True) if node is not None else {}


def run_key(cfg: DictConfig, sha256: str, size: Sequence[int], sampler: dict[str, Any]) -> dict[str, Any]:
    """What a run's results depend on: a rerun in the same output_dir must match it to reuse them."""
    key = {"checkpoint_sha256": sha256, "weights": cfg.weights, "image_size": list(size),
           "data": describe_data(cfg.data), "search": {"n": cfg.search.n, "seed": cfg.search.seed},
           "masks": cfg.masks, "gate_seed": cfg.gate.seed, "sampler": sampler,
           "recipe": recipe_node(cfg),
           "quality": OmegaConf.to_container(cfg.quality, resolve=True), "torch": str(torch.__version__)}
    return json.loads(json.dumps(json_safe(key)))


def load_state(out_dir: Path, key: dict[str, Any]) -> dict[str, Any]:
    """The state of an earlier run of the same settings in ``out_dir`` (empty when none); another run's is refused."""
    path = out_dir / STATE
    if not path.exists():
        return {"key": key, "budgets": {}}
    try:
        state = json.loads(path.read_text())
    except ValueError as err:
        raise OutputError(f"output_dir={out_dir}: {STATE} is not JSON ({err}); remove it, or choose another "
                          "output_dir=") from err
    differ = [k for k in key if state.get("key", {}).get(k) != key[k]]
    if differ:
        raise OutputError(f"output_dir={out_dir}: holds a tuning with another {', '.join(differ)} ({STATE}); choose "
                          "another output_dir=, or remove it")
    return state


def prepare(cfg: DictConfig, out_dir: Path) -> Tuning:
    """Check the options, load the checkpoint, check the gate's N against its schedule, and load the state of an
    earlier run of the same settings."""
    budgets = check_options(cfg)
    device = resolve_device(cfg.device)
    loaded = load_checkpoint(cfg.checkpoint, weights=cfg.weights)
    size = search_geometry(cfg, loaded)
    sampler = base_sampler(cfg, loaded, budgets)
    check_gate_power(cfg, loaded)
    sha256 = file_sha256(cfg.checkpoint)
    state = load_state(out_dir, run_key(cfg, sha256, size, sampler))
    return Tuning(cfg, out_dir, device, loaded, sha256, size, budgets, sampler, state)
