"""Process start and exit of the CLIs: what importing them loads, and ending a run without teardown."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e  # each test starts an interpreter of its own
HEAVY = ("monai", "matplotlib", "scipy.signal", "scipy.stats")  # MONAI imports all of these with itself


def python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_importing_the_clis_leaves_monai_and_its_scipy_and_matplotlib_out(tmp_path):
    """Training, sampling and the bench commands that only read results or run other commands start in a second
    or two less without them."""
    done = python(f"""
        import sys
        import med_ddpm.sample, med_ddpm.train, bench.ladder, bench.report, bench.sweep
        print(sorted(m for m in sys.modules if m.startswith({HEAVY!r})))
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_run_without_teardown_runs_atexit_flushes_and_exits_zero(tmp_path):
    done = python("""
        import atexit
        from pathlib import Path
        from med_ddpm import cli

        def main():
            atexit.register(Path("atexit.txt").write_text, "ran")
            print("result")  # stdout is a pipe here: block-buffered until flushed

        cli.run(main, teardown=False)
        print("after run")
    """, tmp_path)
    assert (done.returncode, done.stdout) == (0, "result\n"), done.stderr
    assert (tmp_path / "atexit.txt").read_text() == "ran"


def test_a_live_non_daemon_thread_gets_the_normal_exit(tmp_path):
    done = python("""
        import threading, time
        from med_ddpm import cli

        def main():
            threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()

        cli.run(main, teardown=False)
        print("after run")
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["after run", "thread done"]


def test_training_builds_its_memory_cached_dataset_in_another_process(tmp_path):
    """The dataset (MONAI's import, every file decoded) is built while the model is prepared, and its items reach
    the training process (and its loader workers) through shared memory: that process never imports MONAI."""
    done = python(f"""
        import sys
        from hydra import compose, initialize_config_dir
        from med_ddpm.data.phantoms import write_phantom_niftis
        from med_ddpm.train import build, fit

        write_phantom_niftis("data", 2, (8, 8, 8))
        with initialize_config_dir(config_dir="{REPO / 'configs'}", version_base="1.3"):
            cfg = compose(config_name="train", overrides=[
                "data=whole_head", "data.root=data", "data.cache=memory", "data.num_workers=2", "model=tiny",
                "model.image_size=[8,8,8]", "model.channel_mult=[1,2]", "model.attention_ds=[2]",
                "train.max_steps=1", "train.progress=false", "output_dir=run", "device=cpu"])
        job = build(cfg)
        fit(job)
        print(type(job.dataset).__name__, job.data.seconds > 0, sorted(m for m in sys.modules if m.startswith({HEAVY!r})))
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "SharedItems True []"
