"""The misuse corpus: one row per user slip, with the exit status and the one line it must give.

The rows that only differ by their overrides are the table ``tests/misuse.yaml``; the slips that
need a file, a directory or a fault set up first are the test functions here.

A user error ends in exit status 2 and ONE stderr line ``error: <thing>: <problem>; <fix>``
(med_ddpm.cli); nothing runs with a silently changed value. Most rows compose the real config
and call the real entry function in-process (fast); the rows at the end run real subprocesses
to prove the single stderr line and the exit status end to end (marked ``e2e``: ``make test-e2e``,
CI's second step). Rows are grouped by command:
``med_ddpm.train``, ``med_ddpm.sample``, ``med_ddpm.tune``, ``bench.sweep``, ``med_ddpm.evaluate``, ``bench.precision_attribution``,
``bench.floor``, ``bench.micro``.
"""

from __future__ import annotations

import errno
import importlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf

from bench import floor, ladder, micro, precision_attribution, sweep
from bench.core.scenarios import UnsupportedStack, prepared_parts
from med_ddpm import cli, train, tune
from med_ddpm import utils as med_utils
from med_ddpm.data.phantoms import write_phantom_niftis

sample = importlib.import_module("med_ddpm.sample")  # the command; med_ddpm.sample is the API function
evaluate = importlib.import_module("med_ddpm.evaluate")

REPO = Path(__file__).resolve().parents[1]
CONFIGS = str(REPO / "configs")
# A 2-level net on 8^3: the real code path in about a second per step on a 2-core CPU.
TINY = ["model=tiny", "model.image_size=[8,8,8]", "model.channel_mult=[1,2]", "model.attention_ds=[2]", "device=cpu"]
# command -> the overrides every row of it starts from (its config is configs/<command>.yaml)
BASE = {"train": [*TINY, "train.progress=false", "train.grad_accum=1"], "sample": [*TINY, "progress=false"],
        "bench": [*TINY, "experiment=bench_smoke"], "evaluate": ["progress=false"], "precision_attribution": TINY,
        "floor": ["model=tiny"], "micro": ["size=4", "compile=false", "iters=1"],
        "tune": ["~experiment", "++sampler.variant=sde", "device=cpu", "progress=false"], "ladder": ["dry_run=true"]}


@dataclass
class Slip:
    """One row of tests/misuse.yaml: a command, its overrides, the exit status and the pattern of the
    line after ``error: ``."""

    command: str  # a key of BASE
    id: str
    overrides: str  # space-separated
    error: str
    status: int = 2
    cpu_only: bool = False

    def param(self):
        marks = [pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")] if self.cpu_only else []
        return pytest.param(self, id=f"{self.command}-{self.id}", marks=marks)


SLIPS = [Slip(**row) for row in yaml.safe_load((Path(__file__).with_name("misuse.yaml")).read_text())]


def compose_cfg(command: str, overrides: list[str], out: Path | None = None):
    extra = [f"{'out' if command == 'ladder' else 'output_dir'}={out}"] if out is not None else []
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name=command, overrides=[*BASE[command], *extra, *overrides])


def refusal(capsys, call, *args, status: int = 2) -> str:
    """Call ``call(*args)``; it must exit with ``status`` and print one ``error:`` line; return the line."""
    with pytest.raises(SystemExit) as exit_:
        call(*args)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == status, lines
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0].removeprefix("error: ")


def composed_or_refused(capsys, slip: Slip, overrides: list[str], out: Path) -> str:
    """The line for a slip caught either by Hydra's composition or by the command's own check."""
    try:
        cfg = compose_cfg(slip.command, overrides, out)
    except HydraException as err:  # what cli.run reports (exit status 2) for an error before the task starts
        line = cli.user_error_line(err)
        assert line is not None and "\n" not in line and slip.status == 2, str(err)
        return line
    check = {"train": train.main, "sample": sample.main, "bench": cli.entry(sweep.check_options),
             "evaluate": evaluate.main, "precision_attribution": precision_attribution.main, "floor": floor.main,
             "micro": micro.main, "tune": tune.main, "ladder": cli.entry(ladder.run)}[slip.command]
    return refusal(capsys, check, cfg, status=slip.status)


