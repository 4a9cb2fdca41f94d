"""bench.quality_model on a tiny CPU run of experiment=quality_model: a loss-curve point per checkpoint, the
fidelity numbers with permutation p-values, and the two PNGs."""

import json
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from bench import quality_model
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
    quality_model.main(card_cfg(f"run={run}", f"out={tmp_path / 'card'}", "n=4", "n_masks=2", "device=cpu"))
    summary = json.loads((tmp_path / "card" / "summary.json").read_text())
    assert [p["step"] for p in summary["loss_curve"]] == [1, 2]
    assert all(0 < p["val_loss_ema"] < 10 and 0 < p["val_loss_model"] < 10 for p in summary["loss_curve"])
    assert summary["train_loss"][-1]["last_step"] == 2 and summary["train_loss"][0]["mean_loss"] > 0
    kid = summary["fidelity"]["distribution"]["kid"]
    assert 0 < kid["p_value"] <= 1 and "q95" in kid["null_quantiles"]
    for png in ("samples.png", "sample_mask.png"):
        assert (tmp_path / "card" / png).read_bytes()[:4] == b"\x89PNG"
    assert "random weights, relative numbers only" in (tmp_path / "card" / "summary.md").read_text()
    from bench.core.records import provenance
    assert summary["git_sha"] == provenance()["git_sha"] and f"`{summary['git_sha'][:12]}`" in (
        tmp_path / "card" / "summary.md").read_text(), "the card names the commit that wrote it"


def card_cfg(*overrides):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose("quality_card", overrides=list(overrides))


def refused(capsys, cfg) -> str:
    with pytest.raises(SystemExit) as exit_:
        quality_model.main(cfg)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_usage_errors_name_the_fix(tmp_path, capsys):
    line = refused(capsys, card_cfg(f"run={tmp_path}", f"out={tmp_path / 'o'}"))
    assert re.match(r"error: run=.*: no checkpoints/last.pt; pass a med_ddpm.train output_dir", line)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"")
    line = refused(capsys, card_cfg(f"run={tmp_path}", f"out={tmp_path / 'o'}", "n=6", "n_masks=4"))
    assert line == "error: n=6: not a multiple of n_masks=4; pass n=k*n_masks"
