"""data/regression.py: YearPredictionMSD (txt and zip), its fetch script, CSV/NPZ tables, diabetes."""

import os
import subprocess
import sys
import zipfile

import numpy as np
import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from cfbnn_cli.data.regression import load_regression_data, tabular_file, year_prediction_msd
from cfbnn_cli.runtime.errors import DataError


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
    script = os.path.join(os.path.dirname(__file__), "..", "..", "data_scripts", "fetch_year_prediction_msd.py")
    ok = subprocess.run(
        [sys.executable, script, "--verify-only", str(txt), "--rows", "12"], capture_output=True, text=True
    )
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
    with pytest.raises(DataError, match="column `b`, row 2: 'oops' is not a number"):
        tabular_file(tmp_path / "bad.csv", "strength")
    (tmp_path / "nan.csv").write_text("a,b,strength\n1,2,3\n4,nan,6\n7,8,9\n")
    with pytest.raises(DataError, match="column `b`, row 2: blank"):
        tabular_file(tmp_path / "nan.csv", "strength")
    with pytest.raises(DataError, match="no column named `y`"):
        tabular_file(tmp_path / "t.csv", "y")


def test_diabetes_config_loads():
    cfg = OmegaConf.create({"name": "diabetes", "test_fraction": 0.1, "seed": 0})
    data = load_regression_data(cfg)
    assert data.input_dim == 10 and data.num_train == 398


@pytest.mark.parametrize(
    "preset, rows, features, target_mean",
    # sizes as documented in R's MASS and Ecdat; the target means pin the column that is read
    # (Boston's medv 22.53 and Caschool's testscr 654.2 are the textbook values)
    [
        ("boston", 506, 13, 22.5328),
        ("housing", 546, 11, 68121.60),
        ("caschool", 420, 10, 654.1565),
        ("computers", 6259, 9, 2219.577),
    ],
)
def test_bundled_real_presets_load_with_their_published_shape(preset, rows, features, target_mean):
    from cfbnn_cli.cli import compose_config
    from cfbnn_cli.data.regression import load_regression_table

    cfg = compose_config("train_regression", [f"data={preset}"])
    table = load_regression_table(cfg.data)
    assert table.x.shape == (rows, features) and len(table.y) == rows
    assert table.y.mean() == pytest.approx(target_mean, rel=1e-5)
    assert np.isfinite(table.x).all() and table.target == cfg.data.target
    data = load_regression_data(cfg.data)
    assert data.num_train + data.x_test.shape[0] == rows


def test_rdataset_errors_name_the_fix():
    from cfbnn_cli.data.regression import rdataset

    with pytest.raises(DataError, match="no column `price`.*columns are"):
        rdataset("MASS/Boston", "price")
    with pytest.raises(DataError, match="column `county` is not numeric.*data.drop"):
        rdataset("Ecdat/Caschool", "testscr")
    with pytest.raises(DataError, match="cannot read resources/rdata/csv/MASS/NoSuchSet.csv"):
        rdataset("MASS/NoSuchSet", "y")
