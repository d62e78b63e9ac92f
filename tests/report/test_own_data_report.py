"""report/ on own-data runs: a fit's test metrics (regression: RMSE, LL, 90 %-interval coverage;
classification: accuracy, NLL) as a table and a figure, configurations in numeric order, and no
gradient-variance files for runs that measured none."""

import json
import math
import statistics

import pandas as pd

from cfbnn_cli.report.aggregate import report
from cfbnn_cli.report.grouping import group_runs
from cfbnn_cli.report.metric_keys import FIT_CLASSIFICATION_KEYS, FIT_REGRESSION_KEYS, fit_key
from cfbnn_cli.report.numbers import split_mean_se


def _write_run(folder, pipeline, config, metrics):
    folder.mkdir(parents=True)
    record = {"pipeline": pipeline, "schema": 1, "status": "complete", "config": config, "metrics": metrics}
    (folder / "results.json").write_text(json.dumps(record))


def _assert_mean_se(cell, values):
    """``cell`` reads the mean ± s.e. (sd / sqrt(n)) of ``values``, to the digits it prints."""
    mean = statistics.mean(values)
    se = statistics.stdev(values) / math.sqrt(len(values))
    shown_mean, shown_se = split_mean_se(cell)
    decimals = len(cell.split("±")[1].strip().partition(".")[2])
    tolerance = 0.5 * 10.0**-decimals + 1e-12
    assert abs(shown_mean - mean) <= tolerance and abs(shown_se - se) <= tolerance, (cell, mean, se)


def _fit_config(seed, hidden_sizes):
    return {"seed": seed, "protocol": "fit", "model": {"hidden_sizes": hidden_sizes}, "data": {"name": "csv"}}


# hand-made per-seed values of two configurations
FIT_VALUES = {
    (50,): {"test_rmse": [56.1, 57.9, 55.2], "test_ll": [-5.41, -5.47, -5.39], "coverage_90": [0.91, 0.88, 0.93]},
    (200, 200): {"test_rmse": [61.0, 59.5, 63.4], "test_ll": [-5.52, -5.50, -5.61], "coverage_90": [0.97, 0.95, 0.96]},
}


def test_a_fits_test_metrics_are_a_table_of_mean_and_standard_error_and_a_figure(tmp_path, capsys):
    for sizes, values in FIT_VALUES.items():
        for seed in range(3):
            metrics = {fit_key(name): series[seed] for name, series in values.items()}
            metrics.update(
                {
                    fit_key("coverage_50"): 0.5,
                    fit_key("train_rows"): 318,
                    fit_key("test_rows"): 89,
                    fit_key("validation_ll"): None,
                    fit_key("train_seconds"): 3.0 + seed,
                    fit_key("iterations"): 400,
                    fit_key("converged"): 0 if (sizes == (50,) and seed == 2) else 1,
                }
            )
            _write_run(tmp_path / f"{len(sizes)}_{seed}", "train_regression", _fit_config(seed, list(sizes)), metrics)
    written = report(tmp_path)
    out = capsys.readouterr().out
    files = written["train_regression/fit"]
    assert files == [
        "report_train_regression_fit.csv",
        "report_train_regression_fit_table.csv",
        "report_train_regression_fit_table.md",
        "report_train_regression_fit_table.tex",
        "report_train_regression_fit.png",
    ]
    assert not [p.name for p in tmp_path.iterdir() if "gradient_variance" in p.name]
    figure = tmp_path / "report_train_regression_fit.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 10_000
    assert str(figure) in out  # the printed summary names the figure it wrote
    table = pd.read_csv(tmp_path / "report_train_regression_fit_table.csv", dtype=str).set_index("model.hidden_sizes")
    assert list(table.index) == ["[50]", "[200, 200]"]
    for sizes, values in FIT_VALUES.items():
        row = table.loc[json.dumps(list(sizes))]
        _assert_mean_se(row["Test RMSE"], values["test_rmse"])
        _assert_mean_se(row["Test LL per row"], values["test_ll"])
        # in per cent, as fit.md writes it
        _assert_mean_se(row["90 % interval coverage (%)"], [100 * v for v in values["coverage_90"]])
        assert row["runs"] == "3" and row["seeds"] == "0,1,2"
    assert table.loc["[50]", "Converged"] == "2 of 3" and table.loc["[200, 200]", "Converged"] == "3 of 3"
    markdown = (tmp_path / "report_train_regression_fit_table.md").read_text()
    assert "nan" not in markdown and "—" not in markdown


