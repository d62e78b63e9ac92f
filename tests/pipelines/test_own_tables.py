"""Own tables end to end: a fit with a categorical column and a log-transformed positive target,
its model.pt read back by `cfbnn predict` and the library to the same numbers; the log-normal it
implies against Monte Carlo and scipy; a data error before torch loads."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

from cfbnn_cli.bnn import Predictive, load_model
from cfbnn_cli.bnn.target_units import LogNormalPredictive, in_target_units
from cfbnn_cli.cli import compose_config
from cfbnn_cli.data.header_check import check_command_line
from cfbnn_cli.data.tabular import held_out_split
from cfbnn_cli.pipelines import predict as predict_pipeline
from cfbnn_cli.pipelines import regression
from cfbnn_cli.runtime.errors import ConfigError, DataError


def test_the_log_normal_moments_interval_and_density_match_monte_carlo_and_scipy():
    mean = torch.tensor([0.0, 1.5, -0.7, 3.0], dtype=torch.float64)
    variance = torch.tensor([0.04, 0.25, 0.5, 0.01], dtype=torch.float64)
    normal = Predictive(mean, variance * 0.5, variance * 0.3, variance * 0.2, exact=True)
    log_normal = in_target_units(normal, 0.0, 1.0, "log")
    assert isinstance(log_normal, LogNormalPredictive)
    draws = 200_000
    z = mean + variance.sqrt() * torch.randn(draws, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = z.exp()
    se_mean = y.std(0) / math.sqrt(draws)
    assert torch.all((log_normal.mean - y.mean(0)).abs() < 5 * se_mean)
    # the s.e. of a sample variance: sqrt((m4 - s^4) / n)
    centred = y - y.mean(0)
    se_variance = ((centred**4).mean(0) - centred.square().mean(0) ** 2).sqrt() / math.sqrt(draws)
    assert torch.all((log_normal.variance - y.var(0)).abs() < 5 * se_variance)
    torch.testing.assert_close(log_normal.stddev, log_normal.variance.sqrt())
    lower, upper = log_normal.interval(0.9)
    inside = ((y >= lower) & (y <= upper)).double().mean(0)
    assert torch.all((inside - 0.9).abs() < 5 * math.sqrt(0.9 * 0.1 / draws))
    assert torch.all(lower > 0)
    points = torch.tensor([0.5, 4.0, 0.3, 20.0], dtype=torch.float64)
    reference = stats.lognorm(s=variance.sqrt().numpy(), scale=mean.exp().numpy()).logpdf(points.numpy())
    np.testing.assert_allclose(log_normal.log_prob(points).numpy(), reference, rtol=1e-12)
    assert log_normal.log_prob(torch.tensor([-1.0, 0.0, 1.0, 1.0], dtype=torch.float64))[:2].eq(-math.inf).all()
    # tiny variances: the variance formed with expm1 keeps its digits
    tiny = in_target_units(Predictive(mean, variance * 1e-12, variance * 0, variance * 0, True), 0.0, 1.0, "log")
    torch.testing.assert_close(tiny.variance, (2 * mean).exp() * variance * 1e-12, rtol=1e-6, atol=0)


def _prices(rows=240, seed=0):
    """A price-like table: positive, right-skewed, multiplicative in a carat and a cut, an ID."""
    rng = np.random.default_rng(seed)
    cut = rng.choice(["Fair", "Good", "Ideal"], rows)
    carat = rng.uniform(0.2, 2.5, rows)
    log_price = 7.5 + 1.6 * np.log(carat) + np.select([cut == "Fair", cut == "Good"], [-0.3, 0.0], 0.2)
    price = np.exp(log_price + 0.15 * rng.normal(size=rows)).round(2)
    return pd.DataFrame({"id": [f"D{i:04d}" for i in range(rows)], "carat": carat.round(3), "cut": cut, "price": price})


@pytest.fixture(scope="module")
def log_price_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prices")
    frame = _prices()
    frame.to_csv(folder / "prices.csv", index=False)
    cfg = compose_config(
        "train_regression",
        [
            "data=csv",
            f"data.path={folder / 'prices.csv'}",
            "data.target=price",
            "data.drop=[id]",
            "data.categorical=[cut]",
            "data.target_transform=log",
            "model.hidden_sizes=[16]",
            "fit.refit=false",  # model.pt is the model tested on the held-out rows
            "fit.max_iterations=150",
            "device=cpu",
        ],
    )
    run_dir = folder / "run"
    run_dir.mkdir()
    result = regression.run(cfg, run_dir)
    return folder, run_dir, frame, result["metrics"]


def test_a_log_target_fit_reports_and_predicts_in_the_targets_units(log_price_run, tmp_path):
    folder, run_dir, frame, metrics = log_price_run
    saved = load_model(run_dir / "model.pt")
    assert saved.target_transform == "log" and saved.inputs == ["carat", "cut"]
    assert saved.columns == ["carat", "cut=Fair", "cut=Good", "cut=Ideal"]
    # fit.md's held-out log-likelihood is the log-normal density of the price (scipy's), per row
    _, test = held_out_split(len(frame), 0.1, 0)
    held = frame.iloc[test]
    log_scale = saved.predict(held).log_scale
    reference = stats.lognorm(s=log_scale.stddev.numpy(), scale=np.exp(log_scale.mean.numpy())).logpdf(held["price"])
    assert metrics["fit/test_ll"] == pytest.approx(reference.mean(), abs=1e-4)
    assert "fitted on log(price)" in (run_dir / "fit.md").read_text()
    # the training file as it is (id, price there): cfbnn predict and the library give the same numbers
    frame.to_csv(tmp_path / "new.csv", index=False)
    written = pd.read_csv(
        predict_pipeline.predict_run(run_dir / "model.pt", tmp_path / "new.csv", keep=["id"], out=tmp_path / "p.csv")
    )
    assert list(written.columns) == [
        "row", "id", "mean", "sd", "median", "log_var_a", "log_var_b", "log_noise", "lower_90", "upper_90",
    ]  # fmt: skip
    library = saved.predict(frame.sample(frac=1.0, random_state=0).sort_index())  # any row and column order
    np.testing.assert_allclose(written["mean"], library.mean.numpy(), rtol=1e-6)
    np.testing.assert_allclose(written["lower_90"], library.interval(0.9)[0].numpy(), rtol=1e-6)
    assert (written["lower_90"] > 0).all() and (written["lower_90"] < written["median"]).all()
    inside = (frame["price"] >= written["lower_90"]) & (frame["price"] <= written["upper_90"])
    assert inside.mean() > 0.75


def test_a_non_positive_target_is_refused_for_the_log_transform(tmp_path):
    frame = _prices(rows=30)
    frame.loc[7, "price"] = 0.0
    frame.to_csv(tmp_path / "p.csv", index=False)
    cfg = compose_config(
        "train_regression",
        ["data=csv", f"data.path={tmp_path / 'p.csv'}", "data.target=price", "data.drop=[id]",
         "data.categorical=[cut]", "data.target_transform=log"],
    )  # fmt: skip
    (tmp_path / "run").mkdir()
    with pytest.raises(DataError, match=r"column `price`, row 8: '0.0' is not positive; data.target_transform=log"):
        regression.run(cfg, tmp_path / "run")
    with pytest.raises(ConfigError, match="data.target_transform=log is for protocol=fit"):
        regression.run(
            compose_config("train_regression", [*cfg_overrides(tmp_path), "experiment=uci"]), tmp_path / "run"
        )


def cfg_overrides(tmp_path):
    return ["data=csv", f"data.path={tmp_path / 'p.csv'}", "data.target=price", "data.drop=[id,cut]",
            "data.target_transform=log"]  # fmt: skip


def test_the_header_is_checked_from_the_command_line(tmp_path):
    pd.DataFrame({"sepal": [1.0], "species": ["a"]}).to_csv(tmp_path / "iris.csv", index=False)
    base = ["data=csv", f"data.path={tmp_path / 'iris.csv'}"]
    with pytest.raises(DataError, match=r"no column named `specie` \(data.target\) \(did you mean species\?\)"):
        check_command_line([*base, "data.target=specie"])
    with pytest.raises(ConfigError, match="data.features names sepal more than once"):
        check_command_line([*base, "data.target=species", "data.features=[sepal,sepal]"])
    with pytest.raises(DataError, match=r"data.drop names column\(s\) sepl.*did you mean sepal"):
        check_command_line([*base, "data.target=species", "data.drop=[sepl]"])
    check_command_line([*base, "data.target=species"])  # nothing wrong
    check_command_line([*base, "data.target=${oc.env:T}"])  # left to the run, which resolves it
    check_command_line([*base, "data.target=nope", "--cfg", "job"])  # printing the config reads no file


def test_a_data_error_comes_before_torch_loads(tmp_path):
    """Through the command: one line, exit 2, and torch never imported (it takes seconds)."""
    pd.DataFrame({"a": [1.0], "y": [2.0]}).to_csv(tmp_path / "x.csv", index=False)
    code = (
        "import sys\nfrom cfbnn_cli import cli\ntry:\n"
        f"    cli.main(['train', 'regression', 'data=csv', 'data.path={tmp_path / 'x.csv'}', 'data.target=nope',"
        f" 'hydra.run.dir={tmp_path / 'run'}'])\n"
        "except SystemExit as exit:\n    print('exit', exit.code, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "exit 2 False", done.stdout + done.stderr
    assert (
        done.stderr.strip()
        == f"cfbnn: error: {tmp_path / 'x.csv'}: no column named `nope` (data.target); columns are a, y"
    )
    assert not (tmp_path / "run").exists()
