"""bench.precision_attribution on the tiny model (CPU bf16 autocast): every group is measured both ways, an fp32
island restores the module, keeping the convolutions in float32 removes most of the error, and the command writes
its record."""

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from bench.precision_attribution import GROUPS, attribute, autocast_except, main, members, probe_inputs, table
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.model import UNet3D
from med_ddpm.quality.probe import randomize_zero_init

pytestmark = pytest.mark.usefixtures("one_thread")
CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")


@pytest.fixture(scope="module")
def setup(one_thread):
    torch.manual_seed(0)
    model = randomize_zero_init(UNet3D(in_channels=3, out_channels=1, model_channels=32, channel_mult=(1, 2),
                                       attention_ds=(2,)).eval())
    schedule = NoiseSchedule(timesteps=10)
    return model, probe_inputs(model, schedule, 1, (8, 8, 8), torch.device("cpu"))


def test_every_group_has_members_and_islands_are_undone(setup):
    model, inputs = setup
    assert all(members(model, g) for g in GROUPS)
    convs = members(model, "residual_convs")
    with autocast_except(convs, torch.device("cpu"), torch.bfloat16, inside=False):
        assert "forward" in vars(convs[0])
    assert "forward" not in vars(convs[0])


def test_attribution_finds_the_convolutions(setup):
    model, inputs = setup
    result = attribute(model, inputs, torch.device("cpu"), torch.bfloat16)
    full = result["all"]["eps_rel_l2"]
    assert 1e-4 < full < 0.2  # bf16 moves eps, by bf16-sized amounts
    convs = result["groups"]["residual_convs"]
    assert convs["all_but"]["eps_rel_l2"] < 0.5 * full and convs["only"]["eps_rel_l2"] > 0.3 * full
    assert result["groups"]["time_embedding"]["only"]["eps_rel_l2"] < full
    json.dumps(result)
    assert "| residual_convs |" in table(result)


def test_the_written_result_carries_its_config_and_commit(tmp_path, capsys):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("precision_attribution", overrides=["model=tiny", "model.image_size=[8,8,8]",
                                                          "model.channel_mult=[1,2]", "model.attention_ds=[2]",
                                                          "device=cpu", "n=1", f"output_dir={tmp_path}"])
    main(cfg)
    record = json.loads((tmp_path / "precision_attribution.json").read_text())
    assert record["config"]["model"]["channel_mult"] == [1, 2] and record["config"]["dtype"] == "bfloat16"
    assert len(record["git_sha"]) == 40 and "dirty" in record and record["env"]["torch"] == torch.__version__
    assert record["groups"]["input_conv"]["modules"] == 1
    assert "| residual_convs |" in capsys.readouterr().out
