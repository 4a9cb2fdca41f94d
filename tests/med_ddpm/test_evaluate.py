"""med_ddpm.evaluate on the real whole-head sample (cut to 32^3): metrics, outputs and every bad input."""

import json
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from med_ddpm.config_checks import DataError
from med_ddpm.quality.evaluate import evaluate

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def whole_head(whole_head_data):
    """The one complete image/mask pair, every 4th voxel (32^3), and the four masks at the same grid."""
    root = whole_head_data
    image = np.asanyarray(nib.load(root / "image" / "sample_3.nii.gz").dataobj)[::4, ::4, ::4].astype(np.float32)
    masks = {p.name: np.asanyarray(nib.load(p).dataobj)[::4, ::4, ::4] for p in sorted((root / "mask").glob("*.nii.gz"))}
    return image, masks


def _write(folder: Path, name: str, data: np.ndarray) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(data, np.eye(4)), folder / name)
    return folder / name


@pytest.fixture(scope="module")
def folders(whole_head, tmp_path_factory):
    image, masks = whole_head
    root = tmp_path_factory.mktemp("eval")
    rng = np.random.default_rng(0)
    for k, (name, mask) in enumerate(masks.items()):
        _write(root / "mask", name, mask)
        real = np.roll(image, k, axis=0)
        _write(root / "real", name, real)
        _write(root / "close", name, np.clip(real + rng.normal(0, 0.02, real.shape), -1, 1).astype(np.float32))
        _write(root / "far", name, (0.3 * real - 0.5).astype(np.float32))
    return root