def test_hidden_sizes_and_numeric_factors_are_in_numeric_order(tmp_path):
    sizes = [[200, 200], [50], [100], [50, 50]]
    for i, hidden in enumerate(sizes):
        _write_run(
            tmp_path / str(i),
            "train_regression",
            _fit_config(0, hidden),
            {fit_key("test_rmse"): 1.0 + i, fit_key("test_ll"): -1.0 - i},
        )
    report(tmp_path)
    table = pd.read_csv(tmp_path / "report_train_regression_fit_table.csv", dtype=str)
    assert list(table["model.hidden_sizes"]) == ["[50]", "[50, 50]", "[100]", "[200, 200]"]
    summary = pd.read_csv(tmp_path / "report_train_regression_fit.csv", dtype=str)
    assert list(dict.fromkeys(summary["model.hidden_sizes"])) == ["[50]", "[50, 50]", "[100]", "[200, 200]"]
    runs = [
        {"config": {"seed": 0, "trainer": {"lr": lr, "epochs": epochs}}}
        for lr, epochs in [(0.1, 100), (1e-05, 20), (0.001, 100), (0.001, 20)]
    ]
    order = [
        (group["trainer.lr"], group["trainer.epochs"])
        for group, _ in group_runs(runs, ["trainer.lr", "trainer.epochs"])
    ]
    assert order == [("1e-05", "20"), ("0.001", "20"), ("0.001", "100"), ("0.1", "100")]


def test_classification_runs_get_accuracy_and_ll_as_classification_md_writes_them_with_the_baselines(tmp_path):
    """classification.md writes the accuracy in per cent and the log-likelihood per row (minus the
    NLL); the report's table too, and logistic regression's beside them."""
    accuracy = {(64,): [0.97, 0.98], (16, 16): [0.95, 0.96]}
    nll = {(64,): [0.11, 0.13], (16, 16): [0.20, 0.16]}
    baseline_nll = {(64,): [0.15, 0.14], (16, 16): [0.15, 0.14]}
    for sizes in accuracy:
        for seed in range(2):
            metrics = {
                fit_key("test_accuracy"): accuracy[sizes][seed],
                fit_key("test_nll"): nll[sizes][seed],
                fit_key("baseline_accuracy"): 0.9,
                fit_key("baseline_nll"): baseline_nll[sizes][seed],
                fit_key("classes"): 10,
                fit_key("train_rows"): 1437,
                fit_key("test_rows"): 360,
                fit_key("converged"): 1,
            }
            config = {"seed": seed, "model": {"hidden_sizes": list(sizes)}, "data": {"name": "csv"}}
            _write_run(tmp_path / f"{len(sizes)}_{seed}", "train_classification", config, metrics)
    written = report(tmp_path)
    assert "report_train_classification.png" in written["train_classification"]
    assert (tmp_path / "report_train_classification.png").read_bytes()[:4] == b"\x89PNG"
    table = pd.read_csv(tmp_path / "report_train_classification_table.csv", dtype=str).set_index("model.hidden_sizes")
    assert list(table.index) == ["[16, 16]", "[64]"]
    for sizes in accuracy:
        row = table.loc[json.dumps(list(sizes))]
        _assert_mean_se(row["Test accuracy (%)"], [100 * v for v in accuracy[sizes]])
        _assert_mean_se(row["Test LL per row"], [-v for v in nll[sizes]])
        _assert_mean_se(row["Logistic regression's LL per row"], [-v for v in baseline_nll[sizes]])
        assert (
            row["Logistic regression's accuracy (%)"].startswith("90")
            and "± 0" in row["Logistic regression's accuracy (%)"]
            and row["Converged"] == "2 of 2"
        )


