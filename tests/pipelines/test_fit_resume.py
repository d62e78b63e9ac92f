"""A long own-data fit shows its progress, writes metrics.csv and keeps checkpoints, and a fit stopped
part-way and resumed (resume=true) ends with the numbers of the fit that was never stopped: L-BFGS and
Adam, regression and classification (train/fit_records.py)."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import pytest

from cfbnn_cli.cli import compose_config
from cfbnn_cli.pipelines import classification, regression
from cfbnn_cli.runtime.checkpoints import load_checkpoint
from cfbnn_cli.train import fit_records
from cfbnn_cli.train.fit_checks import FitFailedError


class Stopped(Exception):
    """Stands in for a kill: raised from inside the fit once it has made some progress."""


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tables")
    rng = np.random.default_rng(3)
    x = rng.normal(size=(220, 3))
    y = np.sin(2 * x[:, 0]) + 0.5 * x[:, 1] + 0.3 * rng.normal(size=220)
    pd.DataFrame({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "y": y}).to_csv(folder / "r.csv", index=False)
    labels = np.where(x[:, 0] + 0.5 * x[:, 1] + 0.3 * rng.normal(size=220) > 0, "yes", "no")
    pd.DataFrame({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "label": labels}).to_csv(folder / "c.csv", index=False)
    return folder


def _regression(tables, *extra):
    common = ["data=csv", f"data.path={tables / 'r.csv'}", "data.target=y", "device=cpu", "fit.refit=false"]
    return compose_config("train_regression", common + ["model.hidden_sizes=[10]", "likelihood=normal", *extra])


def _classification(tables, *extra):
    common = ["data=csv", f"data.path={tables / 'c.csv'}", "data.target=label", "device=cpu", "fit.refit=false"]
    return compose_config("train_classification", common + ["model.hidden_sizes=[10]", "fit.baseline=false", *extra])


def _stop_after(monkeypatch, notes: int):
    """Raise :class:`Stopped` at the ``notes``-th progress note (L-BFGS: a round, Adam: an epoch)."""
    seen = []
    original = fit_records.FitProgress.note

    def note(self, text):
        original(self, text)
        seen.append(text)
        if len(seen) == notes:
            raise Stopped

    monkeypatch.setattr(fit_records.FitProgress, "note", note)


def _stopped_then_resumed(pipeline, make_cfg, run_dir, monkeypatch, notes: int) -> dict:
    run_dir.mkdir()
    with monkeypatch.context() as patch:
        _stop_after(patch, notes)
        with pytest.raises(Stopped):
            pipeline.run(make_cfg(), run_dir)
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")  # weights_only=True
    assert state["epoch"] >= 1 and "finished" not in state.get("extra", {})
    assert len(pd.read_csv(run_dir / "metrics.csv")) >= 1
    return pipeline.run(make_cfg("resume=true"), run_dir)["metrics"]


def test_an_lbfgs_fit_stopped_and_resumed_ends_with_the_numbers_of_one_never_stopped(tables, tmp_path, monkeypatch):
    monkeypatch.setattr(fit_records, "PERSIST_SECONDS", 0.0)  # a checkpoint at every round
    (tmp_path / "whole").mkdir()
    whole = regression.run(_regression(tables), tmp_path / "whole")["metrics"]
    resumed = _stopped_then_resumed(regression, lambda *o: _regression(tables, *o), tmp_path / "cut", monkeypatch, 3)
    assert whole["fit/iterations"] > 75  # it was stopped after 3 rounds of 25, mid-run
    for key in ("fit/test_ll", "fit/test_rmse", "fit/iterations", "fit/noise_sd", "fit/converged"):
        assert resumed[key] == whole[key], key
    rows = pd.read_csv(tmp_path / "cut" / "metrics.csv")
    assert list(rows["phase"].unique()) == ["fit"] and rows["iteration"].is_monotonic_increasing
    assert rows["iteration"].iloc[-1] == whole["fit/iterations"]


def test_an_adam_fit_stopped_and_resumed_ends_with_the_numbers_of_one_never_stopped(
    tables, tmp_path, monkeypatch, caplog
):
    options = ["fit.full_batch_max_rows=50", "trainer.epochs=12", "fit.evaluate_every=1", "trainer.batch_size=64"]
    (tmp_path / "whole").mkdir()
    whole = regression.run(_regression(tables, *options), tmp_path / "whole")["metrics"]
    # the loop's first checkpoint is after epoch 1, the next 10 s later: epochs 2-5 are redone on resume
    with caplog.at_level(logging.INFO, logger="cfbnn_cli.train.fit_records"):
        resumed = _stopped_then_resumed(
            regression, lambda *o: _regression(tables, *options, *o), tmp_path / "cut", monkeypatch, 5
        )
    for key in ("fit/test_ll", "fit/test_rmse", "fit/iterations"):
        assert resumed[key] == whole[key], key
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("fit: resumed from") and "after epoch 1 of 12" in line for line in lines), lines
    assert len(pd.read_csv(tmp_path / "cut" / "metrics.csv")) == 12


@pytest.mark.parametrize("transform", ["none", "log"])
def test_adam_epochs_are_recorded_per_row_and_in_the_targets_units(tables, tmp_path, transform):
    """metrics.csv's Adam rows: the training ELBO per row (not the whole data's, N times as large)
    and the validation log-likelihood in the target's units, as fit.md's held-out one (a target in
    the thousands: its standardized log-likelihood is log(s.d.) ~ 6.8 nats higher; a log target's
    density is y's, log y ~ 8.5 nats lower than log y's)."""
    frame = pd.read_csv(tables / "r.csv")
    frame["y"] = 5000 + 1000 * frame["y"]  # positive, s.d. ~ 900
    frame.to_csv(tmp_path / "thousands.csv", index=False)
    options = ["fit.full_batch_max_rows=50", "trainer.epochs=12", "fit.evaluate_every=1", "trainer.batch_size=64"]
    cfg = _regression(tables, *options, f"data.path={tmp_path / 'thousands.csv'}", f"data.target_transform={transform}")
    (tmp_path / "run").mkdir()
    held_out = regression.run(cfg, tmp_path / "run")["metrics"]["fit/test_ll"]
    rows = pd.read_csv(tmp_path / "run" / "metrics.csv")
    assert len(rows) == 12 and rows["train_elbo_per_point"].iloc[1:].between(-5, 5).all(), rows
    validation = rows["validation_ll"].iloc[-1]
    assert abs(validation - held_out) < 1.0, (validation, held_out)  # other rows of the same model


def test_a_classifier_stopped_and_resumed_ends_with_the_numbers_of_one_never_stopped(tables, tmp_path, monkeypatch):
    monkeypatch.setattr(fit_records, "PERSIST_SECONDS", 0.0)
    (tmp_path / "whole").mkdir()
    whole = classification.run(_classification(tables), tmp_path / "whole")["metrics"]
    resumed = _stopped_then_resumed(
        classification, lambda *o: _classification(tables, *o), tmp_path / "cut", monkeypatch, 2
    )
    for key in ("fit/test_nll", "fit/test_accuracy", "fit/iterations"):
        assert resumed[key] == whole[key], key


def test_a_resumed_run_whose_phases_finished_trains_nothing_again(tables, tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = regression.run(_regression(tables, "fit.refit=true"), run_dir)["metrics"]
    assert (run_dir / "checkpoints" / "refit" / "last.pt").is_file()
    with caplog.at_level(logging.INFO, logger="cfbnn_cli.train.fit_records"):
        again = regression.run(_regression(tables, "fit.refit=true", "resume=true"), run_dir)["metrics"]
    assert again["fit/test_ll"] == first["fit/test_ll"]
    finished = [r.getMessage() for r in caplog.records if "finished before" in r.getMessage()]
    assert len(finished) == 2  # the held-out fit and the refit
    assert set(pd.read_csv(run_dir / "metrics.csv")["phase"]) == {"fit", "refit"}


def test_progress_lines_name_the_iteration_and_the_numbers_without_a_terminal(tables, tmp_path, monkeypatch, caplog):
    """Without a terminal (the tests' stderr) there is no bar: a line at least every LOG_SECONDS
    (here every update): L-BFGS iterations with the ELBO; Adam epochs with the validation
    log-likelihood and the best so far."""
    monkeypatch.setattr(fit_records, "LOG_SECONDS", 0.0)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with caplog.at_level(logging.INFO, logger="cfbnn_cli.train.fit_records"):
        regression.run(_regression(tables, "fit.max_iterations=60"), tmp_path / "a")
        options = ["fit.full_batch_max_rows=50", "trainer.epochs=3", "fit.evaluate_every=1", "trainer.batch_size=64"]
        with pytest.raises(FitFailedError, match="worse than predicting the training rows' mean"):
            regression.run(_regression(tables, *options), tmp_path / "b")  # 3 epochs of Adam learn too little
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("fit: L-BFGS iteration") and "of at most 60" in line and "ELBO per row" in line
               for line in lines), lines  # fmt: skip
    adam = [line for line in lines if line.startswith("fit: Adam")]
    assert any("epoch 3/3, validation LL" in line and "(best " in line for line in adam), adam


@pytest.mark.slow
def test_ctrl_c_and_kill_during_an_lbfgs_fit_then_resume_through_the_cli(tmp_path):
    """The real thing: SIGINT during L-BFGS names the checkpoint it keeps (which exists); kill -9
    later; resume=true finishes with fit.md's numbers of a run never stopped."""
    import json
    import signal
    import subprocess
    import sys
    import time

    rng = np.random.default_rng(5)
    x = rng.normal(size=(3000, 6))
    y = np.sin(x[:, 0]) * x[:, 1] + 0.3 * rng.normal(size=3000)
    pd.DataFrame({**{f"x{i}": x[:, i] for i in range(6)}, "y": y}).to_csv(tmp_path / "t.csv", index=False)
    common = ["train", "regression", "data=csv", f"data.path={tmp_path / 't.csv'}", "data.target=y", "device=cpu",
              "fit.refit=false", "runtime.threads=1", "model.hidden_sizes=[100]"]  # fmt: skip

    def start(run, *extra):
        command = [sys.executable, "-m", "cfbnn_cli.cli", *common, f"hydra.run.dir={run}", *extra]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_for_checkpoint(run, process):
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / "last.pt").exists() and time.monotonic() < deadline:
            assert process.poll() is None, process.communicate()
            time.sleep(0.2)

    whole = start(tmp_path / "whole")
    cut = tmp_path / "cut"
    process = start(cut)
    wait_for_checkpoint(cut, process)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130
    lines = [line for line in stderr.splitlines() if line.startswith("cfbnn:")]
    assert lines == [f"cfbnn: interrupted; the last checkpoint ({cut / 'checkpoints' / 'last.pt'}) is kept: "
                     "rerun with resume=true to continue"]  # fmt: skip
    process = start(cut, "resume=true")
    time.sleep(3)
    process.kill()  # kill -9: whatever it wrote since is a checkpoint or nothing
    process.communicate(timeout=60)
    finished = start(cut, "resume=true")
    assert finished.wait(timeout=900) == 0 and whole.wait(timeout=900) == 0
    numbers = [json.loads((run / "results.json").read_text())["metrics"] for run in (tmp_path / "whole", cut)]
    for key in ("fit/test_ll", "fit/test_rmse", "fit/iterations"):
        assert numbers[0][key] == numbers[1][key], key