# ---------------------------------------------------------------------------------------------- train


@pytest.mark.parametrize("recipe", ["compile_cudagraphs", "amp_fp16"])
def test_gpu_only_recipe_is_refused_on_a_cpu(recipe, tmp_path, capsys):
    """Not a row timed or trained without its graphs / 100x slower without a word (build only: no training)."""
    cfg = compose_cfg("train", [f"recipe=[{recipe}]"], tmp_path)
    line = refusal(capsys, cli.entry(train.build), cfg)
    assert re.search(rf"^recipe '{recipe}' is unsupported on this device: ", line)


@pytest.mark.parametrize("recipe", ["compile_cudagraphs", "amp_fp16"])
def test_gpu_only_recipe_is_an_unsupported_bench_row_on_a_cpu(recipe):
    """bench.sweep times a row only for a stack the device runs (else the worker's row says unsupported)."""
    cfg = OmegaConf.to_container(compose_cfg("bench", [f"recipe=[{recipe}]", "output_dir=/unused"]), resolve=True)
    with pytest.raises(UnsupportedStack, match=rf"^recipe '{recipe}' is unsupported on this device: "):
        with prepared_parts(cfg, torch.device("cpu")):
            pass


def test_train_refuses_an_output_dir_holding_a_run(tmp_path, capsys):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"a run")
    line = refusal(capsys, train.main, compose_cfg("train", ["train.max_steps=1"], tmp_path))
    assert re.search(r"output_dir=.*: already holds a training run .*; pass resume=auto to continue it", line)
    assert (tmp_path / "checkpoints" / "last.pt").read_bytes() == b"a run"


def test_brats_data_in_another_layout(tmp_path, capsys):
    """data=brats on a whole-head folder: no case is found, and the line says which layouts data=brats reads."""
    write_phantom_niftis(tmp_path / "data", 1, (8, 8, 8))
    cfg = compose_cfg("train", ["data=brats", "model=tiny_brats", f"data.root={tmp_path / 'data'}"], tmp_path / "out")
    with pytest.warns(UserWarning, match="unexpected names"):
        line = refusal(capsys, train.main, cfg)
    assert re.search(r"/data: no usable image/mask pairs \(skipped 0\); pass data\.root=<a folder of BraTS cases>, "
                     r"per_case .* or per_modality .* \(data=whole_head for image/ and mask/\)$", line), line


def test_save_every_zero_means_only_last_pt(tmp_path):
    """train.save_every=0 (a ZeroDivisionError before) is off, like sample_every=0: last.pt only, at the end."""
    loss = train.main(compose_cfg("train", ["train.max_steps=2", "train.save_every=0"], tmp_path))
    assert loss == loss  # finite: it trained
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.pt"]
    assert torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=False)["step"] == 2


@pytest.mark.parametrize("where, error, pattern", [
    ("mkstemp", OSError(errno.EACCES, "Permission denied", "OUT"), r"^OUT: Permission denied; fix its permissions"),
    ("mkstemp", OSError(errno.EROFS, "Read-only file system", "OUT"), r"^OUT: Read-only file system; choose an output_dir="),
    ("fsync", OSError(errno.ENOSPC, "No space left on device"),
     r"^output_dir=.*: No space left on device; free some space or choose an output_dir= on another disk$"),
], ids=["read-only-dir", "read-only-fs", "disk-full"])
def test_unwritable_output_is_one_line(where, error, pattern, tmp_path, capsys, monkeypatch):
    """The atomic writer fails as a read-only directory or a full disk would make it (simulated: the
    tests run as root, for whom permissions do not apply); no partial checkpoint is left behind."""
    def fail(*args, **kwargs):
        raise error

    target = med_utils.tempfile if where == "mkstemp" else med_utils.os
    monkeypatch.setattr(target, where, fail)
    line = refusal(capsys, train.main, compose_cfg("train", ["train.max_steps=1"], tmp_path))
    assert re.search(pattern, line.replace(str(error.filename), "OUT") if error.filename else line), line
    assert not list(tmp_path.rglob("*.pt")) and not list(tmp_path.rglob("*.tmp"))


