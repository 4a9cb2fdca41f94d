"""bench.micro: the GroupNorm forms it times agree with GroupNorm32, the upsampling forms with F.interpolate,
and the command writes one record of the kinds asked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from bench import micro

CONFIGS = str(Path(__file__).resolve().parents[2] / "configs")


@pytest.mark.filterwarnings("ignore:noisy timing")
def test_run_writes_rows_for_every_form_and_conv(tmp_path) -> None:
    path = micro.run(tmp_path, size=8, compile=False, iters=2)
    record = json.loads(path.read_text())
    assert record["env"]["torch"] == torch.__version__ and record["size"] == 8
    gn = [r for r in record["rows"] if r["kind"] == "groupnorm_silu"]
    assert [r["channels"] for r in gn] == list(micro.CHANNELS)  # CPU, no compile: the eager composite only
    assert all("error" not in r and r["max_abs_err"] == 0.0 and r["ms_median"] > 0 for r in gn)
    convs = [(r["conv"], r["pass"]) for r in record["rows"] if r["kind"] == "conv3d"]
    forms = ["input 3->64", "output 64->1", "output 64->1 via narrow_conv_gemm (col2im)"]
    assert convs == [(f, p) for f in forms for p in ("forward", "forward+backward")]
    for r in record["rows"]:
        if r["kind"] == "conv3d":  # every form is the same convolution (float32 on the CPU)
            assert "error" not in r and r["ms_median"] > 0 and r.get("max_abs_err", 0) < 1e-4, r
    ups = [r for r in record["rows"] if r["kind"] == "upsample_x2"]
    assert [(r["form"], r["batch"]) for r in ups] == [(f, b) for f in ("F.interpolate", "gather forward")
                                                      for b in micro.UPSAMPLE_BATCHES]
    assert all("error" not in r and r["max_abs_err"] < 1e-5 and r["out_channels_last"] for r in ups)
    assert all(r["ms_per_volume"] == pytest.approx(r["ms_median"] / r["batch"]) for r in ups)
    bwd = [r for r in record["rows"] if r["kind"] == "groupnorm_silu_fwd_bwd"]  # eager: the default threshold only
    assert [(r["channels"], r["backward"]) for r in bwd] == [(c, f) for c in micro.CHANNELS for f in micro.NDHWC_BACKWARDS]
    assert all("error" not in r and r["max_abs_err"] < 1e-4 and r["ms_median"] > 0 for r in bwd), bwd


@pytest.mark.filterwarnings("ignore:noisy timing")
@pytest.mark.parametrize("kinds, rows", [("kinds=[conv,upsample]", {"conv3d", "upsample_x2"}),
                                         ("kinds=conv", {"conv3d"})])
def test_the_command_times_the_kinds_asked_for(kinds, rows, tmp_path, capsys) -> None:
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("micro", overrides=[kinds, "size=4", "compile=false", "iters=1",
                                          f"output_dir={tmp_path}"])
    micro.main(cfg)
    record = json.loads((tmp_path / "micro.json").read_text())
    assert {r["kind"] for r in record["rows"]} == rows and record["size"] == 4
    assert capsys.readouterr().out.strip().endswith(str(tmp_path / "micro.json"))


@pytest.mark.slow  # inductor compiles the form on the CPU
def test_the_compiled_ndhwc_form_matches_groupnorm32() -> None:
    x = torch.randn(1, 64, 6, 6, 6)
    w, b = torch.randn(64), torch.randn(64)
    cases = dict((form, (fn, inp)) for form, fn, inp in micro.groupnorm_cases(x, compile=True))
    fn, inp = cases["compiled NDHWC form (fused_groupnorm)"]
    assert inp.is_contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(fn(inp, 32, w, b, 1e-5), micro.group_norm_silu(x, 32, w, b, 1e-5), rtol=1e-5, atol=1e-5)
