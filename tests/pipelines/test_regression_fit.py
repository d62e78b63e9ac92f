"""Own data, fitted: `cfbnn train regression data=csv ...` selects protocol=fit (the UCI recipe on
one held-out split), prints and records held-out metrics, writes model.pt; the same split and
seed give the UCI protocol's own number."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from conftest import one_line_error

from cfbnn_cli.bnn import load_model
from cfbnn_cli.cli import compose_config
from cfbnn_cli.pipelines import regression

NOISE = 0.3


def _table(rows=300, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3))
    y = np.sin(2 * x[:, 0]) + 0.5 * x[:, 1] + 10.0 + NOISE * rng.normal(size=rows)
    return pd.DataFrame({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "target": y})


def test_the_readme_one_liner_fits_and_reports_held_out_metrics(tmp_path, cfbnn):
    _table().to_csv(tmp_path / "mine.csv")  # pandas' default: an unnamed index column in front
    run = tmp_path / "run"
    done = cfbnn(
        "train", "regression", "data=csv", f"data.path={tmp_path / 'mine.csv'}", "data.target=target",
        f"hydra.run.dir={run}", "device=cpu",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fit.md:" in done.stdout and "90 % interval coverage" in done.stdout
    assert "row index (pandas' to_csv writes one), left out" in done.stdout + done.stderr
    results = json.loads((run / "results.json").read_text())
    metrics = results["metrics"]
    assert results["status"] == "complete" and results["config"]["protocol"] == "fit"
    assert metrics["fit/test_rows"] == 30 and metrics["fit/train_rows"] == 270 and metrics["fit/converged"] == 1
    # the data's noise is N(0, 0.3^2) around a smooth function: a converged fit is near it
    assert metrics["fit/test_rmse"] < 2 * NOISE and 0.5 * NOISE < metrics["fit/noise_sd"] < 2 * NOISE
    assert 0.7 <= metrics["fit/coverage_90"] <= 1.0
    # the test LL of a Normal with the noise's s.d.: -0.5 log(2 pi 0.09) - 0.5 = -0.71; a fit is near
    assert -1.3 < metrics["fit/test_ll"] < -0.3
    assert (run / "fit.png").is_file() and not list(run.glob("*gradient_variance*"))
    saved = load_model(run / "model.pt")
    assert saved.columns == ["a", "b", "c"] and saved.target == "target"
    assert saved.method == "heteroscedastic" and saved.network.output_dim == 2  # the fit's default likelihood


def test_the_fit_is_the_uci_protocols_split_with_the_same_seed(tmp_path):
    """protocol=fit on split seed 0 and the UCI protocol's split 0 (closed_form_diagonal) train the
    same model on the same rows: the same held-out log-likelihood."""
    _table(rows=300, seed=1).to_csv(tmp_path / "t.csv", index=False)
    common = ["data=csv", f"data.path={tmp_path / 't.csv'}", "data.target=target", "device=cpu"]
    fit = compose_config("train_regression", common + ["fit.refit=false", "likelihood=normal"])
    (tmp_path / "fit").mkdir()
    fitted = regression.run(fit, tmp_path / "fit")["metrics"]
    uci = compose_config(
        "train_regression",
        common + ["experiment=uci", "uci.methods=[closed_form_diagonal]", "uci.n_splits=1", "uci.timing_repeats=1"],
    )
    (tmp_path / "uci").mkdir()
    measured = regression.run(uci, tmp_path / "uci")["metrics"]
    assert fitted["fit/test_ll"] == pytest.approx(measured["uci/closed_form_diagonal/test_ll_mean"], abs=1e-4)
    assert fitted["fit/test_rmse"] == pytest.approx(measured["uci/closed_form_diagonal/rmse_mean"], rel=1e-4)


def test_above_the_full_batch_limit_it_trains_minibatches_that_fit_the_rows(tmp_path):
    _table(rows=120, seed=2).to_csv(tmp_path / "t.csv", index=False)
    cfg = compose_config(
        "train_regression",
        [
            "data=csv",
            f"data.path={tmp_path / 't.csv'}",
            "data.target=target",
            "device=cpu",
            "fit.full_batch_max_rows=50",  # 108 training rows: Adam with validation stopping
            "trainer.batch_size=500",  # more than the rows: lowered to them
            "trainer.epochs=40",
            "fit.refit=false",
        ],
    )
    (tmp_path / "run").mkdir()
    result = regression.run(cfg, tmp_path / "run")
    assert result["metrics"]["fit/iterations"] <= 40
    assert "Adam" in (tmp_path / "run" / "fit.md").read_text()
    assert np.isfinite(result["metrics"]["fit/test_ll"])


def test_fit_settings_are_checked_before_any_work(tmp_path):
    from cfbnn_cli.runtime.errors import ConfigError, DataError

    _table(rows=40).to_csv(tmp_path / "t.csv", index=False)
    base = ["data=csv", f"data.path={tmp_path / 't.csv'}", "data.target=target"]
    with pytest.raises(ConfigError, match="fit.method='pyro' is not one of"):
        regression.validate(compose_config("train_regression", base + ["fit.method=pyro"]))
    with pytest.raises(ConfigError, match=r"likelihood=heteroscedastic \(the fit's default\) with fit.method=closed_"):
        regression.validate(compose_config("train_regression", base + ["fit.method=closed_form_full"]))
    from cfbnn_cli.pipelines.regression import fit as fit_protocol

    assert fit_protocol.validate(compose_config("train_regression", base)) == "heteroscedastic"  # the default
    normal = compose_config("train_regression", base + ["likelihood=normal", "fit.method=closed_form_full"])
    assert fit_protocol.validate(normal) == "closed_form_full"
    with pytest.raises(ConfigError, match="model.prior_scale='wide' must be a positive, finite number or auto"):
        regression.validate(compose_config("train_regression", base + ["model.prior_scale=wide"]))
    (tmp_path / "run").mkdir()
    with pytest.raises(DataError, match=r"data.features names column\(s\) z that the file does not have"):
        regression.run(compose_config("train_regression", base + ["data.features=[z]"]), tmp_path / "run")


@pytest.mark.slow
def test_a_bad_fit_setting_is_one_line_through_the_cli(tmp_path, cfbnn):
    _table(rows=40).to_csv(tmp_path / "t.csv", index=False)
    out = cfbnn(
        "train", "regression", "data=csv", f"data.path={tmp_path / 't.csv'}", "data.target=target", "fit.rtol=-1"
    )
    assert "fit.rtol" in one_line_error(out)