# --------------------------------------------------------------------------------------------- sample
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A whole-head checkpoint of the 8^3 net, written by med_ddpm.train itself (one step)."""
    out = tmp_path_factory.mktemp("run")
    train.main(compose_cfg("train", ["train.max_steps=1"], out))
    return out / "checkpoints" / "last.pt"


def sample_cfg(checkpoint: Path, out: Path, *overrides: str):
    return compose_cfg("sample", [f"checkpoint={checkpoint}", "sampler=ddim", "sampler.steps=2", *overrides], out)




def test_sample_without_a_checkpoint(tmp_path, capsys):
    line = refusal(capsys, sample.main, compose_cfg("sample", [], tmp_path))
    assert re.search(r"^checkpoint: not set; pass checkpoint=PATH", line)


def test_sample_checkpoint_not_found(tmp_path, capsys):
    line = refusal(capsys, sample.main, sample_cfg(Path("/nonexistent/model_128.pt"), tmp_path))
    assert line == "checkpoint not found: /nonexistent/model_128.pt; check the path"


@pytest.fixture(scope="module")
def original_checkpoint(checkpoint, tmp_path_factory) -> Path:
    """The same net in the original Med-DDPM format, which records no training size: masks are sampled at theirs."""
    from med_ddpm.checkpoint import load_checkpoint, save_medddpm_checkpoint

    loaded = load_checkpoint(checkpoint)
    state = loaded.model.state_dict()
    return Path(save_medddpm_checkpoint(tmp_path_factory.mktemp("orig") / "model.pt", state, state, loaded.schedule, 1))


@pytest.mark.parametrize("fmt", ["checkpoint", "original_checkpoint"])
def test_sample_unreadable_mask(fmt, tmp_path, capsys, request):
    """Also where the mask's own size is read first (an original checkpoint)."""
    masks = tmp_path / "masks"
    masks.mkdir()
    (masks / "broken.nii.gz").write_bytes(b"not a nifti")
    line = refusal(capsys, sample.main, sample_cfg(request.getfixturevalue(fmt), tmp_path / "out", f"masks={masks}"))
    assert re.search(r"broken\.nii\.gz: unreadable NIfTI mask", line)


def test_sample_empty_mask_folder(checkpoint, tmp_path, capsys):
    (tmp_path / "masks").mkdir()
    line = refusal(capsys, sample.main, sample_cfg(checkpoint, tmp_path / "out", f"masks={tmp_path / 'masks'}"))
    assert re.search(r"masks=.*: folder has no \.nii/\.nii\.gz mask files; pass a folder", line)


def test_sample_refuses_an_output_dir_holding_samples(checkpoint, tmp_path, capsys):
    (tmp_path / "phantom_0.nii.gz").write_bytes(b"an earlier sample")
    line = refusal(capsys, sample.main, sample_cfg(checkpoint, tmp_path))
    assert re.search(r"output_dir=.*: already holds 1 sample\(s\) \(phantom_0\.nii\.gz, \.\.\.\); choose another", line)
    assert (tmp_path / "phantom_0.nii.gz").read_bytes() == b"an earlier sample"


def test_brats_masks_for_a_whole_head_checkpoint(checkpoint, tmp_path, capsys):
    """A checkpoint of the wrong variant for the masks: the mask is named with the labels it cannot take."""
    write_phantom_niftis(tmp_path / "brats", 1, (8, 8, 8), variant="brats")
    seg = next((tmp_path / "brats").rglob("*seg*.nii.gz"))
    line = refusal(capsys, sample.main, sample_cfg(checkpoint, tmp_path / "out", f"masks={seg}"))
    assert re.search(rf"{seg.name}: unexpected mask labels \[4\] \(expected a subset of \[0, 1, 2\]\); a BraTS seg needs", line)


