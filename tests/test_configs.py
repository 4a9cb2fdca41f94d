"""Every primary config composes with every experiment, and every group node instantiates."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from med_ddpm.data.datasets import build_dataset
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.model import build_model
from med_ddpm.samplers import sampler_from_config
from optim import DeviceInfo, RecipeConflictError, RecipeStack

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))
PRIMARY = ["train", "sample", "bench"]


def compose_cfg(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


@pytest.mark.parametrize("primary", PRIMARY)
@pytest.mark.parametrize("experiment", [None, *EXPERIMENTS])
def test_composes(primary, experiment):
    overrides = ["output_dir=/tmp/x", "checkpoint=/tmp/c.pt"] if primary == "sample" else ["output_dir=/tmp/x"]
    if experiment:
        overrides.append(f"experiment={experiment}")
    cfg = compose_cfg(primary, overrides)
    assert cfg.model.in_channels == cfg.model.out_channels + cfg.model.cond_channels
    # the default is the strict-FP32 path; an experiment's stack is exactly the one its defaults list names
    assert sorted(cfg.get("recipe") or {}) == (sorted(experiment_recipes(experiment)) if experiment else [])


def experiment_recipes(experiment: str) -> list[str]:
    """The recipes ``configs/experiment/<experiment>.yaml`` puts in its defaults list (``override /recipe``), or those
    of the experiment it extends (a plain entry, e.g. ``- fast_train``)."""
    defaults = OmegaConf.load(CONFIGS / "experiment" / f"{experiment}.yaml").get("defaults") or []
    own = next((list(d["override /recipe"]) for d in defaults if not isinstance(d, str) and "override /recipe" in d),
               None)
    base = next((d for d in defaults if isinstance(d, str) and d != "_self_"), None)
    return own if own is not None else experiment_recipes(base) if base else []


def test_experiment_writes_out_the_original_constants():
    cfg = compose_cfg("train", ["experiment=whole_head", "data.root=/tmp"])
    t = cfg.train
    assert (t.lr, t.batch_size, t.grad_accum, t.ema_decay, t.ema_every, t.ema_start) == (1e-5, 1, 2, 0.995, 10, 2000)
    assert (cfg.diffusion.timesteps, cfg.diffusion.loss_type, cfg.diffusion.schedule) == (250, "l1", "cosine")
    assert cfg.model.channel_mult == [1, 1, 2, 3, 4] and cfg.model.attention_ds == [8]
    brats = compose_cfg("train", ["experiment=brats", "data.root=/tmp"])
    assert brats.model.num_res_blocks == 2 and brats.model.attention_ds == [] and brats.model.in_channels == 8


def test_command_line_model_overrides_the_experiment():
    cfg = compose_cfg("train", ["experiment=whole_head", "model=tiny", "data.root=/tmp"])
    assert cfg.model.model_channels == 32 and cfg.data.image_size == [32, 32, 32]


@pytest.mark.parametrize("model", sorted(p.stem for p in (CONFIGS / "model").glob("*.yaml")))
def test_model_configs_build_a_network_that_maps_volume_and_mask_to_eps(model):
    """Each model config builds a network that takes image + mask channels at a small size its levels allow and
    returns ε of the image's channels, with attention where ``attention_ds`` says."""
    cfg = compose_cfg("train", [f"model={model}"])
    net = build_model(cfg.model).eval()
    size = 2 ** len(cfg.model.channel_mult)  # 2 voxels a side at the lowest level: GroupNorm needs more than one
    with torch.no_grad():
        eps = net(torch.zeros(1, cfg.model.in_channels, size, size, size), torch.tensor([1]))
    assert eps.shape == (1, cfg.model.out_channels, size, size, size)
    blocks = [m for m in net.input_blocks.modules() if type(m).__name__ == "AttentionBlock"]
    assert bool(blocks) == bool(cfg.model.attention_ds)


