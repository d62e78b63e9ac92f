"""Trust, interruptions: a full disk, an unreadable input, Ctrl-C at any moment and library warnings
end a command in one line, and nothing partial looks complete; messages say what is wrong. Each test
builds the case the issue "Trust, fourth pass" reproduced (ENOSPC on a small tmpfs: 26-84 lines and
a partial report; Ctrl-C during the torch import; a FIFO called "no such file"; a damaged model's
NaN blamed on the user's rows; ...) and checks the one line and what is left on disk."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from conftest import GOOD_PROGRESS_RECORD, one_line_error, small_model_file
from conftest import TRUST_REGRESSION as REGRESSION
from omegaconf import OmegaConf

from cfbnn_cli import cli
from cfbnn_cli.bnn import load_model
from cfbnn_cli.cli import compose_config
from cfbnn_cli.pipelines import predict
from cfbnn_cli.pipelines.regression.uci_protocol import read_progress
from cfbnn_cli.report import aggregate
from cfbnn_cli.runtime import io as atomic_io
from cfbnn_cli.runtime.errors import CheckpointError, DataError
from cfbnn_cli.runtime.held_warnings import holding_warnings
from cfbnn_cli.runtime.safefs import NoFollowFileHandler

AS_ROOT = os.geteuid() == 0


@pytest.fixture
def model(tmp_path):
    """A model file of columns a, b, c, and a table of new rows for it."""
    path = small_model_file(tmp_path / "model.pt")
    (tmp_path / "new.csv").write_text("a,b,c\n0.1,0.2,0.3\n1,2,3\n")
    return path


def _one_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cfbnn: "), lines
    return lines[0]


# ----------------------------------------------------------------------------- a full disk


class _FullDisk:
    """``os`` as the atomic writer sees it, on a disk that fills up after ``room`` files: their
    ``fsync`` fails with ENOSPC, with no file name (as ``write`` and ``fsync`` raise it)."""

    def __init__(self, room: int):
        self.room = room

    def fsync(self, fd):
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= 1
        return os.fsync(fd)

    def __getattr__(self, name):
        return getattr(os, name)


def _no_temporary_files(folder):
    return not [path for path in folder.rglob("*") if path.name.endswith(".tmp")]


def test_a_full_disk_in_predict_is_one_line_and_writes_nothing(model, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(atomic_io, "os", _FullDisk(room=0))
    out = tmp_path / "p.csv"
    assert predict.main([str(model), str(tmp_path / "new.csv"), "--out", str(out)]) == 2
    line = _one_line(capsys)  # was: a traceback (the error named no file)
    assert f"cannot write {out}: no space left on the device" in line, line
    assert not out.exists() and _no_temporary_files(tmp_path)


def _results(folder, seed, rmse):
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "pipeline": "train_regression",
        "schema": 1,
        "status": "complete",
        "config": {"seed": seed, "protocol": "fit"},
        "metrics": {"fit/test_rmse": rmse, "fit/test_ll": -1.0, "fit/coverage_90": 0.9},
    }
    (folder / "results.json").write_text(json.dumps(record))


def _report_files(folder):
    return {path.name: path.read_bytes() for path in folder.glob("report_*")}


def test_a_full_disk_in_report_keeps_the_old_report_whole(tmp_path, capsys, monkeypatch):
    """The report's files are renamed into place together: a disk that fills after two of them leaves
    the old report as it was (before: the first files new, the rest old or missing)."""
    _results(tmp_path / "a", 0, 1.0)
    _results(tmp_path / "b", 1, 2.0)
    assert aggregate.main([str(tmp_path)]) == 0
    old = _report_files(tmp_path)
    assert len(old) >= 4, sorted(old)
    _results(tmp_path / "c", 2, 6.0)  # a new run: every file of the report changes
    capsys.readouterr()
    monkeypatch.setattr(atomic_io, "os", _FullDisk(room=2))
    assert aggregate.main([str(tmp_path)]) == 2
    assert "no space left on the device" in _one_line(capsys)
    assert _report_files(tmp_path) == old and _no_temporary_files(tmp_path)


def test_a_full_disk_in_reports_second_table_prints_no_table_as_written(tmp_path, capsys, monkeypatch):
    """Two tables (two pipelines); the disk fills while the second is written: nothing on stdout
    points at a file (before: the first table's ``-> report_...`` line, for files never renamed in)."""
    _results(tmp_path / "a", 0, 1.0)
    (tmp_path / "v").mkdir()
    vae = {"pipeline": "vae", "schema": 1, "status": "complete", "config": {"seed": 0, "variant": "V1"}}
    (tmp_path / "v" / "results.json").write_text(json.dumps({**vae, "metrics": {"test_ll": -100.0}}))
    monkeypatch.setattr(atomic_io, "os", _FullDisk(room=5))  # the first table's four files, and one more
    assert aggregate.main([str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "->" not in captured.out, captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "no space left on the device" in lines[0], lines
    assert not _report_files(tmp_path) and _no_temporary_files(tmp_path)
    monkeypatch.setattr(atomic_io, "os", os)
    assert aggregate.main([str(tmp_path)]) == 0  # the same report, with room: both tables, and their lines
    assert capsys.readouterr().out.count("->") == 2


def test_a_full_disk_in_a_run_is_one_line_and_the_run_does_not_look_finished(tmp_path, capsys, monkeypatch):
    """The run's task maps the error to one line naming the file and saying how to continue; no
    results.json or done is left, so the dir reads as unfinished (resume=true continues it)."""
    from hydra.core.hydra_config import HydraConfig

    from cfbnn_cli.pipelines import regression
    from cfbnn_cli.runtime.io import atomic_write_text

    def writes_a_table(cfg, run_dir, values=None):
        atomic_write_text(run_dir / "metrics.csv", "epoch,loss\n1,0.5\n")
        monkeypatch.setattr(atomic_io, "os", _FullDisk(room=0))
        atomic_write_text(run_dir / "fit.md", "| table |\n")

    monkeypatch.setattr(regression, "run", writes_a_table)
    hydra_cfg = OmegaConf.create(
        {"runtime": {"output_dir": str(tmp_path)}, "overrides": {"task": []}, "job": {"name": "train_regression"}}
    )
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: hydra_cfg))
    with pytest.raises(Exception, match="no space left on the device"):
        cli.make_task(cli.SUBCOMMANDS[0])(compose_config("train_regression", REGRESSION))
    line = _one_line(capsys)
    assert f"cannot write {tmp_path / 'fit.md'}: no space left" in line and "resume=true" in line, line
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "done").exists()
    assert (tmp_path / "metrics.csv").exists() and _no_temporary_files(tmp_path)