@pytest.fixture(scope="module")
def brats_checkpoint(tmp_path_factory) -> Path:
    """A BraTS checkpoint of the 8^3 net (4 modalities + 4 mask channels), one step on BraTS phantoms."""
    out = tmp_path_factory.mktemp("brats_run")
    train.main(compose_cfg("train", ["data.variant=brats", "model.in_channels=8", "model.out_channels=4",
                                     "model.cond_channels=4", "train.max_steps=1"], out))
    return out / "checkpoints" / "last.pt"


def test_masks_without_label_3_for_a_brats_checkpoint(brats_checkpoint, tmp_path, capsys):
    """Labels without 3 may be raw BraTS labels or Med-DDPM's (or a whole-head mask): the line says what sampling takes,
    and the option it gives is one the sample command has."""
    write_phantom_niftis(tmp_path / "data", 1, (8, 8, 8))  # a whole-head mask: labels 0 and 1 at this size
    masks = f"masks={tmp_path / 'data' / 'mask'}"
    line = refusal(capsys, sample.main, sample_cfg(brats_checkpoint, tmp_path / "out", masks))
    assert re.search(r"phantom_0000\.nii\.gz: labels \[0, 1\] may be raw BraTS labels .* if they are Med-DDPM's, "
                     r"pass data=brats data\.seg_labels=medddpm \(sampling takes no raw BraTS labels", line), line
    sample.main(sample_cfg(brats_checkpoint, tmp_path / "fixed", masks, "data=brats", "data.seg_labels=medddpm"))
    assert (tmp_path / "fixed" / "phantom_0000.nii.gz").is_file()


@pytest.mark.parametrize("kind, reason", [
    ("nifti", "gzip data, such as a .nii.gz volume"),
    ("truncated", "a truncated or damaged zip archive"),
    ("empty", "the file is empty"),
])
def test_sample_checkpoint_that_is_no_pytorch_checkpoint(kind, reason, checkpoint, tmp_path, capsys):
    """One short line: not torch's paragraph advising ``weights_only=False`` (unsafe for a file of unknown origin)."""
    write_phantom_niftis(tmp_path, 1, (8, 8, 8))
    bad = tmp_path / f"{kind}.pt"
    bad.write_bytes({"nifti": (tmp_path / "image" / "phantom_0000.nii.gz").read_bytes(),
                     "truncated": checkpoint.read_bytes()[:5000], "empty": b""}[kind])
    line = refusal(capsys, sample.main, sample_cfg(bad, tmp_path / "out"))
    assert line == (f"checkpoint={bad}: not a PyTorch checkpoint ({reason}); pass a checkpoint written by "
                    "med_ddpm.train or the published Med-DDPM weights")


def test_resume_from_a_file_that_is_no_pytorch_checkpoint(tmp_path, capsys):
    (tmp_path / "empty.pt").write_bytes(b"")
    line = refusal(capsys, train.main, compose_cfg("train", [f"resume={tmp_path / 'empty.pt'}"], tmp_path / "out"))
    assert line == (f"resume={tmp_path / 'empty.pt'}: not a PyTorch checkpoint (the file is empty); pass resume=auto, "
                    "or a checkpoint written by med_ddpm.train")


def test_masks_of_mixed_sizes_each_get_their_own_size(checkpoint, tmp_path):
    """Masks of several sizes are each sampled at the checkpoint's size and written back at their own."""
    masks = tmp_path / "data"
    write_phantom_niftis(masks, 1, (8, 8, 8), names=["small"])
    write_phantom_niftis(masks, 1, (16, 16, 8), names=["wide"])
    sample.main(sample_cfg(checkpoint, tmp_path / "out", f"masks={masks / 'mask'}"))
    for name in ("small", "wide"):
        assert nib.load(tmp_path / "out" / f"{name}.nii.gz").shape == nib.load(masks / "mask" / f"{name}.nii.gz").shape


# ------------------------------------------------------------------------ the table: tests/misuse.yaml

