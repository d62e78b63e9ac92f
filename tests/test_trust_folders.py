"""Trust, folders: a run goes only into a folder that is its own, and no command writes its output
over one of its inputs. Each test first builds the fault the issue "Trust, fourth pass" reproduced
(a run into `/`, the working directory or a folder of other files; another command's run replaced
with overwrite=true; `cfbnn predict --out` onto the model, the run's records or the new rows), then
checks the one-line refusal and that nothing was written or replaced."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TRUST_REGRESSION as REGRESSION
from conftest import finish_all, one_line_error, small_model_file
from omegaconf import OmegaConf

from cfbnn_cli.cli import SUBCOMMANDS
from cfbnn_cli.cli_messages import hydra_arguments
from cfbnn_cli.pipelines import predict
from cfbnn_cli.runtime.errors import ConfigError
from cfbnn_cli.runtime.run_dir_check import RefuseForeignRunDir
from cfbnn_cli.runtime.rundir import claim_run_dir, foreign_run_dir


def _listing(folder: Path) -> dict:
    """Every entry under ``folder`` with its bytes (``None`` for a folder)."""
    return {str(path.relative_to(folder)): (None if path.is_dir() else path.read_bytes()) for path in folder.rglob("*")}


def _start(*args, cwd=None):
    return subprocess.Popen(
        [sys.executable, "-m", "cfbnn_cli.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=dict(os.environ, HYDRA_FULL_ERROR="0"),
    )


def _error_line(out) -> str:
    one_line_error(out)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cfbnn: error: "), out.stderr[-3000:]
    return lines[0]


def _finished_run(folder: Path, command: str) -> Path:
    """A finished run's dir of ``command`` as cfbnn leaves it (its records; no real training)."""
    (folder / ".cfbnn").mkdir(parents=True)
    (folder / ".cfbnn" / "config.json").write_text(
        json.dumps({"config_fingerprint": "f", "config": {}, "command": command})
    )
    (folder / "results.json").write_text(json.dumps({"pipeline": command, "status": "complete"}))
    (folder / "done").write_text("")
    return folder


# ----------------------------------------------------------------------------- a run into a folder of other files


def test_a_run_dir_must_be_new_empty_or_a_run_of_the_same_command(tmp_path):
    """The rule itself: `/`, a home and a folder of other files are refused naming the folder (and a
    few of its entries); a new folder, an empty one and a run dir of the same command are not."""
    for folder in (Path("/"), Path.home()):
        if any(folder.iterdir()):
            problem = foreign_run_dir(folder, "train_regression")
            assert problem.startswith(f"hydra.run.dir: {folder} is a folder with other files in it (")
            assert "choose another hydra.run.dir" in problem
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    assert "(notes.txt)" in foreign_run_dir(tmp_path / "mine", "train_regression")
    (tmp_path / "empty").mkdir()
    assert foreign_run_dir(tmp_path / "empty", "train_regression") is None
    (tmp_path / "empty" / "train_regression.log").write_text("a run stopped before it took the dir\n")
    assert foreign_run_dir(tmp_path / "empty", "train_regression") is None
    assert "(train_regression.log)" in foreign_run_dir(tmp_path / "empty", "vae")
    assert foreign_run_dir(tmp_path / "new" / "run", "train_regression") is None
    run = _finished_run(tmp_path / "run", "train_regression")
    assert foreign_run_dir(run, "train_regression") is None
    problem = foreign_run_dir(run, "train_classification")
    assert "holds a `cfbnn train regression` run; `cfbnn train classification` does not write" in problem
    # the same under the lock (the callback turned off): claim_run_dir refuses, and writes nothing
    cfg = OmegaConf.create({"seed": 0, "resume": False, "overwrite": True})
    before = _listing(run)
    with pytest.raises(ConfigError, match="another command's run dir"):
        claim_run_dir(cfg, run, "train_classification")
    assert _listing(run) == before