def test_a_log_on_a_full_disk_stops_without_a_traceback_per_record(tmp_path, capsys):
    import logging

    handler = NoFollowFileHandler(str(tmp_path / "job.log"))

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

    handler.stream = Full()
    record = logging.LogRecord("cfbnn", logging.INFO, __file__, 1, "a record", (), None)
    handler.handle(record)
    handler.handle(record)
    assert capsys.readouterr().err == "" and handler.failed.errno == errno.ENOSPC  # was: "--- Logging error ---"


@pytest.mark.slow  # mounts small tmpfs folders (root only): train, predict and report on a really full disk
def test_a_really_full_disk_in_train_predict_and_report(tmp_path, model):
    disk = tmp_path / "disk"
    disk.mkdir()
    if not AS_ROOT or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(disk)]).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        run = subprocess.run(
            [sys.executable, "-m", "cfbnn_cli.cli", "train", "regression", f"hydra.run.dir={disk / 'run'}", *REGRESSION],
            capture_output=True, text=True,
        )  # fmt: skip
        one_line_error(run)
        assert "no space left" in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
        assert not (disk / "run" / "results.json").exists() and not (disk / "run" / "done").exists()
        shutil.rmtree(disk / "run")
        fill = os.open(disk / "fill", os.O_WRONLY | os.O_CREAT)  # the disk full to the last byte
        try:
            while os.write(fill, b"\0" * 512):
                pass
        except OSError:
            pass
        finally:
            os.close(fill)
        for args in (
            ["predict", str(model), str(tmp_path / "new.csv"), "--out", str(disk / "p.csv")],
            ["report", str(tmp_path / "runs"), "--out", str(disk / "report")],
        ):
            _results(tmp_path / "runs" / "a", 0, 1.0)
            _results(tmp_path / "runs" / "b", 1, 2.0)
            out = subprocess.run([sys.executable, "-m", "cfbnn_cli.cli", *args], capture_output=True, text=True)
            one_line_error(out)
            assert "no space left" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert not (disk / "p.csv").exists() and not list((disk / "report").glob("report_*"))
    finally:
        subprocess.run(["umount", str(disk)])


