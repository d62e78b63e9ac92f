"""`cfbnn train classification` on a table as people have it (an ID column, text labels, blank
cells), its held-out metrics beside a logistic regression, and `cfbnn predict` of its model."""

from __future__ import annotations

import csv
import json

import numpy as np
import pandas as pd
import pytest
from conftest import one_line_error

from cfbnn_cli.bnn import load_model
from cfbnn_cli.cli import compose_config
from cfbnn_cli.pipelines import classification
from cfbnn_cli.report.numbers import format_value


@pytest.fixture(scope="module")
def patients(tmp_path_factory):
    """scikit-learn's breast-cancer table as a clinic would keep it: an ID column, text labels,
    a few blank cells."""
    from sklearn.datasets import load_breast_cancer

    folder = tmp_path_factory.mktemp("classification")
    data = load_breast_cancer(as_frame=True)
    frame = data.frame.drop(columns="target").iloc[:, :8]
    frame.insert(0, "patient_id", [f"P{i:04d}" for i in range(len(frame))])
    frame["diagnosis"] = np.where(data.target == 0, "malignant", "benign")
    rng = np.random.default_rng(0)
    for row, column in zip(rng.integers(0, len(frame), 5), rng.integers(1, 9, 5)):
        frame.iloc[row, column] = np.nan
    frame.to_csv(folder / "patients.csv", index=False)
    return folder, frame


@pytest.mark.slow
def test_a_real_table_trains_with_its_id_column_dropped_and_blank_rows_left_out(patients, cfbnn):
    folder, frame = patients
    base = ["train", "classification", "data=csv", f"data.path={folder / 'patients.csv'}", "data.target=diagnosis"]
    refused = one_line_error(cfbnn(*base, f"hydra.run.dir={folder / 'refused'}"))
    assert "column `patient_id`, row 1: 'P0000' is not a number" in refused and "data.drop=[patient_id]" in refused
    blank = one_line_error(cfbnn(*base, "data.drop=[patient_id]", f"hydra.run.dir={folder / 'blank'}"))
    assert "blank (or NA)" in blank and "data.missing=drop" in blank
    run = folder / "run"
    done = cfbnn(*base, "data.drop=[patient_id]", "data.missing=drop", f"hydra.run.dir={run}", "device=cpu")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "classification.md:" in done.stdout
    metrics = json.loads((run / "results.json").read_text())["metrics"]
    incomplete = int(frame.isna().any(axis=1).sum())
    assert metrics["fit/train_rows"] + metrics["fit/test_rows"] == len(frame) - incomplete
    assert metrics["fit/classes"] == 2 and metrics["fit/converged"] == 1
    # a logistic regression on the same split is a strong baseline on this table (~95 %)
    assert metrics["fit/test_accuracy"] >= max(0.85, metrics["fit/baseline_accuracy"] - 0.05)
    assert 0 < metrics["fit/test_nll"] < 0.5
    # beside the baseline's accuracy its log-likelihood, and that of the training class frequencies
    # (the floor a fit must beat); classification.md prints them as log-likelihoods, the fit's sign
    table = (run / "classification.md").read_text()
    assert 0 < metrics["fit/baseline_nll"] < metrics["fit/frequency_nll"] and metrics["fit/frequency_nll"] > 0.5
    assert "logistic regression's log-likelihood per row" in table and "learned from the features" in table
    assert f"| {format_value(-metrics['fit/baseline_nll'])} " in table
    saved = load_model(run / "model.pt")
    assert saved.classes == ["benign", "malignant"] and "patient_id" not in saved.columns


@pytest.mark.slow
def test_predict_writes_labels_and_probabilities_with_the_id_kept(patients, cfbnn):
    folder, frame = patients
    run = folder / "run"
    if not (run / "done").exists():
        pytest.skip("needs the run of the test above")
    new = frame.drop(columns="diagnosis").iloc[:40]
    new.to_csv(folder / "new.csv", index=False)
    done = cfbnn("predict", str(run), str(folder / "new.csv"), "--keep", "patient_id", "--out", str(folder / "p.csv"))
    assert done.returncode == 0, done.stderr
    with open(folder / "p.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["row", "patient_id", "label", "probability", "p_benign", "p_malignant"]
    assert [r["patient_id"] for r in rows] == new["patient_id"].tolist()
    blank = new.drop(columns="patient_id").isna().any(axis=1).to_numpy()
    assert [r["label"] == "" for r in rows] == blank.tolist()
    if blank.any():
        assert f"{int(blank.sum())} of 40 rows have a blank feature" in done.stderr
    for r in (r for r in rows if r["label"]):
        p = np.array([float(r["p_benign"]), float(r["p_malignant"])])
        assert p.sum() == pytest.approx(1.0, abs=1e-6)
        assert r["label"] == ["benign", "malignant"][int(p.argmax())] and float(r["probability"]) == p.max()
    # the training rows' own labels: mostly right
    truth = frame["diagnosis"].iloc[:40].to_numpy()
    predicted = np.array([r["label"] for r in rows])
    assert (predicted[~blank] == truth[~blank]).mean() > 0.85


def test_bundled_data_and_minibatch_training(tmp_path):
    cfg = compose_config(
        "train_classification",
        ["data=iris", "fit.full_batch_max_rows=50", "trainer.epochs=30", "fit.refit=false", "device=cpu"],
    )
    (tmp_path / "run").mkdir()
    result = classification.run(cfg, tmp_path / "run")
    assert result["metrics"]["fit/classes"] == 3 and result["metrics"]["fit/iterations"] <= 30
    assert "Adam" in (tmp_path / "run" / "classification.md").read_text()
    assert (tmp_path / "run" / "classification.png").is_file()
    assert load_model(tmp_path / "run" / "model.pt").classes == ["setosa", "versicolor", "virginica"]
    # metrics.csv: the ELBO per row (a log-probability less KL / N: below 0, a few nats at most), not
    # the whole data's (~120 times as large)
    elbo = pd.read_csv(tmp_path / "run" / "metrics.csv")["train_elbo_per_point"]
    assert elbo.iloc[1:].between(-10, 0).all(), elbo


def test_numeric_labels_are_ordered_as_numbers(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(60, 2))
    frame = pd.DataFrame({"a": x[:, 0], "b": x[:, 1], "grade": np.where(x[:, 0] > 0, 10, 9)})
    frame.loc[::3, "grade"] = 2
    frame.to_csv(tmp_path / "g.csv", index=False)
    cfg = compose_config(
        "train_classification",
        ["data=csv", f"data.path={tmp_path / 'g.csv'}", "data.target=grade", "fit.refit=false", "fit.baseline=false"],
    )
    (tmp_path / "run").mkdir()
    classification.run(cfg, tmp_path / "run")
    assert load_model(tmp_path / "run" / "model.pt").classes == ["2", "9", "10"]
