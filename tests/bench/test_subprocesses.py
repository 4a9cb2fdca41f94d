"""bench.core.subprocesses: a command bench started in its own session dies when bench is stopped (SIGTERM from an
outer timeout, Ctrl-C), also when a worker thread started it, as quality_training's arms are."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# bench.core.e2e.spawn from a worker thread while the main thread waits, under stopped_together (as bench.ladder runs)
PARENT = """
import sys, threading
from pathlib import Path
from bench.core.e2e import spawn
from bench.core.subprocesses import stopped_together
tmp = Path(sys.argv[1])
child = "import os, time; open({!r}, 'w').write(str(os.getpid())); time.sleep(120)".format(str(tmp / "child.pid"))
with stopped_together():
    arm = threading.Thread(target=spawn, args=(["timeit", "-n", "1", "-r", "1", child], tmp / "cache", tmp / "log", None))
    arm.start()
    arm.join()
"""


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper the container may not have."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_for(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.e2e
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_stopping_bench_stops_the_command_it_started(tmp_path, stop):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], cwd=REPO, start_new_session=True)
    pid_file = tmp_path / "child.pid"
    try:
        assert wait_for(lambda: pid_file.exists() and pid_file.read_text()), "the command never started"
        child = int(pid_file.read_text())
        assert alive(child)
        parent.send_signal(stop)
        assert parent.wait(timeout=30) != 0  # bench ends, as the signal asks
        assert wait_for(lambda: not alive(child), 10), "the command outlived bench"
    finally:
        parent.kill()
        if pid_file.exists() and pid_file.read_text():
            subprocess.run(["kill", "-9", pid_file.read_text()], check=False)