# ----------------------------------------------------------------------------- an unreadable input

AS_ORDINARY_USER = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


def test_an_unreadable_table_of_new_rows_is_one_line(model, tmp_path, capsys, monkeypatch):
    """EACCES as the kernel gives it to a user without the right (the tests run as root, who may read
    anything: the next test plays an ordinary user for real)."""
    import builtins

    table, real_open = tmp_path / "new.csv", builtins.open

    def no_permission(file, *args, **kwargs):
        if os.fspath(file) == str(table):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_permission)
    assert predict.main([str(model), str(table), "--out", str(tmp_path / "p.csv")]) == 2  # was: a traceback
    assert f"cannot read {table}: permission denied; check its permissions" in _one_line(capsys)
    assert not (tmp_path / "p.csv").exists()


@pytest.mark.slow  # 9 s: the same as an ordinary user, through the command
@pytest.mark.skipif(not AS_ROOT or shutil.which("setpriv") is None, reason="plays an ordinary user: root and setpriv")
def test_an_unreadable_table_of_new_rows_is_one_line_for_an_ordinary_user(model, tmp_path):
    (tmp_path / "new.csv").chmod(0)
    out = subprocess.run(
        [*AS_ORDINARY_USER, sys.executable, "-m", "cfbnn_cli.cli", "predict", str(model), str(tmp_path / "new.csv"),
         "--out", str(tmp_path / "p.csv")],
        capture_output=True, text=True,
    )  # fmt: skip
    one_line_error(out)  # was: a PermissionError traceback
    assert f"cannot read {tmp_path / 'new.csv'}: permission denied" in out.stderr, out.stderr
    assert not (tmp_path / "p.csv").exists()


# ----------------------------------------------------------------------------- Ctrl-C at any moment


def _cfbnn_command():
    script = os.path.join(os.path.dirname(sys.executable), "cfbnn")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "cfbnn_cli.cli"]


def test_ctrl_c_at_any_moment_of_predict_or_report_is_one_line(model, tmp_path):
    """SIGINT from 0.6 s on (torch is still being imported for the first second or two): exit 130
    in one line, never a traceback, no output written (a command that finished first exits 0). The
    first ~0.1 s are Python's own start-up, before any code of cfbnn runs; one at a time, so that
    the start-up is not slowed by the others."""
    _results(tmp_path / "runs" / "a", 0, 1.0)
    commands = [(f"p{delay}.csv", delay) for delay in (0.6, 1.4)] + [("report", 0.9)]
    interrupted = 0
    for name, delay in commands:
        if name == "report":
            arguments = ["report", str(tmp_path / "runs"), "--out", str(tmp_path / name)]
        else:
            arguments = ["predict", str(model), str(tmp_path / "new.csv"), "--out", str(tmp_path / name)]
        process = subprocess.Popen(
            [*_cfbnn_command(), *arguments], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=300)
        assert "Traceback" not in stderr and process.returncode in (0, 130), (name, process.returncode, stderr)
        if process.returncode == 130:
            interrupted += 1
            assert stderr.strip().startswith("cfbnn: interrupted") and len(stderr.strip().splitlines()) == 1, stderr
            assert not (tmp_path / name).exists() or name == "report" and not list((tmp_path / name).iterdir())
    assert interrupted >= 2  # at least those signalled while torch was still loading


# ----------------------------------------------------------------------------- warnings and messages