def test_own_data_runs_on_different_files_are_named_by_the_files_name(tmp_path):
    """Runs on two tables differ in their data file's content hash; the table names each by its
    file's name, and by name and hash where two contents share a name."""
    files = {"a": ("prices.csv", "2349493:4677aa"), "b": ("rents.csv", "1200:99bb"), "c": ("old/prices.csv", "7:ccdd")}
    for name, (path, content) in files.items():
        folder = tmp_path / name
        _write_run(folder, "train_regression", {**_fit_config(0, [50]), "data": {"name": "csv", "path": path}},
                   {fit_key("test_rmse"): 1.0, fit_key("test_ll"): -1.0})  # fmt: skip
        (folder / ".cfbnn").mkdir()
        (folder / ".cfbnn" / "config.json").write_text(json.dumps({"config": {"data.path#content": content}}))
    report(tmp_path)
    table = pd.read_csv(tmp_path / "report_train_regression_fit_table.csv", dtype=str)
    assert sorted(table["data.path#content"]) == ["prices.csv (4677aa)", "prices.csv (ccdd)", "rents.csv"]


def _table1_run_metrics(rmse, ll, coverage, layers=None):
    """What a Table 1 run writes: its last evaluation and calibration, and (``layers``) the
    gradient variances at epochs 0 and 2 (a one-hidden-layer network samples nothing under the
    analytic estimator: no ratio)."""
    metrics = {
        "final_train_elbo_per_point": -6.1,
        "final_test_rmse": rmse,
        "final_test_ll_closed_form": ll,
        "final_test_ll_monte_carlo": ll - 0.01,
        "final_noise_std": 1.3,
        "calibration/coverage_50": 0.5,
        "calibration/coverage_90": coverage,
        "train/converged": None,
    }
    for epoch in (0, 2) if layers else ():
        for layer in layers:
            for kind in ("mean", "scale"):
                analytic = 0.0 if len(layers) == 2 else 1.0
                metrics[f"gradvar/analytic/epoch{epoch}/{layer}/{kind}"] = analytic
                metrics[f"gradvar/sampling/epoch{epoch}/{layer}/{kind}"] = 3.0
                ratio = f"gradvar_ratio_sampling_over_analytic/epoch{epoch}/{layer}/{kind}"
                metrics[ratio] = 3.0 / analytic if analytic else None
    return metrics


def test_table1_runs_that_measured_no_gradient_variance_get_test_metrics_and_no_gradient_variance_files(
    tmp_path, capsys
):
    rmse, ll, coverage = [1.27, 1.01, 1.15], [-1.66, -1.44, -1.52], [0.91, 0.92, 0.89]
    for seed in range(3):
        config = {
            "seed": seed,
            "protocol": "gradient_variance",
            "gradient_variance": {"epochs": []},
            "model": {"hidden_sizes": [50]},
            "data": {"name": "csv"},
        }
        _write_run(
            tmp_path / str(seed), "train_regression", config, _table1_run_metrics(rmse[seed], ll[seed], coverage[seed])
        )
    written = report(tmp_path)
    out = capsys.readouterr().out
    assert set(written) == {"train_regression"}
    assert not [p.name for p in tmp_path.iterdir() if "gradient_variance" in p.name]
    assert "report_train_regression.png" in written["train_regression"]
    assert "no gradient variance measured" in out
    table = pd.read_csv(tmp_path / "report_train_regression_table.csv", dtype=str)
    assert len(table) == 1
    _assert_mean_se(table.loc[0, "Test RMSE"], rmse)
    _assert_mean_se(table.loc[0, "Test LL per row"], ll)  # the closed-form predictive's
    _assert_mean_se(table.loc[0, "90 % interval coverage (%)"], [100 * v for v in coverage])
    markdown = (tmp_path / "report_train_regression_table.md").read_text()
    assert "— / —" not in markdown and "nan" not in markdown


