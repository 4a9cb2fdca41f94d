"""Ladder presets as config files: ``configs/ladder/preset/<name>.yaml``, each one ordered list of jobs.

A job is ``{name, overrides}``: its name (what the ladder lists and logs) and the Hydra overrides of the config it
runs (``configs/bench.yaml`` for a step job; the command's for ``e2e``). The ladder's options are under
``${ladder.*}`` (``${ladder.best}``, ``${ladder.checkpoint}``); a preset may keep shared override lists under keys of
its own (``gated: [...]``, used as ``"${gated}"``). What a preset computes from other configs is a resolver, so the
list stays data and the source stays one:

* ``${stack:${ladder.best},checkpointing}``: ``recipe=[...]`` from lists and names;
* ``${swap_stack:fast_sample,amp_fp16,amp_bf16}``: an experiment's stack, options kept, one recipe swapped;
* ``${train_settings:fast_train}``: an experiment's training batch and accumulation;
* ``${gate_cache:${ladder.checkpoint}}``: the quality gate's reference cache beside the weights;
* ``${searched_grids:${gated}}``: one job per searched sampler grid, ``configs/sampler/ays_*.yaml``;
* ``${tuned_grid:${gate},${ladder.tuned}}``: the job gating ``med_ddpm.tune``'s ``sampler.yaml``, once it exists.

An entry that is a list (from a resolver or a shared key) is spliced in place, in ``jobs`` and in ``overrides``; a
job whose overrides equal an earlier job's runs once. ``requires: {option: why}`` names the ladder options the
preset cannot run without: one line, ``<option>: not set, and <why>``.
``configs/ladder/preset/evidence.yaml`` has more keys per job (:mod:`bench.evidence`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from bench.core.runner import experiment_stack, experiment_train_settings
from med_ddpm.cli import CONFIG_DIR
from med_ddpm.config_checks import ConfigError

PRESET_DIR = CONFIG_DIR / "ladder" / "preset"


@dataclass(frozen=True)
class PresetJob:
    name: str
    overrides: list[str]


def names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _flat(items: Any) -> Iterator[Any]:
    for item in items:
        if isinstance(item, (list, ListConfig)):
            yield from _flat(item)
        else:
            yield item


def stack(*parts: Any) -> str:
    return f"recipe=[{','.join(str(n) for n in _flat(parts))}]"


def swap_stack(experiment: str, old: str, new: str) -> list[str]:
    return experiment_stack(experiment, {old: new})


def train_settings(experiment: str) -> list[str]:
    return experiment_train_settings(experiment)


def gate_cache(checkpoint: str) -> str:
    return str(Path(checkpoint).resolve().parent / "gate_cache")


def searched_grids(gated: ListConfig) -> list[dict[str, Any]]:
    return [{"name": f"ays.{path.stem}", "overrides": [*gated, f"sampler={path.stem}",
                                                        f"sampler.steps={len(OmegaConf.load(path).timesteps)}"]}
            for path in sorted((CONFIG_DIR / "sampler").glob("ays_*.yaml"))]


def tuned_grid(gated: ListConfig, path: str | None) -> list[dict[str, Any]]:
    """The job gating ``med_ddpm.tune``'s grid (its ``sampler.yaml``) with ``gated``'s overrides; none while the
    file is not there (the tuning has not run)."""
    if path is None or not Path(path).is_file():
        return []
    node = OmegaConf.load(path).sampler
    grid = ",".join(str(int(t)) for t in node.timesteps)
    return [{"name": "sampler.tuned", "overrides": [*gated, "experiment=fast_sample", f"sampler={node.name}",
                                                    *(f"sampler.{k}={node[k]}" for k in node if k != "name"
                                                      and k != "timesteps"), f"sampler.timesteps=[{grid}]"]}]


RESOLVERS = {"stack": stack, "swap_stack": swap_stack, "train_settings": train_settings, "gate_cache": gate_cache,
             "searched_grids": searched_grids, "tuned_grid": tuned_grid}
for _name, _resolver in RESOLVERS.items():
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_new_resolver(_name, _resolver)


def load(preset: str, ladder: DictConfig | dict[str, Any]) -> DictConfig:
    """``configs/ladder/preset/<preset>.yaml`` with ``ladder`` (the ladder's options) beside it, resolved; a missing
    required option is refused in one line."""
    node = OmegaConf.load(PRESET_DIR / f"{preset}.yaml")
    missing = [key for key in node.get("requires") or {} if ladder.get(key) is None]
    if missing:
        raise ConfigError(f"{', '.join(missing)}: not set, and {node.requires[missing[0]]}")
    options = ladder if isinstance(ladder, dict) else OmegaConf.to_container(ladder, resolve=True)
    root = OmegaConf.create({"ladder": options})
    return OmegaConf.merge(root, node)


def jobs(preset: str, ladder: DictConfig | dict[str, Any]) -> list[PresetJob]:
    """The preset's jobs, in order, each overrides list flat, a job equal to an earlier one left out."""
    node = load(preset, ladder)
    seen, out = set(), []
    for job in _flat(OmegaConf.to_container(node, resolve=True)["jobs"]):
        overrides = [str(o) for o in _flat(job["overrides"])]
        if tuple(overrides) not in seen:
            seen.add(tuple(overrides))
            out.append(PresetJob(str(job["name"]), overrides))
    return out