def _warn_like_the_libraries():
    """A real warning from numpy, torch, scikit-learn and matplotlib each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn.linear_model import LogisticRegression

    warnings.simplefilter("always")
    np.log(np.array([-1.0]))
    torch.tensor(torch.zeros(1))  # "To copy construct from a tensor, ..." (each time, unlike most of torch's)
    LogisticRegression(max_iter=1).fit(np.arange(20.0).reshape(10, 2), np.arange(10) % 2)
    figure = plt.figure()
    figure.gca().legend()
    plt.close(figure)


def _warnings_to_stderr(monkeypatch):
    """Warnings shown as Python shows them outside pytest (which records them instead)."""
    monkeypatch.setattr(
        warnings, "_showwarnmsg_impl", lambda message: sys.stderr.write(warnings._formatwarnmsg(message))
    )


def test_library_warnings_never_print_before_a_one_line_error(model, tmp_path, capsys, monkeypatch):
    def warns_then_fails(*args, **kwargs):
        _warn_like_the_libraries()
        raise DataError("new.csv, row 2: a text cell")

    _warnings_to_stderr(monkeypatch)
    with warnings.catch_warnings():
        monkeypatch.setattr(predict, "predict_run", warns_then_fails)
        with pytest.raises(SystemExit) as exit:
            cli.main(["predict", str(model), str(tmp_path / "new.csv")])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["cfbnn: error: new.csv, row 2: a text cell"]


def test_library_warnings_are_one_line_each_after_a_success(model, tmp_path, capsys, monkeypatch):
    def warns(*args, **kwargs):
        _warn_like_the_libraries()
        return tmp_path / "p.csv"

    _warnings_to_stderr(monkeypatch)
    with warnings.catch_warnings():
        monkeypatch.setattr(predict, "predict_run", warns)
        with pytest.raises(SystemExit) as exit:
            cli.main(["predict", str(model), str(tmp_path / "new.csv")])
    assert exit.value.code == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("cfbnn: warning: ") for line in lines), lines
    for words in ("invalid value encountered in log", "copy construct", "ConvergenceWarning", "No artists with labels"):
        assert any(words in line for line in lines), (words, lines)


def test_held_warnings_also_go_to_the_runs_log(tmp_path):
    import logging

    handler = logging.FileHandler(tmp_path / "job.log")
    logging.getLogger().addHandler(handler)
    try:
        with holding_warnings() as held, warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a library's warning", UserWarning, stacklevel=1)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert len(held.lines) == 1 and "UserWarning: a library's warning (" in (tmp_path / "job.log").read_text()


def test_a_fifo_is_named_as_such_and_never_opened(tmp_path):
    os.mkfifo(tmp_path / "model.pt")
    outcome = {}

    def load():
        try:
            load_model(tmp_path / "model.pt")
        except DataError as error:
            outcome["error"] = str(error)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=30)
    assert not reader.is_alive(), "load_model blocked on a FIFO"
    assert "a FIFO, not a regular file" in outcome["error"]  # was: "no such model file"


def test_a_damaged_models_non_finite_predictions_are_blamed_on_the_model_file(model, tmp_path, capsys):
    record = torch.load(model, weights_only=True)
    record["state_dict"] = {name: value * 1e30 for name, value in record["state_dict"].items()}  # finite, overflowing
    torch.save(record, tmp_path / "damaged.pt")
    assert (
        predict.main([str(tmp_path / "damaged.pt"), str(tmp_path / "new.csv"), "--out", str(tmp_path / "p.csv")]) == 2
    )
    line = _one_line(capsys)  # was: "the prediction of row(s) 1, 2 ... check those rows"
    assert "damaged.pt: the model's prediction at the training rows' mean is not finite" in line, line


def test_report_and_predict_argument_errors_are_one_line_without_a_doubled_prefix(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    _results(tmp_path / "runs" / "a", 0, 1.0)
    assert aggregate.main([str(tmp_path / "runs"), "--out", str(tmp_path / "a-file")]) == 2
    assert _one_line(capsys).startswith("cfbnn: error: --out ")  # was: "cfbnn: error: cfbnn report: --out"
    for main, arguments in ((aggregate.main, []), (predict.main, ["only-one"])):
        with pytest.raises(SystemExit) as exit:
            main(arguments)
        assert exit.value.code == 2
        assert "lists the arguments" in _one_line(capsys)  # was: argparse's usage block


def test_a_progress_record_outside_the_runs_splits_is_refused(tmp_path):
    record = {**GOOD_PROGRESS_RECORD, "split": 99}
    path = tmp_path / "uci_progress.json"
    path.write_text(json.dumps({"config_fingerprint": "f", "records": [record]}))
    with pytest.raises(CheckpointError, match="a record of split 99 .plain_mlp., but this run has splits 0..1"):
        read_progress(path, "f", 2, ["plain_mlp"])  # was: dropped silently


def test_numbers_with_underscores_read_as_python_reads_them():
    """Documented (docs/cli.md): Hydra's override grammar reads `1_000` as 1000, as Python does."""
    assert compose_config("train_regression", ["trainer.epochs=1_000"]).trainer.epochs == 1000