@pytest.mark.parametrize("sampler", sorted(p.stem for p in (CONFIGS / "sampler").glob("*.yaml")))
def test_sampler_configs_build(sampler):
    cfg = compose_cfg("train", [f"sampler={sampler}"])
    s = sampler_from_config(cfg.sampler, NoiseSchedule(cfg.diffusion.timesteps))
    assert s.num_inference_steps == cfg.sampler.steps


def test_every_pair_of_recipes_combines_or_conflicts_clearly():
    """Every two recipes compose into one stack holding both, or are refused with an error naming both; the only
    refusals are two recipes of one kind (two AMPs, two compiles) and two that set one backend flag differently
    (torch_defaults' TF32 convolutions and cuDNN autotuning off against tf32 and cudnn_benchmark)."""
    names = sorted(p.stem for p in (CONFIGS / "recipe").glob("*.yaml"))
    refused = set()
    for pair in itertools.combinations(names, 2):
        node = OmegaConf.merge(*(OmegaConf.load(CONFIGS / "recipe" / f"{n}.yaml") for n in pair))
        try:
            assert sorted(RecipeStack.from_config(node).names) == sorted(pair)
        except RecipeConflictError as err:
            assert str(err).startswith(f"recipes {pair[0]!r} and {pair[1]!r} cannot be combined"), err
            refused.add(pair)
    assert refused == {("amp_bf16", "amp_fp16"), ("compile", "compile_cudagraphs"), ("tf32", "torch_defaults"),
                       ("cudnn_benchmark", "torch_defaults")}


def test_data_configs_instantiate(whole_head_data):
    cfg = compose_cfg("train", ["data=whole_head", f"data.root={whole_head_data}"])
    with pytest.warns(UserWarning, match="no image"):
        assert len(build_dataset(cfg.data, cfg.model.image_size)) == 1
    assert len(build_dataset(compose_cfg("train", []).data, [32, 32, 32])) == 8


def test_logger_configs_build_their_trackers(monkeypatch, tmp_path):
    """logger=none builds the no-op tracker; logger=wandb a W&B run, offline, in the run's output folder."""
    from med_ddpm import tracking

    assert type(tracking.build_tracker(compose_cfg("train", ["logger=none"]).logger)) is tracking.Tracker
    started = {}
    monkeypatch.setattr(tracking.WandbTracker, "__init__", lambda self, cfg, config: started.update(cfg=cfg))
    cfg = compose_cfg("train", ["logger=wandb", f"output_dir={tmp_path}"])
    assert type(tracking.build_tracker(cfg.logger)) is tracking.WandbTracker
    assert (started["cfg"]["mode"], started["cfg"]["dir"]) == ("offline", str(tmp_path))


def test_every_recipe_config_builds_its_recipe_with_every_option_it_sets():
    """``recipe=[name]`` builds the recipe called ``name``, and each option in its file reaches the recipe (a
    misspelt or ignored key would not)."""
    for path in (CONFIGS / "recipe").glob("*.yaml"):
        node = compose_cfg("train", [f"recipe=[{path.stem}]"])["recipe"][path.stem]
        recipe = instantiate(node)
        assert recipe.name == path.stem
        options = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "_target_"}
        assert {k: recipe.options()[k] for k in options} == options


