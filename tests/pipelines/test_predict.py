"""The predictive as an object (``model(x)``, ``model.predict``) and ``cfbnn predict RUN NEW.csv``."""

from __future__ import annotations

import csv
import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import one_line_error

from cfbnn_cli.bnn import BayesianNetwork, ClosedFormBNN, Predictive
from cfbnn_cli.pipelines import predict as predict_pipeline
from cfbnn_cli.pipelines import regression
from cfbnn_cli.pipelines.regression import gradient_variance_study as pipeline


def _monte_carlo_moments(model, x, draws=40_000, seed=0):
    """Mean and variance of y by sampling every weight layer (local reparameterization, which is
    exact in distribution for one data point at a time) plus the likelihood's noise."""
    outputs = model.sample_outputs(x, draws, generator=torch.Generator().manual_seed(seed))  # (S, N)
    noise = 1.0 / float(model.precision.detach())
    return outputs.mean(0), outputs.var(0) + noise, outputs


@pytest.mark.parametrize("hidden", [[30], [30, 20]])
def test_model_of_x_is_the_predictive_and_matches_monte_carlo(hidden):
    torch.manual_seed(0)
    model = BayesianNetwork(4, hidden, init_scale=0.3).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    prediction = model(x)
    assert isinstance(prediction, Predictive) and prediction.exact == (len(hidden) == 1)
    mc_mean, mc_var, outputs = _monte_carlo_moments(model, x)
    draws = outputs.shape[0]
    mean_se = (mc_var / draws).sqrt()
    var_se = mc_var * math.sqrt(2.0 / draws) * 2  # a generous s.e. of a variance (tails of y are not Normal)
    predicted = model.predict(x, num_samples=4000, generator=torch.Generator().manual_seed(1))
    assert torch.all((predicted.mean - mc_mean).abs() < 5 * mean_se + 1e-3 * (len(hidden) - 1))
    assert torch.all((predicted.variance - mc_var).abs() < 5 * var_se)
    assert torch.all(predicted.var_a >= 0) and torch.all(predicted.var_b >= 0)


def test_closed_form_parts_are_the_paper_split_and_the_interval_is_normal():
    torch.manual_seed(1)
    model = ClosedFormBNN(3, 15, init_scale=0.2)
    x = torch.randn(5, 3)
    prediction = model(x)
    mean, var_a, var_b, noise = model.predictive(x)
    torch.testing.assert_close(prediction.mean, mean)
    torch.testing.assert_close(prediction.var_a, var_a)
    torch.testing.assert_close(prediction.var_b, var_b)
    torch.testing.assert_close(prediction.variance, var_a + var_b + noise)
    lower, upper = prediction.interval(0.9)
    torch.testing.assert_close(upper - prediction.mean, 1.6448536 * prediction.stddev, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(prediction.mean - lower, upper - prediction.mean)
    original = prediction.unscaled(10.0, 2.0)
    torch.testing.assert_close(original.mean, 10.0 + 2.0 * prediction.mean)
    torch.testing.assert_close(original.variance, 4.0 * prediction.variance)
    with pytest.raises(ValueError, match="coverage"):
        prediction.interval(1.0)
    # training calls are unchanged: model(x, y) is the summed expected log-likelihood
    y = torch.randn(5)
    torch.testing.assert_close(model(x, y), model.expected_log_likelihood(x, y))


def _write_csv(path, header, rows):
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)


