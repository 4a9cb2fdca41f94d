"""bench.quality_model on a tiny CPU run of experiment=quality_model: a loss-curve point per checkpoint, the
fidelity numbers with permutation p-values, and the two PNGs."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from bench.quality_model import main
from med_ddpm.train import build, fit

CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")


@pytest.mark.slow
def test_quality_model_card_from_a_tiny_run(tmp_path, one_thread):
    run = tmp_path / "run"
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("train", overrides=["experiment=quality_model", "model.image_size=[16,16,16]", "recipe=[]",
                                          "device=cpu", "diffusion.timesteps=10", "data.num_volumes=2",
                                          "train.max_steps=2", "train.save_every=1", "train.ema_start=0",
                                          f"output_dir={run}"])
    assert cfg.seed == 0 and cfg.train.max_steps == 2
    fit(build(cfg))
    assert main([f"run={run}", f"out={tmp_path / 'card'}", "n=4", "n_masks=2", "device=cpu"]) == 0
    summary = json.loads((tmp_path / "card" / "summary.json").read_text())
    assert [p["step"] for p in summary["loss_curve"]] == [1, 2]
    assert all(0 < p["val_loss_ema"] < 10 and 0 < p["val_loss_model"] < 10 for p in summary["loss_curve"])
    kid = summary["fidelity"]["distribution"]["kid"]
    assert 0 < kid["p_value"] <= 1 and "q95" in kid["null_quantiles"]
    for png in ("samples.png", "sample_mask.png"):
        assert (tmp_path / "card" / png).read_bytes()[:4] == b"\x89PNG"
    assert "random weights, relative numbers only" in (tmp_path / "card" / "summary.md").read_text()


def test_usage_errors_name_the_fix(tmp_path):
    with pytest.raises(SystemExit, match="usage: run="):
        main(["out=x"])
    with pytest.raises(SystemExit, match="last.pt not found"):
        main([f"run={tmp_path}", f"out={tmp_path / 'o'}"])