@pytest.mark.parametrize("slip", [s.param() for s in SLIPS])
def test_slip(slip, tmp_path, capsys, request):
    """Every row of the table: its exit status and its one line."""
    overrides = slip.overrides.split()
    if slip.command in ("sample", "tune"):
        checkpoint = request.getfixturevalue("checkpoint")
        sampler = ["sampler=ddim", "sampler.steps=2"] if slip.command == "sample" else []
        overrides = [f"checkpoint={checkpoint}", *sampler, *overrides]
    assert re.search(slip.error, composed_or_refused(capsys, slip, overrides, tmp_path))


# --------------------------------------------------------------------------------- real subprocesses
def run_cli(module: str, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env = {**base, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=180)


@pytest.mark.e2e
@pytest.mark.parametrize("module, args, pattern", [
    ("med_ddpm.train", ["sampler=ddim", "sampler.steps=0"], r"^error: sampler\.steps=0: must be in \[1, 250\]"),
    ("med_ddpm.train", ["recipe=[tf23]"], r"^error: recipe=tf23: no configs/recipe/tf23\.yaml; valid names: amp_bf16"),
    ("bench.sweep", ["experiment=bench_smoke", "bench.iters=0"], r"^error: bench\.iters=0: must be an integer >= 1"),
    ("bench.precision_attribution", ["device=cpu", "checkpoint=/nonexistent/last.pt"],
     r"^error: checkpoint not found: /nonexistent/last\.pt; check the path$"),
    ("bench.floor", ["profile=/nonexistent/p.json", "peaks=/nonexistent/peaks.json"],
     r"^error: profile=/nonexistent/p\.json: cannot read \(No such file or directory\); pass a JSON file"),
    ("bench.micro", ["kinds=[convs]"], r"^error: kinds='convs': unknown value; pass one of groupnorm, "),
], ids=["train-steps-zero", "train-recipe-unknown", "bench-iters-zero", "precision-attribution-checkpoint-missing",
        "floor-profile-missing", "micro-kinds-unknown"])
def test_cli_prints_one_line_and_exits_2(module, args, pattern, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = run_cli(module, *args, f"output_dir={tmp_path / 'out'}", cwd=cwd)
    assert proc.returncode == 2, proc.stderr
    assert re.search(pattern, proc.stderr.strip()) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    if module != "bench.sweep" and "tf23" not in " ".join(args):  # composed: Hydra's run dir is the output_dir
        assert len(list((tmp_path / "out" / ".hydra").glob("*/config.yaml"))) == 1  # one launch, its own record
        assert (tmp_path / "out" / f"{module.split('.')[-1]}.log").is_file()
    assert not (cwd / "outputs").exists()  # nothing of the run lands in the working directory


@pytest.mark.e2e
def test_output_dir_naming_a_file_is_one_line_before_anything_runs(tmp_path):
    """Hydra makes the run's folder before the command starts: a file in its place is named, exit 2."""
    (tmp_path / "taken").write_text("a file")
    proc = run_cli("med_ddpm.evaluate", "real=.", "generated=.", f"output_dir={tmp_path / 'taken'}", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: {tmp_path / 'taken'}: a file, not a folder; pass a folder (a new or an existing one), or remove the file")
    assert (tmp_path / "taken").read_text() == "a file"


@pytest.mark.slow
def test_hydra_full_error_keeps_the_traceback(tmp_path):
    proc = run_cli("med_ddpm.train", "sampler=ddim", "sampler.steps=0", f"output_dir={tmp_path}", cwd=tmp_path,
                   env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr
    assert "ConfigError: sampler.steps=0" in proc.stderr


@pytest.mark.parametrize("bug", [KeyError("x"), OSError(errno.EBADF, "Bad file descriptor"), RuntimeError("oops")])
def test_a_bug_keeps_its_traceback(bug, capsys):
    """Only user errors become one line; anything else propagates (Hydra prints its traceback)."""
    def task(cfg):
        raise bug

    with pytest.raises(type(bug)):
        cli.entry(task)(OmegaConf.create({"output_dir": "/tmp/x"}))
    assert capsys.readouterr().err == ""


# What the BraTS training loop printed on the H200 under train.memory_cap_gib=16 (bench/results/h200/e2e)
H200_OOM = ("CUDA out of memory. Tried to allocate 1.27 GiB. GPU 0 has a total capacity of 139.80 GiB of which 123.84 "
            "GiB is free. Including non-PyTorch memory, this process has 15.95 GiB memory in use. 16.00 GiB allowed; Of "
            "the allocated memory 11.21 GiB is allocated by PyTorch, and 4.05 GiB is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
            "Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-"
            "cuda-alloc-conf)")


def test_running_out_of_gpu_memory_is_one_line_with_the_figures_and_exit_3(capsys):
    def task(cfg):
        raise torch.OutOfMemoryError(H200_OOM)

    with pytest.raises(SystemExit) as stop:
        cli.entry(task)(OmegaConf.create({"output_dir": "/tmp/x"}))
    err = capsys.readouterr().err
    assert stop.value.code == cli.EXIT_OUT_OF_MEMORY == 3 and err.count("\n") == 1
    assert err.startswith("error: CUDA out of memory. Tried to allocate 1.27 GiB.")
    assert "16.00 GiB allowed" in err and "4.05 GiB is reserved by PyTorch but unallocated; lower train.batch_size" in err
    assert "See documentation" not in err


def test_a_bug_inside_build_keeps_its_type_and_a_config_error_names_the_node():
    from med_ddpm.config_checks import ConfigError, as_config_error

    with pytest.raises(TypeError, match="^a bug$"), as_config_error("options", "fix"):
        raise TypeError("a bug")
    strict = OmegaConf.create({"a": 1})
    OmegaConf.set_struct(strict, True)
    with pytest.raises(ConfigError, match="^options: Key 'b' is not in struct"), as_config_error("options", "fix"):
        _ = strict.b


@pytest.mark.slow  # the same line as test_report.py's absent-folder case, which also checks nothing is created
def test_report_of_a_folder_without_results_is_one_line(tmp_path):
    proc = run_cli("bench.report", f"dir={tmp_path / 'none'}", cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert re.match(r"error: .*none: no results file \(results\.jsonl\); pass the folder a sweep or ladder wrote", lines[0])


def _sigint_default() -> None:
    """A child of a shell's background job inherits SIGINT ignored, and Python then never raises
    KeyboardInterrupt: the command would train on through the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.e2e
def test_ctrl_c_ends_a_command_in_one_line(tmp_path):
    """Ctrl-C during training: exit status 130, last.pt at the step reached and one line saying how to resume, not a
    KeyboardInterrupt traceback."""
    run_dir, err, out = tmp_path / "run", tmp_path / "stderr.txt", tmp_path / "stdout.txt"
    with err.open("w") as stderr, out.open("w") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "med_ddpm.train", *BASE["train"], "+logger.log_every=1",
                                 "train.max_steps=100000", f"output_dir={run_dir}"], cwd=tmp_path, stderr=stderr,
                                stdout=stdout, preexec_fn=_sigint_default,
                                env={**{k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"},
                                     "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1"})
        try:
            deadline = time.monotonic() + 120
            while not (run_dir / "loss.jsonl").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert (run_dir / "loss.jsonl").exists(), err.read_text()
            proc.send_signal(signal.SIGINT)
            try:
                assert proc.wait(timeout=60) == 130
            except subprocess.TimeoutExpired:  # still running: SIGABRT makes faulthandler print every thread's stack
                proc.send_signal(signal.SIGABRT)
                proc.wait(timeout=30)
                pytest.fail(f"no exit 60 s after SIGINT; its threads:\n{err.read_text()[-6000:]}")
        finally:
            proc.kill()
    said = (out.read_text() + err.read_text()).strip().splitlines()
    assert "Traceback" not in err.read_text() and (run_dir / "checkpoints" / "last.pt").is_file(), err.read_text()
    assert re.search(r"stopped by SIGINT at step \d+: checkpoints/last\.pt holds it; resume with: python -m "
                     r"med_ddpm\.train .*resume=auto$", said[-1]), said[-3:]
