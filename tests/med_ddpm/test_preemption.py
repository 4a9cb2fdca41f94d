"""SIGTERM and Ctrl-C stop training at a step with last.pt written; resume=auto then ends as an uninterrupted run."""

from __future__ import annotations

import logging
import os
import signal

import pytest
from test_train import assert_same_last_checkpoint, cfg_for

import med_ddpm.train as train_mod
from med_ddpm.checkpoint import read_checkpoint
from med_ddpm.preemption import Watch, resume_command
from med_ddpm.train import build, fit

COMMON = ["train.max_steps=6", "train.save_every=0", "train.ema_start=2", "train.ema_every=1", "train.lr=1e-3",
          "data.num_volumes=3"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_the_step_reached_and_resume_ends_with_the_uninterrupted_weights(tmp_path, monkeypatch,
                                                                                       caplog, signum):
    fit(build(cfg_for("train", tmp_path / "straight", *COMMON)))
    handler = signal.getsignal(signum)
    real_update = train_mod.update_ema

    def signalled_in_step_4(job):  # update_ema runs before the step is counted
        real_update(job)
        if job.step == 3:
            os.kill(os.getpid(), signum)  # as a scheduler's preemption would, mid-run

    monkeypatch.setattr(train_mod, "update_ema", signalled_in_step_4)
    with caplog.at_level(logging.WARNING, "med_ddpm.train"), pytest.raises(SystemExit) as stopped:
        fit(build(cfg_for("train", tmp_path / "stopped", *COMMON)))
    assert stopped.value.code == 128 + signum
    assert read_checkpoint(tmp_path / "stopped" / "checkpoints" / "last.pt")["step"] == 4  # save_every=0: only this
    assert f"stopped by {signal.Signals(signum).name} at step 4" in caplog.text and "resume=auto" in caplog.text
    assert signal.getsignal(signum) is handler  # restored

    monkeypatch.setattr(train_mod, "update_ema", real_update)
    fit(build(cfg_for("train", tmp_path / "stopped", *COMMON, "resume=auto")))
    assert_same_last_checkpoint(tmp_path / "straight", tmp_path / "stopped", 6)


def test_a_second_signal_stops_at_once_and_the_handlers_are_restored():
    before = signal.getsignal(signal.SIGINT)
    stop = Watch()
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.requested()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_the_resume_line_is_the_bare_command_outside_hydra(tmp_path):
    assert resume_command(tmp_path / "run") == f"python -m med_ddpm.train output_dir={tmp_path / 'run'} resume=auto"


def _sleep(started) -> None:
    import time

    started.set()
    time.sleep(120)


@pytest.mark.e2e
def test_a_process_forked_under_the_watch_ends_on_sigterm_as_without_it():
    """A data loader's worker is forked inside the loop: a SIGTERM to it (the loader's shutdown) must end it, or
    the training process would wait for it forever at exit."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    started = fork.Event()
    with Watch():
        child = fork.Process(target=_sleep, args=(started,))
        child.start()
        started.wait(100)  # a signal in the fork's first instants is lost, with or without the watch
        os.kill(child.pid, signal.SIGTERM)
        child.join(timeout=100)
    assert child.exitcode == -signal.SIGTERM