@pytest.fixture(scope="module")
def trained_csv_run(tmp_path_factory):
    """A finished ``train regression`` run on a CSV with named columns, target ``price``."""
    from hydra.core.global_hydra import GlobalHydra

    from cfbnn_cli.cli import compose_config

    GlobalHydra.instance().clear()

    folder = tmp_path_factory.mktemp("predict")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 3))
    y = 3.0 * x[:, 0] - x[:, 1] + 0.1 * rng.normal(size=400) + 100.0
    _write_csv(folder / "train.csv", ["a", "b", "c", "price"], np.column_stack([x, y]))
    cfg = compose_config(
        "train_regression",
        [
            "data=csv",  # selects protocol=fit: the UCI recipe on one held-out split, then model.pt
            f"data.path={folder / 'train.csv'}",
            "data.target=price",
            "model.hidden_sizes=[32]",
            "likelihood=normal",  # one noise: its interval is the Normal's (heteroscedastic: test_fit_recipes.py)
            "fit.refit=false",  # the model tested on the held-out rows is the one saved (half the time)
            # L-BFGS stopped at 400 of its 3000 iterations: the predict tests read the saved model, not
            # the fit's convergence; held-out RMSE 0.0941 and noise s.d. 0.104 against 0.0938 and 0.104
            # converged (2990 iterations), 11 s -> 5 s on 2 cores
            "fit.max_iterations=400",
            "device=cpu",
        ],
    )
    run_dir = folder / "run"
    run_dir.mkdir()
    regression.run(cfg, run_dir)
    (run_dir / "results.json").write_text("{}")  # what the CLI writes once a run finishes
    (run_dir / "done").write_text("")
    return folder, run_dir, x, y


def _read_predictions(path):
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    return {key: np.array([float(r[key]) for r in rows]) for key in rows[0]}


def test_predict_writes_original_units_for_columns_in_any_order(trained_csv_run, tmp_path):
    folder, run_dir, x, y = trained_csv_run
    new = x[:20]
    _write_csv(
        tmp_path / "new.csv", ["c", "price", "a", "b"], np.column_stack([new[:, 2], y[:20], new[:, 0], new[:, 1]])
    )
    out = predict_pipeline.predict_run(run_dir, tmp_path / "new.csv", out=tmp_path / "p.csv")
    table = _read_predictions(out)
    assert list(table) == ["row", "mean", "sd", "var_a", "var_b", "noise", "lower_90", "upper_90"]
    assert list(table["row"]) == list(range(1, 21))
    # original units: the target is ~100 + 3a - b; a fitted model is within a few noise s.d.
    assert np.abs(table["mean"] - y[:20]).mean() < 0.5
    np.testing.assert_allclose(table["sd"] ** 2, table["var_a"] + table["var_b"] + table["noise"], rtol=1e-5)
    np.testing.assert_allclose(table["upper_90"] - table["mean"], 1.6448536 * table["sd"], rtol=1e-4)
    inside = (y[:20] >= table["lower_90"]) & (y[:20] <= table["upper_90"])
    assert inside.mean() >= 0.7  # a 90 % interval covers most training-like rows


def _main_error(capsys, *args):
    """``cfbnn predict ARGS`` in this process: its exit code must be 2, its stderr one line."""
    assert predict_pipeline.main([str(a) for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("cfbnn: error: "), err
    assert sum(line.startswith("cfbnn: error") for line in err) == 1 and "Traceback" not in "\n".join(err)
    return err[-1]


def test_predict_errors_are_one_line(trained_csv_run, tmp_path, cfbnn, capsys):
    folder, run_dir, x, _ = trained_csv_run
    _write_csv(tmp_path / "other.csv", ["a", "b", "d"], x[:3])
    # once through the command itself: exit 2, one line, no traceback
    text = one_line_error(cfbnn("predict", str(run_dir), str(tmp_path / "other.csv")))
    assert "missing c" in text and "not used by the model: d" in text and "--keep" in text
    _write_csv(tmp_path / "text.csv", ["a", "b", "c"], [["1", "2", "x"]])
    assert "column `c`, row 1: 'x' is not a number" in _main_error(capsys, run_dir, tmp_path / "text.csv")
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "results.json").write_text("{}")
    assert "not finished" in _main_error(capsys, unfinished, folder / "train.csv")
    assert "not a cfbnn run dir" in _main_error(capsys, tmp_path, folder / "train.csv")
    assert "no such file" in _main_error(capsys, run_dir, tmp_path / "nope.csv")
    assert "--estimator" in _main_error(capsys, run_dir, folder / "train.csv", "--estimator", "magic")
    assert "is a directory; give a file path" in _main_error(capsys, run_dir, folder / "train.csv", "--out", tmp_path)
    for seed in ("-1", str(2**70)):
        assert "--seed" in _main_error(capsys, run_dir, folder / "train.csv", "--seed", seed)
    np.save(tmp_path / "rows.npy", x[:3])
    assert "NumPy .npy array, not a CSV" in _main_error(capsys, run_dir, tmp_path / "rows.npy")
    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / "results.json").write_text('{"status": "failed", "error": "data.csv, line 7: non-numeric value"}')
    assert "is a failed run (data.csv, line 7" in _main_error(capsys, failed, folder / "train.csv")
    assert not (tmp_path / "p.csv").exists() and not (run_dir / "predictions.csv").exists()