def test_the_callback_refuses_before_hydra_writes_and_names_the_folder(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    config = OmegaConf.create({"hydra": {"run": {"dir": str(tmp_path)}, "job": {"name": "train_regression"}}})
    with pytest.raises(SystemExit) as exit:
        RefuseForeignRunDir().on_run_start(config)
    assert exit.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{tmp_path} is a folder with other files in it (notes.txt)" in lines[0]
    sweep = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    with pytest.raises(SystemExit):
        RefuseForeignRunDir().on_multirun_start(sweep)
    (tmp_path / "multirun.yaml").write_text("{}")  # a sweep dir (resume=true continues it)
    RefuseForeignRunDir().on_multirun_start(sweep)


def test_runs_into_folders_that_are_not_their_own_are_refused_and_nothing_is_written(tmp_path):
    """Through the command: a folder with other files (also with the callback turned off), `.` with
    files in it, and another command's finished run with overwrite=true (a sweep dir: the
    callback's test above). Each exits 2 in one
    line naming the folder; no .hydra/, .cfbnn/ or log is written (before: all written, exit 0)."""
    folders = {name: tmp_path / name for name in ("mine", "cwd", "callback off")}
    for folder in folders.values():
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
    other = _finished_run(tmp_path / "classifier", "train_classification")
    before = {name: _listing(folder) for name, folder in {**folders, "classifier": other}.items()}
    processes = {
        "mine": _start("train", "regression", f"hydra.run.dir={folders['mine']}", *REGRESSION),
        "cwd": _start("train", "regression", "hydra.run.dir=.", *REGRESSION, cwd=folders["cwd"]),
        "classifier": _start("train", "regression", f"hydra.run.dir={other}", "overwrite=true", *REGRESSION),
        # the task checks again, and removes the log Hydra made meanwhile
        "callback off": _start(
            "train", "regression", "~hydra.callbacks.run_dir", f"hydra.run.dir={folders['callback off']}"
        ),
    }
    outcomes = finish_all(processes)
    for name, out in outcomes.items():
        line = _error_line(out)
        folder = other if name == "classifier" else folders[name]
        assert str(folder) in line, line
        assert _listing(folder) == before[name], name
    assert "`cfbnn train classification` run" in outcomes["classifier"].stderr


def test_hydras_flags_after_the_overrides_work_and_a_bad_flag_is_one_line(tmp_path):
    sub = SUBCOMMANDS[0]
    arguments, problem = hydra_arguments(sub, ["seed=0,1", "-m", "trainer.epochs=1", "--cfg", "job"])
    assert arguments == ["-m", "--cfg", "job", "seed=0,1", "trainer.epochs=1"] and problem is None
    arguments, problem = hydra_arguments(sub, ["seed=1", "--nope"])
    assert problem.startswith("unrecognized arguments: --nope; `cfbnn train regression --help`")
    out = subprocess.run(
        [sys.executable, "-m", "cfbnn_cli.cli", "vae", "seed=3", "--cfg", "job"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "seed: 3" in out.stdout, out.stderr[-2000:]  # was: the 11-line usage


# ----------------------------------------------------------------------------- no output over an input


@pytest.fixture
def run(tmp_path):
    """A finished run dir holding a model of columns a, b, c, and a table of new rows."""
    folder = _finished_run(tmp_path / "run", "train_regression")
    small_model_file(folder / "model.pt")
    record = json.loads((folder / "results.json").read_text())
    record.update(tables={"fit.md": "fit.md"}, figures={"fit": "fit.png"})
    (folder / "results.json").write_text(json.dumps(record))
    (folder / "fit.md").write_text("| held-out |\n")
    (folder / "predictions.csv").write_text("a,b,c\n1,2,3\n")  # an earlier predict's output, read as rows
    (tmp_path / "new.csv").write_text("a,b,c\n0.1,0.2,0.3\n1,2,3\n")
    os.link(folder / "model.pt", tmp_path / "other_name.pt")  # a hard link: another name, the same file
    return folder


def _cases(run: Path):
    new, model = run.parent / "new.csv", run / "model.pt"
    return {
        "onto the model file": ([str(model), str(new), "--out", str(model)], model),
        "onto RUN/model.pt": ([str(run), str(new), "--out", str(model)], model),
        "onto RUN/results.json": ([str(run), str(new), "--out", str(run / "results.json")], run / "results.json"),
        "RUN/model.pt onto RUN/done": ([str(model), str(new), "--out", str(run / "done")], run / "done"),
        "onto a table the run lists": ([str(run), str(new), "--out", str(run / "fit.md")], run / "fit.md"),
        "onto NEW.csv": ([str(run), str(new), "--out", str(new)], new),
        "onto NEW.csv spelled otherwise": ([str(run), str(new), "--out", f"{run}/../new.csv"], new),
        "onto a hard link of the model": ([str(run), str(new), "--out", str(run.parent / "other_name.pt")], model),
        "the default output is NEW.csv": ([str(run), str(run / "predictions.csv")], run / "predictions.csv"),
    }


def test_predict_refuses_every_output_that_is_one_of_its_inputs(run, capsys):
    """Compared by device and inode: the model file, the run's records and tables, NEW.csv (by any
    path, or a hard link). Before: the input was replaced by predictions, exit 0."""
    for case, (arguments, victim) in _cases(run).items():
        before = victim.read_bytes()
        assert predict.main(arguments) == 2, case
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "writing it would replace an input of this command" in lines[0], (case, lines)
        assert victim.read_bytes() == before, case
    assert not list(run.parent.rglob("*.tmp"))


def test_predict_out_dash_writes_to_standard_output(run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert predict.main([str(run), str(tmp_path / "new.csv"), "--out", "-"]) == 0
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    assert lines[0].startswith("row,mean,sd,") and len(lines) == 3 and out.err == ""
    assert not (tmp_path / "-").exists()  # was: a file named `-`
