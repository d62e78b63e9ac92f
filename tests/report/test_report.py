"""report/aggregate.py: `cfbnn report` groups runs, gives mean and standard error, draws Table 2."""

import json
import math

import pandas as pd
import pytest

from cfbnn_cli.report.aggregate import report


def _write_run(folder, pipeline, config, metrics):
    folder.mkdir(parents=True)
    record = {"pipeline": pipeline, "schema": 1, "status": "complete", "config": config, "metrics": metrics}
    (folder / "results.json").write_text(json.dumps(record))


def test_report_on_hand_made_runs_gives_the_known_mean_and_standard_error(tmp_path, capsys):
    values = {("analytic", 0): 1.0, ("analytic", 1): 3.0, ("analytic", 2): 5.0, ("sampling", 0): 10.0, ("sampling", 1): 14.0}
    for i, ((estimator, seed), value) in enumerate(values.items()):
        config = {"seed": seed, "estimator": {"name": estimator}, "trainer": {"epochs": 3}, "device": "cpu"}
        _write_run(tmp_path / str(i), "train_regression", config, {"final_test_rmse": value, "other": None})
    (tmp_path / "9").mkdir()
    (tmp_path / "9" / "results.json").write_text("{ truncated")
    written = report(tmp_path)
    err = capsys.readouterr().err
    assert f"skipping {tmp_path / '9' / 'results.json'}" in err  # the corrupt file is named, the rest aggregated
    summary = pd.read_csv(tmp_path / "report_train_regression.csv")
    rmse = summary[summary["metric"] == "final_test_rmse"].set_index("estimator.name")
    assert list(summary.columns[:2]) == ["estimator.name", "metric"]  # grouped by the swept key only
    assert rmse.loc["analytic", "mean"] == pytest.approx(3.0) and rmse.loc["analytic", "n"] == 3
    assert rmse.loc["analytic", "se"] == pytest.approx(2.0 / math.sqrt(3))  # sd of (1, 3, 5) is 2
    assert rmse.loc["sampling", "mean"] == pytest.approx(12.0)
    assert rmse.loc["sampling", "se"] == pytest.approx(math.sqrt(8.0) / math.sqrt(2))
    markdown = (tmp_path / "report_train_regression_table.md").read_text()
    assert "3.0000 ± 1.1547" in markdown and "12.00 ± 2.00" in markdown
    assert "report_train_regression_table.tex" in written["train_regression"]


def test_report_makes_table_2_from_single_variant_runs(tmp_path):
    for i, (variant, seed, value) in enumerate([("v1", 0, -10.0), ("v1", 1, -12.0), ("v3", 0, -9.0), ("v3", 1, -9.5)]):
        _write_run(tmp_path / str(i), "vae", {"variant": variant, "seed": seed}, {f"vae/{variant}/test_ll": value})
    report(tmp_path)
    table = pd.read_csv(tmp_path / "report_vae_table.csv", index_col=0)
    assert list(table.index) == ["V1", "V3"]
    assert table.loc["V1"].iloc[0] == "-11.00 ± 1.00"
    assert (tmp_path / "report_vae.png").read_bytes()[:4] == b"\x89PNG"
