"""A run that is still writing is told from one that was interrupted (runtime/run_activity.py), and
`cfbnn predict` says which; a change of the torch thread count is logged once per run."""

import json
import logging
import os

import pytest
import torch

from cfbnn_cli.pipelines.predict import model_path
from cfbnn_cli.runtime import threads
from cfbnn_cli.runtime.errors import DataError
from cfbnn_cli.runtime.run_activity import running_owner
from cfbnn_cli.runtime.rundir import RunDirLock


def _unfinished(folder):
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "last.pt").write_bytes(b"")
    return folder


def test_a_run_holding_its_lock_is_running_and_one_that_let_go_is_not(tmp_path):
    run = _unfinished(tmp_path / "run")
    assert running_owner(run) is None  # no lock file: never started here
    lock = RunDirLock(run).acquire()
    try:
        assert running_owner(run).startswith(f"pid {os.getpid()} on ")
        with pytest.raises(DataError, match="has not finished: it is still training .* is writing to it"):
            model_path(run)
    finally:
        lock.release()
    assert running_owner(run) is None
    with pytest.raises(DataError, match="has not finished: it was interrupted .*resume=true"):
        model_path(run)


def test_a_killed_runs_lock_file_names_a_process_that_holds_nothing(tmp_path):
    """kill -9 leaves the lock file's text (the pid), but the kernel released the lock itself."""
    run = _unfinished(tmp_path / "run")
    (run / ".cfbnn").mkdir()
    (run / ".cfbnn" / "lock").write_text(json.dumps({"pid": os.getpid(), "host": "here", "started": "then"}))
    assert running_owner(run) is None


def test_the_thread_count_changing_is_logged_once_per_run(monkeypatch, caplog):
    class Jobs:  # other cfbnn jobs come and go: 1, 2, 1, 2, ...
        calls = 0

        def count(self):
            self.calls += 1
            return 1 + self.calls % 2

    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_REGISTRY", Jobs())
    monkeypatch.setattr(threads, "_SETTING", "auto")
    monkeypatch.setattr(threads, "_CHANGES_LOGGED", False)
    monkeypatch.setattr(threads, "REBALANCE_SECONDS", 0.0)
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    try:
        with caplog.at_level(logging.DEBUG, logger="cfbnn_cli.runtime.threads"):
            for _ in range(6):
                threads.rebalance()
    finally:
        torch.set_num_threads(before)
    changes = [r for r in caplog.records if "torch threads" in r.getMessage()]
    assert len(changes) >= 5 and [r.levelno for r in changes].count(logging.INFO) == 1