def _cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("evaluate", overrides=[f"output_dir={tmp_path / 'out'}", "n_perm=200", "max_pairs=3",
                                             "progress=false", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def test_close_and_far_sets_with_regions_and_pairs(folders, tmp_path):
    close = evaluate(_cfg(tmp_path, f"real={folders / 'real'}", f"generated={folders / 'close'}",
                          f"masks={folders / 'mask'}"))
    far = evaluate(_cfg(tmp_path, f"real={folders / 'real'}", f"generated={folders / 'far'}",
                        f"masks={folders / 'mask'}"))
    assert close["n_real"] == close["n_generated"] == 4 and close["shape"] == [32, 32, 32]
    assert close["paired"]["n"] == 4 and 38 < close["paired"]["psnr"] < 45 and close["paired"]["ssim"] > 0.8
    assert far["paired"]["psnr"] < close["paired"]["psnr"]
    for key in ("fid", "kid", "mmd", "histogram_w1"):
        assert far["distribution"][key]["value"] > close["distribution"][key]["value"], key
    assert far["distribution"]["histogram_w1"]["p_value"] < 0.02  # 4 vs 4: the smallest p a shuffle can give
    assert set(close["region_histogram_w1"]) == {"brain", "tumour"} and "psnr_tumour" in close["paired"]
    assert close["extractor"]["relative_only"] is True
    out = tmp_path / "out"
    assert json.loads((out / "metrics.json").read_text())["n_generated"] == 4
    assert "relative numbers" in (out / "summary.md").read_text()
    assert (out / "montage.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_intensity_minmax_scales_raw_volumes(folders, tmp_path, whole_head):
    raw = tmp_path / "raw"
    _write(raw, "a.nii.gz", (whole_head[0] + 1) * 500)
    _write(raw, "b.nii.gz", (np.roll(whole_head[0], 1, 0) + 1) * 500)
    with pytest.raises(DataError, match=r"a\.nii\.gz.*intensity=minmax"):
        evaluate(_cfg(tmp_path, f"real={folders / 'real'}", f"generated={raw}"))
    m = evaluate(_cfg(tmp_path, f"real={folders / 'real'}", f"generated={raw}", "intensity=minmax"))
    assert m["paired"] == {} and m["n_generated"] == 2


def _bad(tmp_path, folders, name, data=None, raw=None):
    bad = tmp_path / "bad"
    for p in (folders / "close").iterdir():
        (bad / p.name).parent.mkdir(parents=True, exist_ok=True)
        (bad / p.name).write_bytes(p.read_bytes())
    if raw is not None:
        (bad / name).write_bytes(raw)
    else:
        _write(bad, name, data)
    return bad


@pytest.mark.parametrize("case, pattern", [
    ("corrupt", r"zz\.nii\.gz: unreadable NIfTI"),
    ("shape", r"zz\.nii\.gz: shape \(16, 16, 16\) differs"),
    ("nan", r"zz\.nii\.gz: generated image contains 1 NaN"),
])
def test_bad_input_is_one_line_naming_the_file(folders, tmp_path, case, pattern):
    good = np.asanyarray(nib.load(next((folders / "close").iterdir())).dataobj).astype(np.float32)
    if case == "corrupt":
        gz = (folders / "close" / "sample_0.nii.gz").read_bytes()
        bad = _bad(tmp_path, folders, "zz.nii.gz", raw=gz[: len(gz) // 2])
    elif case == "shape":
        bad = _bad(tmp_path, folders, "zz.nii.gz", np.zeros((16, 16, 16), np.float32))
    else:
        good[1, 2, 3] = np.nan
        bad = _bad(tmp_path, folders, "zz.nii.gz", good)
    with pytest.raises(DataError, match=pattern) as err:
        evaluate(_cfg(tmp_path, f"real={folders / 'real'}", f"generated={bad}"))
    assert "\n" not in str(err.value)


def test_a_sample_output_folder_is_read_for_its_volumes(folders, tmp_path, caplog):
    """What med_ddpm.sample writes beside its volumes (log, PNGs, timings.json, .hydra/) is passed over, with a
    log line, so train -> sample -> evaluate chains as the user guide shows."""
    out = _bad(tmp_path, folders, "sample.log", raw=b"a log")
    for name in ("sample_0.png", "timings.json"):
        (out / name).write_bytes(b"{}")
    (out / ".hydra").mkdir()
    (out / "sub").mkdir()
    with caplog.at_level("INFO", logger="med_ddpm.evaluate"):
        m = evaluate(_cfg(tmp_path, f"real={folders / 'real'}", f"generated={out}"))
    assert m["n_generated"] == len(list((folders / "close").iterdir()))
    assert "passed over 4 other entries (sample.log, sample_0.png, sub, timings.json)" in caplog.text


def test_an_output_dir_holding_an_evaluation_is_refused(folders, tmp_path, capsys):
    from med_ddpm.evaluate import main

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.json").write_text("{}")
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("evaluate", overrides=[f"output_dir={tmp_path / 'out'}", f"real={folders / 'real'}",
                                             f"generated={folders / 'close'}"])
    with pytest.raises(SystemExit) as exit_:
        main(cfg)
    assert exit_.value.code == 2 and (tmp_path / "out" / "metrics.json").read_text() == "{}"
    assert capsys.readouterr().err.startswith(f"error: output_dir={tmp_path / 'out'}: already holds an evaluation "
                                              "(metrics.json); choose another output_dir=")


def test_empty_or_missing_folder(folders, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"generated=.*empty: folder has no \.nii"):
        evaluate(_cfg(tmp_path, f"real={folders / 'real'}", f"generated={tmp_path / 'empty'}"))
    with pytest.raises(DataError, match="real=.*nowhere: not a folder"):
        evaluate(_cfg(tmp_path, f"real={tmp_path / 'nowhere'}", f"generated={folders / 'close'}"))


def test_generated_file_without_a_mask_is_named(folders, tmp_path):
    masks = tmp_path / "masks"
    _write(masks, "sample_0.nii.gz", np.zeros((32, 32, 32), np.uint8))
    with pytest.raises(DataError, match=r"sample_1\.nii\.gz: no mask named sample_1"):
        evaluate(_cfg(tmp_path, f"real={folders / 'real'}", f"generated={folders / 'close'}", f"masks={masks}"))


@pytest.mark.slow
def test_the_command_as_documented(folders, tmp_path):
    out = tmp_path / "cli"
    done = subprocess.run([sys.executable, "-m", "med_ddpm.evaluate", f"real={folders / 'real'}",
                           f"generated={folders / 'close'}", f"output_dir={out}", "n_perm=100", "progress=false"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "metrics.json" in done.stdout and (out / "metrics.json").is_file()


def test_one_volume_a_side_skips_what_needs_two(folders, tmp_path, whole_head):
    """A covariance (FID) and an unbiased MMD need two volumes a side: with one, the report says so and the
    paired metrics are still computed (the shared data folder holds one image)."""
    image, _ = whole_head
    _write(tmp_path / "one", "sample_3.nii.gz", image)
    m = evaluate(_cfg(tmp_path, f"real={tmp_path / 'one'}", f"generated={tmp_path / 'one'}", "intensity=minmax"))
    assert m["distribution"]["fid"] == {"value": None, "skipped": "needs >= 2 volumes in each folder"}
    assert "kid" not in m["distribution"] and m["paired"]["n"] == 1 and m["paired"]["ssim"] == pytest.approx(1.0)
    assert "not computed: needs >= 2 volumes" in (tmp_path / "out" / "summary.md").read_text()


@pytest.mark.e2e
def test_logger_wandb_makes_one_offline_run_of_the_metrics(folders, tmp_path, wandb_offline):
    """metrics.json is the run's summary and the montage is logged as an image, read back from the offline run."""
    from med_ddpm.evaluate import main

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        main(compose("evaluate", overrides=[f"output_dir={tmp_path / 'out'}", f"real={folders / 'real'}",
                                            f"generated={folders / 'close'}", "n_perm=200", "max_pairs=3",
                                            "progress=false", "logger=wandb"]))
    (run,) = wandb_offline(tmp_path / "out")
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert (run["name"], run["job_type"], run["config"]["real"]) == ("out", "evaluate", str(folders / "real"))
    assert run["summary"]["n_generated"] == metrics["n_generated"]
    assert run["summary"]["distribution"] == metrics["distribution"]
    assert list((tmp_path / "out" / "wandb").rglob("files/media/images/evaluate/montage*.png"))