def test_predict_ignores_a_blank_or_na_target_column(trained_csv_run, tmp_path):
    """New rows' targets are unknown: a blank or NA target column is ignored like a filled one."""
    folder, run_dir, x, y = trained_csv_run
    _write_csv(tmp_path / "filled.csv", ["a", "price", "b", "c"], [[*r[:1], t, *r[1:]] for r, t in zip(x[:5], y[:5])])
    _write_csv(
        tmp_path / "blank.csv",
        ["a", "price", "b", "c"],
        [[r[0], blank, r[1], r[2]] for r, blank in zip(x[:5], ["", "NA", "", "", ""])],
    )
    filled = _read_predictions(predict_pipeline.predict_run(run_dir, tmp_path / "filled.csv", out=tmp_path / "f.csv"))
    blank = _read_predictions(predict_pipeline.predict_run(run_dir, tmp_path / "blank.csv", out=tmp_path / "b.csv"))
    for key in filled:
        np.testing.assert_array_equal(blank[key], filled[key])


def test_predict_on_a_generated_data_run_reads_features_by_position(tmp_path, regression_cfg, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    pipeline.run(regression_cfg("gradient_variance.num_samples=0"), run_dir)
    (run_dir / "results.json").write_text("{}")
    (run_dir / "done").write_text("")
    from cfbnn_cli.bnn import load_model

    saved = load_model(run_dir / "model.pt")
    dim = saved.input_dim
    assert saved.columns is None
    _write_csv(tmp_path / "new.csv", [f"x{i}" for i in range(dim)], np.zeros((4, dim)))
    out = predict_pipeline.predict_run(run_dir, tmp_path / "new.csv")
    assert out == run_dir / "predictions.csv" and len(_read_predictions(out)["mean"]) == 4
    _write_csv(tmp_path / "short.csv", ["x0"], np.zeros((2, 1)))
    assert f"trained on {dim}" in _main_error(capsys, run_dir, tmp_path / "short.csv")


@pytest.mark.slow
def test_predict_classifies_new_features_with_an_imagenet_predict_head(tmp_path, imagenet_cfg, cfbnn, capsys):
    """A finished imagenet-predict run (digits, identity backbone) writes head.pt; `cfbnn predict`
    on feature vectors gives the deterministic class and the top-k variance-corrected
    probabilities. On the run's own training features the deterministic class is mostly right,
    which it is only when the features are put on the training scale."""
    from cfbnn_cli.pipelines.imagenet import pipeline as imagenet
    from cfbnn_cli.pipelines.imagenet import predict_new

    cfg = imagenet_cfg()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = imagenet.run(cfg, run_dir)
    (run_dir / "done").write_text("")
    computed = imagenet.compute_features(cfg, torch.device("cpu"))
    held, held_labels, _ = computed["held_out"]
    test_index, _ = imagenet.split_held_out(held, held_labels, cfg.split.validation_fraction, cfg.split.seed)
    # the run's own test images, as raw features: predict must reproduce the run's deterministic top-1
    np.save(tmp_path / "new.npy", held[test_index].numpy())
    out = predict_new.predict_run(run_dir, tmp_path / "new.npy", top_k=3)
    table = _read_predictions(out)
    assert list(table) == [
        "row",
        "argmax_mean",
        "class_1",
        "probability_1",
        "class_2",
        "probability_2",
        "class_3",
        "probability_3",
    ]
    accuracy = (table["argmax_mean"] == held_labels[test_index].numpy()).mean()
    assert accuracy == pytest.approx(result["metrics"]["deterministic/top1"], abs=1e-9)
    assert accuracy > 0.5  # digits, 10 classes: far above chance
    assert np.all(table["probability_1"] >= table["probability_2"]) and np.all(
        table["probability_2"] >= table["probability_3"]
    )
    assert np.all(table["probability_1"] + table["probability_2"] + table["probability_3"] <= 1 + 1e-6)
    # through the command: the run's kind picks the prediction; errors are one line
    done = cfbnn("predict", str(run_dir), str(tmp_path / "new.npy"), "--out", str(tmp_path / "p.csv"))
    assert done.returncode == 0, done.stderr
    np.save(tmp_path / "narrow.npy", held[:5, :3].numpy())
    assert predict_new.main([str(run_dir), str(tmp_path / "narrow.npy")]) == 2
    assert "the head takes (N, " in capsys.readouterr().err


@pytest.mark.parametrize(
    "method", ["closed_form_diagonal", pytest.param("deterministic_2_hidden", marks=pytest.mark.slow)]
)
def test_a_uci_run_saves_its_chosen_method_refit_on_every_row(tmp_path, uci_cfg, method):
    """uci.save_model=<method>: after the splits that method is refit on all rows and saved;
    `cfbnn predict` then gives calibrated predictions in the target's units (the synthetic data's
    noise is N(0, 0.3²): most rows inside the 90 % interval, and the interval near ±1.645·0.3 wide)."""
    from cfbnn_cli.bnn import load_model
    from cfbnn_cli.data.regression import load_regression_table
    from cfbnn_cli.pipelines.regression import uci_protocol

    cfg = uci_cfg(f"uci.methods=[{method}]", "uci.n_splits=1", f"uci.save_model={method}")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    uci_protocol.run(cfg, run_dir)
    (run_dir / "results.json").write_text("{}")
    (run_dir / "done").write_text("")
    saved = load_model(run_dir / "model.pt")
    assert saved.method == method and saved.estimator == ("deterministic" if "deterministic" in method else "analytic")
    table = load_regression_table(cfg.data)
    _write_csv(tmp_path / "rows.csv", [f"x{i}" for i in range(table.x.shape[1])], table.x)
    out = predict_pipeline.predict_run(run_dir, tmp_path / "rows.csv")
    p = _read_predictions(out)
    inside = (table.y >= p["lower_90"]) & (table.y <= p["upper_90"])
    assert 0.8 <= inside.mean() <= 1.0
    # the saved model's noise is, in the target's units, the one the protocol's split fit learned
    # (standardized units there), up to the refit on more rows
    split_noise = pd.read_csv(run_dir / "uci_splits.csv")["noise_std"].iloc[0] * table.y.std()
    assert 0.5 < np.sqrt(np.median(p["noise"])) / split_noise < 2.0
    assert np.all(p["sd"] ** 2 >= p["noise"] * (1 - 1e-6))
    if method == "closed_form_diagonal":  # it fits this data: its s.d. is near the noise's 0.3
        assert 0.15 < np.median(p["sd"]) < 0.6


def test_uci_save_model_names_the_methods_it_can_save(uci_cfg):
    from cfbnn_cli.pipelines.regression import uci_protocol
    from cfbnn_cli.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="uci.save_model='pyro' must be null or one of closed_form_diagonal"):
        uci_protocol.validate(uci_cfg("uci.save_model=pyro"))