def test_measured_and_unmeasured_table1_runs_are_separate_and_table1_has_the_columns_of_every_depth(tmp_path):
    """A folder of Table 1 runs of two depths, and runs that measured nothing: Table 1 holds only
    the measured runs, with first, second, final layer in that order even though the one-hidden-layer
    run comes first; a layer a network lacks is an empty cell, not "— / —" or "nan"."""
    one, two = ["first", "final"], ["first", "second", "final"]
    for seed in range(2):
        for name, hidden, layers in (("a", [50], one), ("b", [20, 20], two), ("c", [50], None)):
            config = {
                "seed": seed,
                "protocol": "gradient_variance",
                "gradient_variance": {"epochs": [0, "last"] if layers else []},
                "model": {"hidden_sizes": hidden},
                "trainer": {"epochs": 2},
                "data": {"name": "synthetic"},
            }
            metrics = _table1_run_metrics(1.0 + seed, -1.5 - seed, 0.9, layers)
            _write_run(tmp_path / f"{name}{seed}", "train_regression", config, metrics)
    written = report(tmp_path)
    assert set(written) == {"train_regression", "train_regression/gradient_variance"}
    assert "report_train_regression_gradient_variance_test_metrics.png" in written["train_regression/gradient_variance"]
    unmeasured = pd.read_csv(tmp_path / "report_train_regression_table.csv", dtype=str)
    assert list(unmeasured["runs"]) == ["2"]  # the two runs of c, which measured nothing
    table1 = pd.read_csv(tmp_path / "report_train_regression_gradient_variance_table.csv", dtype=str)
    assert set(table1["model.hidden_sizes"]) == {"[50]", "[20, 20]"} and set(table1["runs"]) == {"2"}
    layer_columns = [c for c in table1.columns if c.startswith("Upon initialization")]
    assert [c.rsplit(": ", 1)[1] for c in layer_columns] == ["First Layer", "Second Layer", "Final Layer"]
    shallow = table1[table1["model.hidden_sizes"] == "[50]"].set_index("Estimator")
    assert shallow["Upon initialization (epoch 0): Second Layer"].isna().all()  # an empty cell
    assert shallow.loc["Ratio sampling / analytic", "Upon initialization (epoch 0): Final Layer"] == "— / —"
    markdown = (tmp_path / "report_train_regression_gradient_variance_table.md").read_text()
    assert "nan" not in markdown
    test_metrics = pd.read_csv(
        tmp_path / "report_train_regression_gradient_variance_test_metrics_table.csv", dtype=str
    ).set_index("model.hidden_sizes")
    assert list(test_metrics.index) == ["[20, 20]", "[50]"]  # element by element: 20 < 50
    _assert_mean_se(test_metrics.loc["[50]", "Test RMSE"], [1.0, 2.0])


def test_the_fit_keys_are_the_pipelines_contract():
    assert FIT_REGRESSION_KEYS == tuple(
        f"fit/{name}"
        for name in (
            "test_rmse",
            "mean_rmse",
            "test_ll",
            "reference_ll",
            "coverage_90",
            "coverage_50",
            "noise_sd",
            "train_rows",
            "test_rows",
            "validation_ll",
            "train_seconds",
            "iterations",
            "converged",
        )
    )
    assert FIT_CLASSIFICATION_KEYS == tuple(
        f"fit/{name}"
        for name in (
            "test_accuracy",
            "test_nll",
            "baseline_accuracy",
            "baseline_nll",
            "frequency_nll",
            "train_rows",
            "test_rows",
            "classes",
            "train_seconds",
            "iterations",
            "converged",
        )
    )
