"""The project's compile cache: one file per (torch, GPU, recipes, workload); cold, then warm in a new process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import pytest
import torch
from hydra import compose, initialize_config_dir

from med_ddpm.compile_cache import CompileCache, cache_status, code_digest
from optim import RecipeStack
from optim.compile import Compile

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


def stack(mode: str = "default") -> RecipeStack:
    return RecipeStack([Compile(mode=mode)])


def test_no_compile_recipe_or_no_folder_means_no_cache(tmp_path):
    assert CompileCache.for_run(tmp_path, "train", RecipeStack([]), CPU, {}) is None
    assert CompileCache.for_run(None, "train", stack(), CPU, {}) is None
    assert cache_status(None) == "off"


def test_the_file_is_keyed_by_recipes_options_and_workload(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # recorded, so teardown undoes what for_run sets
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    one = CompileCache.for_run(tmp_path, "sample", stack(), CPU, {"batch": 1})
    assert one.path == CompileCache.for_run(tmp_path, "sample", stack(), CPU, {"batch": 1}).path
    others = [CompileCache.for_run(tmp_path, "sample", stack("reduce-overhead"), CPU, {"batch": 1}),
              CompileCache.for_run(tmp_path, "sample", stack(), CPU, {"batch": 2})]
    assert len({one.path, *(c.path for c in others)}) == 3 and one.path.parent == tmp_path
    assert one.key["torch"] == torch.__version__ and one.key["device"] == "cpu"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's choice stays
    CompileCache.for_run(tmp_path, "sample", stack(), CPU, {"batch": 1})
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_a_compile_recipe_with_aot_gets_its_file_and_other_code_digests_go(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # recorded, so teardown undoes what for_run sets
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    aot = RecipeStack([Compile(aot=True)])
    cache = CompileCache.for_run(tmp_path, "sample", aot, CPU, {"batch": 1})
    assert aot.recipes[0].aot_file == cache.aot_path == tmp_path / f"{cache.path.stem}-{code_digest()}.aot"
    assert cache.path != CompileCache.for_run(tmp_path, "sample", stack(), CPU, {"batch": 1}).path  # aot is keyed
    stale, other = cache.aot_path.with_name(f"{cache.path.stem}-000000000000.aot"), tmp_path / "train-0-0.aot"
    for path in (stale, other, cache.aot_path):
        path.write_bytes(b"x")
    CompileCache.for_run(tmp_path, "sample", aot, CPU, {"batch": 1})
    assert (stale.exists(), other.exists(), cache.aot_path.exists()) == (False, True, True)
    plain = stack()
    CompileCache.for_run(tmp_path, "sample", plain, CPU, {"batch": 1})
    assert plain.recipes[0].aot_file is None


def test_a_missing_or_unreadable_file_is_a_cold_start(tmp_path):
    cache = CompileCache(tmp_path, "train", {"k": 1})
    assert cache.load() == "cold"
    cache.path.write_bytes(b"not torch's artifacts")
    assert cache.load() == "cold" and cache.status == "cold"


def test_the_configs_put_the_cache_under_the_cache_dir(monkeypatch):
    monkeypatch.setenv("MED_DDPM_CACHE_DIR", "/somewhere")
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        for name in ("train", "sample"):
            assert compose(name, overrides=["output_dir=.", "checkpoint=x"] if name == "sample"
                           else ["output_dir=."]).paths.compile_cache == "/somewhere/compile"


SCRIPT = """
import sys, torch
from med_ddpm.compile_cache import CompileCache
from optim import RecipeStack
from optim.compile import Compile
stack = RecipeStack([Compile()])
cache = CompileCache.for_run(sys.argv[1], "test", stack, torch.device("cpu"), {"shape": [4, 8]})
status = cache.load()
net = stack.prepare_model(torch.nn.Linear(8, 8))
net(torch.randn(4, 8))
print(status, cache.save() is not None)
"""


@pytest.mark.slow
def test_a_second_process_starts_warm(tmp_path):
    """Two fresh interpreters: the first compiles and saves, the second loads the artifacts."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    runs = [subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                           cwd=REPO, timeout=300, env=env) for _ in range(2)]
    assert [r.stdout.split() for r in runs] == [["cold", "True"], ["warm", "False"]], runs[0].stderr[-2000:]
    assert len(list(tmp_path.glob("test-*.bin"))) == 1 and (tmp_path / "inductor").is_dir()