def test_fast_sample_is_the_few_step_sampler_with_the_fastest_measured_stack():
    """``experiment=fast_sample`` names the stochastic few-step sampler (SDE-DPM-Solver++, 100 steps)
    and the fastest measured forward stack; the default stays the exact FP32 path."""
    from med_ddpm.samplers import sampler_from_config
    from optim import RecipeStack

    cfg = compose_cfg("sample", ["experiment=fast_sample", "checkpoint=x.pt"])
    from med_ddpm.diffusion import NoiseSchedule

    sampler = sampler_from_config(cfg.sampler, NoiseSchedule.from_config(cfg.diffusion))
    assert type(sampler).__name__ == "DPMSolverPPSampler" and cfg.sampler.variant == "sde" and cfg.sampler.steps == 100
    recipes = {r.name: r for r in RecipeStack.from_config(cfg.recipe).recipes}
    assert {"amp_fp16", "channels_last_3d", "fused_groupnorm", "sdpa_attention", "gather_upsample",
            "compile_cudagraphs"} <= set(recipes) and "amp_bf16" not in recipes, "fp16: the precision the gate passes"
    assert recipes["gather_upsample"].forward == "gather", "batch > 1: compiled channels-last F.interpolate is slow"
    assert recipes["narrow_conv_gemm"].narrow == 8, "only the narrow end convolutions run as GEMMs"
    assert compose_cfg("sample", ["checkpoint=x.pt"]).sampler.name == "ddpm"


def test_fast_train_is_the_gather_channels_last_compiled_stack():
    """``experiment=fast_train`` is the fastest measured train stack: channels-last needs ``gather_upsample``
    (the atomic trilinear backward is slow in NDHWC); the default stays the exact FP32 path."""
    cfg = compose_cfg("train", ["experiment=fast_train", "output_dir=/tmp/x"])
    recipes = {r.name: r for r in RecipeStack.from_config(cfg.recipe).recipes}
    names = list(recipes)
    assert {"amp_bf16", "channels_last_3d", "fused_groupnorm", "sdpa_attention", "gather_upsample",
            "dense_conv_grads", "compile_cudagraphs"} <= set(names)
    assert recipes["gather_upsample"].forward == "gather" and recipes["narrow_conv_gemm"].narrow == 8
    assert recipes["fused_groupnorm"].ndhwc_backward == "closed_form" and recipes["fused_adam"].guard == "device"
    stack = RecipeStack.from_config(cfg.recipe)
    assert stack.optimizer_options() == {"fused": True} and stack.inductor_options() == {"realize_reads_threshold": 6}
    assert "checkpointing" not in names and not compose_cfg("train", ["output_dir=/tmp/x"]).get("recipe")


def test_fast_train_fp16_is_fast_train_with_fp16_and_the_loss_scaler():
    """The variant for GPUs without bf16: ``fast_train``'s stack, options and batch with ``amp_fp16`` in place of
    ``amp_bf16``; the stack's GradScaler is on, so fused Adam keeps the host guard (the pair is refused otherwise)."""
    shipped, variant = (compose_cfg("train", [f"experiment={e}", "output_dir=/tmp/x"])
                        for e in ("fast_train", "fast_train_fp16"))
    assert [{"amp_bf16": "amp_fp16"}.get(n, n) for n in shipped.recipe] == list(variant.recipe)
    assert variant.recipe.fused_adam.guard == "host" and variant.train == shipped.train
    assert all(variant.recipe[n] == shipped.recipe[n] for n in shipped.recipe if n not in ("amp_bf16", "fused_adam"))
    stack = RecipeStack.from_config(variant.recipe)
    assert any(r.capabilities.scales_loss for r in stack.recipes) and stack.supported(DeviceInfo("cuda", (7, 0), "V100"))[0]


@pytest.mark.parametrize(("config", "overrides", "where"), [
    ("bench", ["hydra.sweep.dir=/tmp/a"], "/tmp/a"), ("bench", ["hydra.sweep.dir=/tmp/a", "output_dir=/tmp/b"], "/tmp/b"),
    ("bench", ["profile.out=/tmp/p"], "/tmp/p"), ("counters", ["counters.out=/tmp/c"], "/tmp/c")])
def test_hydras_run_folder_is_where_the_results_go(config, overrides, where):
    """Without -m, bench.sweep's results go to hydra.sweep.dir too (output_dir= wins), not to a folder of their own;
    bench.profile's and bench.counters' Hydra log and run record sit beside their rows."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name=config, overrides=overrides, return_hydra_config=True)
    assert cfg.hydra.run.dir == where
