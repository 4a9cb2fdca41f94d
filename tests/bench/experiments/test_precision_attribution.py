"""bench.experiments.precision_attribution on the tiny model (CPU bf16 autocast): every group is measured both ways, an fp32
island restores the module, and keeping the convolutions in float32 removes most of the error."""

import json

import pytest
import torch

from bench.experiments.precision_attribution import (
    GROUPS,
    attribute,
    autocast_except,
    members,
    probe_inputs,
    table,
)
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.model import UNet3D
from med_ddpm.quality import randomize_zero_init

pytestmark = pytest.mark.usefixtures("one_thread")


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


def test_the_written_result_carries_its_arguments_and_commit(tmp_path):
    from bench.experiments.precision_attribution import main

    assert main(["model=tiny", "device=cpu", "n=1", f"out={tmp_path}"]) == 0
    record = json.loads((tmp_path / "precision_attribution.json").read_text())
    assert record["args"]["model"] == "tiny" and len(record["git_sha"]) == 40 and "dirty" in record
    assert record["groups"]["input_conv"]["modules"] == 1