TRAIN_SCRIPT = """
import sys, torch
from torch._dynamo.utils import counters
from med_ddpm.compile_cache import CompileCache
from optim import RecipeStack
from optim.compile import Compile

class Twice(torch.autograd.Function):  # a custom Function, as gather_upsample and dense_conv_grads hold
    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad

class Net(torch.nn.Linear):
    def forward(self, x):
        return Twice.apply(super().forward(x))

stack = RecipeStack([Compile()])
cache = CompileCache.for_run(sys.argv[1], "train", stack, torch.device("cpu"), {"shape": [4, 8]})
with stack.session():
    status = cache.load()
    net = stack.prepare_model(Net(8, 8))
    net(torch.randn(4, 8)).sum().backward()
    cache.save()
print(status, *sorted(k for k in counters["aot_autograd"] if k.startswith("autograd_cache")))
"""


@pytest.mark.slow
def test_a_warm_training_step_loads_its_joint_graph_despite_a_custom_autograd_function(tmp_path):
    """torch's AOTAutograd cache refuses graphs with a custom autograd.Function unless the compile recipe's session
    allows them: without it every warm start traced and partitioned the joint graph again."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    runs = [subprocess.run([sys.executable, "-c", TRAIN_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                           cwd=REPO, timeout=300, env=env) for _ in range(2)]
    assert [r.stdout.split() for r in runs] == [["cold", "autograd_cache_miss", "autograd_cache_saved"],
                                                ["warm", "autograd_cache_hit"]], runs[0].stderr[-2000:]


@pytest.mark.slow
def test_the_commands_do_not_import_inductor_without_a_compile_recipe():
    """Start-up: importing torch's compiler stack takes seconds; an eager run never pays it."""
    probe = "import sys, med_ddpm.train, med_ddpm.sample; print('torch._inductor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.stdout.split() == ["False"], out.stderr[-2000:]


EAGER_FORM_SCRIPT = """
import os, sys, torch
from hydra import compose, initialize_config_dir
from med_ddpm.compile_cache import CompileCache
from med_ddpm.compile_sidecar import first_call_on_zeros
from med_ddpm.model import build_model
from optim import RecipeStack
with initialize_config_dir(os.path.abspath("med_ddpm/configs"), version_base=None):
    cfg = compose("sample", ["experiment=fast_sample", "model=tiny", "~recipe.amp_fp16"])  # CPU fp16: slow
stack = RecipeStack.from_config(cfg.recipe)
CompileCache.for_run(sys.argv[1], "sample", stack, torch.device("cpu"), {})
net = build_model(cfg.model)
eager = stack.eager()
with eager.session():
    first_call_on_zeros(eager.prepare_model(net), eager, net, 1, list(cfg.model.image_size), torch.device("cpu"))
print(eager.names, os.environ["TORCHINDUCTOR_CACHE_DIR"] == sys.argv[1] + "/inductor", "torch._inductor" in sys.modules)
"""


def test_a_job_that_samples_the_eager_form_of_a_compiling_stack_never_imports_inductor(tmp_path):
    """An eager plan's start-up: building the whole stack (its compile recipe's options checked), its compile cache
    (inductor's folder set) and a call of its eager form import no compiler, which takes a second or more."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", EAGER_FORM_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         cwd=REPO, timeout=300, env=env)
    assert out.stdout.split("] ")[-1].split() == ["True", "False"], out.stderr[-2000:]


@pytest.mark.slow
def test_sampling_with_aot_loads_its_compiled_forward_in_the_next_run(tmp_path, reference_dir, whole_head_data):
    """``recipe.compile.aot=true``: the first run saves the compiled forward, the second loads it, same volumes."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "HYDRA_FULL_ERROR")}
    argv = [sys.executable, "-m", "med_ddpm.sample", f"checkpoint={reference_dir / 'wholehead_small_ckpt.pt'}",
            f"masks={whole_head_data / 'mask' / 'sample_0.nii.gz'}", "image_size=[32,32,32]",
            "sampler=ddim", "sampler.steps=2", "device=cpu", "recipe=[compile]", "recipe.compile.aot=true",
            f"paths.compile_cache={tmp_path / 'cache'}", "progress=false"]
    for run in ("a", "b"):
        proc = subprocess.run([*argv, f"output_dir={tmp_path / run}"], capture_output=True, text=True, cwd=REPO,
                              timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
    first, second = (json.loads((tmp_path / run / "timings.json").read_text()) for run in ("a", "b"))
    report = [{k: v for k, v in t["precompiled"].items() if k != "seconds"} for t in (first, second)]
    assert report == [{"status": "saved", "lazy_calls": 0}, {"status": "loaded", "lazy_calls": 0}]
    # building the file compiles the network; loading it does not
    assert first["precompiled"]["seconds"] > second["precompiled"]["seconds"] > 0
    volumes = [nib.load(next((tmp_path / run).glob("*.nii.gz"))).get_fdata() for run in ("a", "b")]
    assert (volumes[0] == volumes[1]).all()
