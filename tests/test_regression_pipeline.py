"""`cfbnn train regression`: training, gradient variance, outputs, resume, errors."""

import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from cfbnn_cli.cli import config_dir
from cfbnn_cli.data.regression import load_regression_data, tabular_file, year_prediction_msd
from cfbnn_cli.bnn.deep import MeanFieldMLP
from cfbnn_cli.pipelines import regression
from cfbnn_cli.runtime.errors import ConfigError, DataError
from cfbnn_cli.runtime.numerics import NonFiniteLossError

TINY = [
    "data.n_train=400", "data.n_test=100", "data.input_dim=8", "model.hidden_sizes=[16,16]",
    "trainer.epochs=3", "trainer.batch_size=100", "trainer.lr=0.01", "gradient_variance.num_samples=300",
    "gradient_variance.batch_size=100", "evaluation.num_samples=4", "device=cpu",
]


def tiny_cfg(*overrides):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(config_name="train_regression", overrides=TINY + list(overrides))


@pytest.mark.parametrize("estimator", ["analytic", "sampling"])
def test_trains_lowers_loss_and_writes_outputs(tmp_path, estimator):
    result = regression.run(tiny_cfg(f"estimator={estimator}"), tmp_path)
    history = pd.read_csv(tmp_path / "metrics.csv")
    assert list(history["epoch"]) == [1, 2, 3]
    assert history["train_elbo_per_point"].iloc[-1] > history["train_elbo_per_point"].iloc[0]
    assert np.isfinite(history[["test_rmse", "test_ll_closed_form", "test_ll_monte_carlo"]].values).all()
    table = pd.read_csv(tmp_path / "gradient_variance.csv", index_col=0)
    assert list(table.index) == ["Analytic", "Sampling"] and table.shape[1] == 6
    assert "/" in table.iloc[0, 0]
    assert (tmp_path / "gradient_variance.md").read_text().count("|") > 10
    assert "\\toprule" in (tmp_path / "gradient_variance.tex").read_text()
    for figure in ("gradient_variance.png", "training.png"):
        assert (tmp_path / figure).read_bytes()[:4] == b"\x89PNG"
    assert result["metrics"]["final_test_rmse"] == pytest.approx(history["test_rmse"].iloc[-1])
    assert (tmp_path / "checkpoints" / "last.pt").exists()


def test_analytic_gradient_variance_is_lower_on_the_final_layer(tmp_path):
    result = regression.run(tiny_cfg("trainer.epochs=1", "gradient_variance.epochs=[0]"), tmp_path)
    m = result["metrics"]
    for kind in ("mean", "scale"):
        assert m[f"gradvar/analytic/epoch0/final/{kind}"] < m[f"gradvar/sampling/epoch0/final/{kind}"]
        assert m[f"gradvar_ratio_sampling_over_analytic/epoch0/final/{kind}"] > 1.5


def test_resume_continues_from_checkpoint_bit_for_bit(tmp_path, monkeypatch):
    """A run stopped after epoch 2 and resumed with the same config ends exactly as an
    uninterrupted run; resuming with another trainer.epochs is refused, naming the key."""
    from cfbnn_cli.pipelines.regression import gradient_variance_study as study
    from cfbnn_cli.runtime.rundir import claim_run_dir

    cfg = tiny_cfg("trainer.epochs=4", "gradient_variance.num_samples=0")
    regression.run(cfg, tmp_path / "whole")
    reference = pd.read_csv(tmp_path / "whole" / "metrics.csv")

    claim_run_dir(cfg, tmp_path / "stopped")  # as the CLI does before running
    original, calls = study.evaluate, {"n": 0}

    def stop_in_epoch_3(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(study, "evaluate", stop_in_epoch_3)
    with pytest.raises(KeyboardInterrupt):
        regression.run(cfg, tmp_path / "stopped")
    monkeypatch.setattr(study, "evaluate", original)
    assert torch.load(tmp_path / "stopped" / "checkpoints" / "last.pt", weights_only=True)["epoch"] == 2
    resumed = tiny_cfg("trainer.epochs=4", "gradient_variance.num_samples=0", "resume=true")
    claim_run_dir(resumed, tmp_path / "stopped")
    regression.run(resumed, tmp_path / "stopped")
    after = pd.read_csv(tmp_path / "stopped" / "metrics.csv")
    pd.testing.assert_frame_equal(after.drop(columns="epoch_seconds"), reference.drop(columns="epoch_seconds"))

    longer = tiny_cfg("trainer.epochs=6", "gradient_variance.num_samples=0", "resume=true")
    with pytest.raises(ConfigError, match=r"trainer\.epochs: 4 -> 6"):
        claim_run_dir(longer, tmp_path / "stopped")


def test_nan_loss_stops_with_epoch_and_step_and_keeps_checkpoint(tmp_path, monkeypatch):
    cfg = tiny_cfg("gradient_variance.num_samples=0")
    original = MeanFieldMLP.forward  # the training step's expected log-likelihood
    calls = {"n": 0}

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        value = original(self, *args, **kwargs)
        return value * float("nan") if calls["n"] > 5 else value  # 4 steps per epoch: fails in epoch 2

    monkeypatch.setattr(MeanFieldMLP, "forward", flaky)
    with pytest.raises(NonFiniteLossError, match="epoch 2, step 1"):
        regression.run(cfg, tmp_path)
    assert torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=False)["epoch"] == 1


@pytest.mark.parametrize(
    "override,key",
    [("estimator.name=gibbs", "estimator.name"), ("trainer.batch_size=5000", "trainer.batch_size"),
     ("model.hidden_sizes=[16,0]", "model.hidden_sizes"), ("gradient_variance.epochs=[0,9]", "gradient_variance.epochs")],
)
def test_invalid_config_fails_before_work(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        regression.run(tiny_cfg(override), tmp_path)
    assert not (tmp_path / "metrics.csv").exists()


def _fake_msd(path, rows=60):
    rng = np.random.default_rng(0)
    years = rng.integers(1922, 2012, rows)
    features = rng.standard_normal((rows, 90))
    lines = [",".join([str(y)] + [f"{v:.5f}" for v in f]) for y, f in zip(years, features)]
    path.write_text("\n".join(lines) + "\n")
    return years


def test_msd_loader_split_and_zip(tmp_path):
    txt = tmp_path / "YearPredictionMSD.txt"
    years = _fake_msd(txt)
    data = year_prediction_msd(txt, n_train=50, expected_rows=60)
    assert data.x_train.shape == (50, 90) and data.x_test.shape == (10, 90)
    assert data.target_mean == pytest.approx(years[:50].mean())
    assert abs(float(data.x_train.mean())) < 1e-5  # standardized by training statistics
    with zipfile.ZipFile(tmp_path / "YearPredictionMSD.txt.zip", "w") as archive:
        archive.write(txt, "YearPredictionMSD.txt")
    txt.unlink()
    zipped = year_prediction_msd(txt, n_train=50, expected_rows=60)  # finds the .zip beside it
    torch.testing.assert_close(zipped.x_test, data.x_test)
    with pytest.raises(DataError, match="60 rows, expected 515345"):
        year_prediction_msd(txt, n_train=50)


def test_missing_msd_names_the_script(tmp_path):
    with pytest.raises(DataError, match="data_scripts/fetch_year_prediction_msd.py"):
        year_prediction_msd(tmp_path / "nope" / "YearPredictionMSD.txt")


def test_fetch_script_verifies_local_file(tmp_path):
    txt = tmp_path / "YearPredictionMSD.txt"
    _fake_msd(txt, rows=12)
    script = os.path.join(os.path.dirname(__file__), "..", "data_scripts", "fetch_year_prediction_msd.py")
    ok = subprocess.run([sys.executable, script, "--verify-only", str(txt), "--rows", "12"], capture_output=True, text=True)
    assert ok.returncode == 0 and "12 rows, OK" in ok.stdout
    bad = subprocess.run([sys.executable, script, "--verify-only", str(txt)], capture_output=True, text=True)
    assert bad.returncode != 0 and "expected 515345" in bad.stderr


def test_csv_and_npz_loaders(tmp_path):
    rng = np.random.default_rng(1)
    frame = pd.DataFrame(rng.standard_normal((30, 3)), columns=["a", "b", "strength"])
    frame.to_csv(tmp_path / "t.csv", index=False)
    data = tabular_file(tmp_path / "t.csv", "strength")
    assert data.input_dim == 2 and data.num_train + data.x_test.shape[0] == 30
    np.savez(tmp_path / "t.npz", x=frame[["a", "b"]].values, y=frame["strength"].values)
    assert tabular_file(tmp_path / "t.npz", "y").input_dim == 2
    (tmp_path / "bad.csv").write_text("a,b,strength\n1,2,3\n4,oops,6\n7,8,9\n1,1,1\n")
    with pytest.raises(DataError, match="line 3"):
        tabular_file(tmp_path / "bad.csv", "strength")
    (tmp_path / "nan.csv").write_text("a,b,strength\n1,2,3\n4,nan,6\n7,8,9\n")
    with pytest.raises(DataError, match="line 3"):
        tabular_file(tmp_path / "nan.csv", "strength")
    with pytest.raises(DataError, match="no column named `y`"):
        tabular_file(tmp_path / "t.csv", "y")


def test_diabetes_config_loads():
    cfg = OmegaConf.create({"name": "diabetes", "test_fraction": 0.1})
    data = load_regression_data(cfg, seed=0)
    assert data.input_dim == 10 and data.num_train == 398


def test_cli_end_to_end_small(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "cfbnn_cli.cli", "train", "regression", f"hydra.run.dir={run_dir}", *TINY],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads((run_dir / "results.json").read_text())
    assert record["pipeline"] == "train_regression" and record["status"] == "complete"
    assert record["config"]["trainer"]["epochs"] == 3
    assert "gradient_variance.csv" in record["tables"] and record["figures"]["training"] == "training.png"
    assert (run_dir / "done").exists()
    missing = subprocess.run(
        [sys.executable, "-m", "cfbnn_cli.cli", "train", "regression", f"hydra.run.dir={tmp_path / 'r2'}",
         "data=year_prediction_msd", f"data.path={tmp_path}/none.txt"],
        capture_output=True, text=True, timeout=600,
    )
    assert missing.returncode == 1 and "fetch_year_prediction_msd.py" in missing.stdout + missing.stderr


@pytest.mark.slow
def test_readme_main_command(tmp_path):
    """The README's main job exactly as written (default config), end to end."""
    out = subprocess.run(["cfbnn", "train", "regression", f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads((tmp_path / "results.json").read_text())["status"] == "complete"
