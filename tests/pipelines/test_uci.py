"""pipelines/regression/uci_protocol.py: splits, units, the peers, resume and errors."""

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from cfbnn_cli.cli import compose_config
from cfbnn_cli.pipelines import regression
from cfbnn_cli.pipelines.regression import uci_protocol
from cfbnn_cli.pipelines.regression.uci_methods import original_units
from cfbnn_cli.pipelines.regression.uci_protocol import make_splits, prediction_seconds_per_1000
from cfbnn_cli.runtime.errors import ConfigError, DataError


def test_preset_composes_the_protocol():
    cfg = compose_config("train_regression", ["experiment=uci"])
    assert cfg.protocol == "uci" and cfg.data.name == "diabetes"
    assert list(cfg.uci.methods) == [
        "closed_form_diagonal",
        "closed_form_full",
        "local_reparameterization",
        "pyro",
        "pyro_local_reparameterization",
        "plain_mlp",
    ]
    assert cfg.uci.n_splits == 20 and cfg.model.prior == "fixed"
    assert uci_protocol.validate(cfg) == list(cfg.uci.methods)


def test_splits_are_reproducible_disjoint_and_differ_between_seeds():
    first = make_splits(442, 5, 0.1)
    again = make_splits(442, 5, 0.1)
    for (train, test), (train2, test2) in zip(first, again):
        np.testing.assert_array_equal(train, train2)
        np.testing.assert_array_equal(test, test2)
        assert len(test) == 44 and len(train) == 398
        assert not set(train) & set(test)
        assert sorted(set(train) | set(test)) == list(range(442))
    assert not np.array_equal(first[0][1], first[1][1])


def test_prediction_time_is_the_median_of_repeats_after_a_warm_up():
    """One slow call (a first-call cost, a busy machine) must not decide the reported time."""
    import time

    delays = iter([0.3, 0.3, 0.001, 0.001, 0.3, 0.001, 0.001])  # warm-up, then 6 repeats: 2 slow, 4 fast

    def predict(x):
        time.sleep(next(delays))

    data = type("Data", (), {"x_test": torch.zeros(7, 2)})()
    seconds = prediction_seconds_per_1000(predict, data, torch.device("cpu"), repeats=6)
    assert seconds < 0.05


def test_log_likelihood_in_original_units():
    """A hand-built case: standardized N(z | 0.5, 0.8^2) at z = 1.1, target scale 7, offset 100."""
    target_mean, target_std = 100.0, 7.0
    z_mean, z_std, z = 0.5, 0.8, 1.1
    standardized = torch.distributions.Normal(z_mean, z_std).log_prob(torch.tensor(z))
    ll, rmse = original_units(standardized.reshape(1), torch.tensor([(z - z_mean) ** 2]), target_std)
    y = target_mean + target_std * z
    direct = torch.distributions.Normal(target_mean + target_std * z_mean, target_std * z_std).log_prob(torch.tensor(y))
    assert ll == pytest.approx(float(direct), abs=1e-6)
    assert rmse == pytest.approx(abs(y - (target_mean + target_std * z_mean)), rel=1e-6)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, uci_cfg):
    run_dir = tmp_path_factory.mktemp("uci")
    return run_dir, regression.run(uci_cfg(), run_dir)  # every default method


def test_every_method_is_finite_and_outputs_exist(small_run):
    run_dir, result = small_run
    m = result["metrics"]
    for method in uci_protocol.METHODS:
        if method == "closed_form_lowrank" or method in uci_protocol.DETERMINISTIC_METHODS:
            continue  # not among the defaults: tested on their own below
        for key in (
            "test_ll_mean",
            "rmse_mean",
            "train_seconds_median",
            "predict_seconds_per_1000_median",
            "iterations_median",
        ):
            assert math.isfinite(m[f"uci/{method}/{key}"]), (method, key)
        # calibration: the shares inside the central 50/80/90/95 % intervals, nested, from the per-split records
        coverage = [m[f"uci/{method}/coverage_{level}_mean"] for level in (50, 80, 90, 95)]
        assert all(0 <= c <= 1 for c in coverage) and coverage == sorted(coverage), (method, coverage)
    records = pd.read_csv(run_dir / "uci_splits.csv")
    expected = records[records["method"] == "closed_form_diagonal"]["coverage_90"].mean()
    assert m["uci/closed_form_diagonal/coverage_90_mean"] == pytest.approx(expected)
    assert result["figures"]["calibration"] == "calibration.png" and (run_dir / "calibration.png").is_file()
    table = pd.read_csv(run_dir / "uci.csv", index_col="method")  # the numbers, one per column
    assert len(table) == 6 and table["test_ll_se"].notna().all()
    assert "±" in (run_dir / "uci.md").read_text()  # the formatted cells are for reading
    # the paired column agrees with the per-split records (recomputed here from uci_splits.csv)
    assert pd.isna(table.loc["closed_form_diagonal", "test_ll_minus_reference"])
    splits_frame = pd.read_csv(run_dir / "uci_splits.csv").pivot(index="split", columns="method", values="test_ll")
    difference = splits_frame["plain_mlp"] - splits_frame["closed_form_diagonal"]
    assert table.loc["plain_mlp", "test_ll_minus_reference"] == pytest.approx(difference.mean())
    assert table.loc["plain_mlp", "test_ll_minus_reference_se"] == pytest.approx(difference.std() / math.sqrt(2))
    assert table.loc["plain_mlp", "test_ll"] == pytest.approx(m["uci/plain_mlp/test_ll_mean"])
    assert "\\toprule" in (run_dir / "uci.tex").read_text()
    assert (run_dir / "uci.md").read_text().count("|") > 20
    assert (run_dir / "uci.png").read_bytes()[:4] == b"\x89PNG"
    per_split = pd.read_csv(run_dir / "uci_splits.csv")
    assert len(per_split) == 2 * 6 and set(per_split["split"]) == {0, 1}
    splits = json.loads((run_dir / "splits.json").read_text())
    assert [s["seed"] for s in splits["splits"]] == [0, 1]
    train, test = make_splits(200, 2, 0.1)[1]
    assert splits["splits"][1]["test"] == test.tolist() and splits["splits"][1]["train"] == train.tolist()


def test_closed_form_approaches_the_noise_floor(small_run):
    """The synthetic data's noise is N(0, 0.3^2): no predictor's expected test LL exceeds
    log N(0 | 0, 0.3^2) - 1/2 = -0.215; the closed form trained on 160 rows gets near it."""
    _, result = small_run
    floor = -math.log(0.3) - 0.5 * math.log(2 * math.pi) - 0.5
    test_ll = result["metrics"]["uci/closed_form_diagonal/test_ll_mean"]
    assert floor - 0.4 < test_ll < floor + 0.15, (test_ll, floor)


def test_each_method_stops_by_its_rule_and_keeps_an_equal_time_view(small_run):
    """The closed forms run L-BFGS to its convergence test; the minibatch methods run Adam
    with validation stopping; each minibatch method has a test LL at the reference closed
    form's training time (its own final one if it stopped sooner)."""
    run_dir, result = small_run
    per_split = pd.read_csv(run_dir / "uci_splits.csv")
    closed = per_split[per_split["method"].str.startswith("closed_form_")]
    assert (closed["optimizer"] == "lbfgs").all() and closed["converged"].all()
    peers = per_split[~per_split["method"].str.startswith("closed_form_")]
    assert (peers["optimizer"] == "adam").all()
    assert (peers["iterations"] <= 60).all()  # trainer.epochs caps them
    assert peers["equal_time_test_ll"].notna().all()
    reference = per_split[per_split["method"] == "closed_form_diagonal"]
    np.testing.assert_allclose(reference["equal_time_test_ll"], reference["test_ll"])
    assert per_split[per_split["method"] == "closed_form_full"]["equal_time_test_ll"].isna().all()
    m = result["metrics"]
    assert math.isfinite(m["uci/compare/closed_form_diagonal_vs_pyro/test_ll_difference_se"])
    table = pd.read_csv(run_dir / "uci.csv", index_col="method")
    assert table.loc["closed_form_diagonal", "optimizer"] == "lbfgs"
    assert table.loc["closed_form_diagonal", "converged_splits"] == table.loc["closed_form_diagonal", "splits"]
    assert "L-BFGS" in (run_dir / "uci.md").read_text()


def test_validation_stopping_ends_a_peer_before_its_epoch_cap(tmp_path, uci_cfg):
    """A long cap (2,000 epochs) and a short patience: the plain MLP overfits 144 rows and the
    validation rule stops it long before the cap."""
    cfg = uci_cfg(
        "uci.methods=[plain_mlp]",
        "uci.n_splits=1",
        "trainer.epochs=2000",
        "uci.patience=20",
        "model.hidden_sizes=[64]",
        "trainer.lr=0.02",
    )
    regression.run(cfg, tmp_path)
    record = pd.read_csv(tmp_path / "uci_splits.csv").iloc[0]
    assert record["stopped_early"] and record["iterations"] < 2000


def test_above_full_batch_max_rows_the_closed_form_trains_by_minibatches(tmp_path, uci_cfg):
    cfg = uci_cfg(
        "uci.methods=[closed_form_diagonal]", "uci.n_splits=1", "uci.full_batch_max_rows=100", "trainer.epochs=6"
    )
    result = regression.run(cfg, tmp_path)
    record = pd.read_csv(tmp_path / "uci_splits.csv").iloc[0]
    assert record["optimizer"] == "adam" and record["iterations"] <= 6
    assert math.isfinite(result["metrics"]["uci/closed_form_diagonal/test_ll_mean"])


def test_empirical_bayes_prior_continues_from_the_fixed_prior_optimum(tmp_path, uci_cfg):
    """model.prior=empirical_bayes: the closed form's ELBO with learned prior variances is at
    least the fixed prior's at its optimum (it starts there and maximizes over more)."""
    fixed = regression.run(uci_cfg("uci.methods=[closed_form_diagonal]", "uci.n_splits=1"), tmp_path / "fixed")
    learned = regression.run(
        uci_cfg("uci.methods=[closed_form_diagonal]", "uci.n_splits=1", "model.prior=empirical_bayes"), tmp_path / "eb"
    )
    eb_record = pd.read_csv(tmp_path / "eb" / "uci_splits.csv").iloc[0]
    fixed_record = pd.read_csv(tmp_path / "fixed" / "uci_splits.csv").iloc[0]
    assert eb_record["iterations"] > fixed_record["iterations"]  # the second stage ran
    assert math.isfinite(learned["metrics"]["uci/closed_form_diagonal/test_ll_mean"])
    assert math.isfinite(fixed["metrics"]["uci/closed_form_diagonal/test_ll_mean"])


def test_resume_runs_only_what_is_missing(tmp_path, monkeypatch, uci_cfg):
    cfg = uci_cfg("uci.methods=[closed_form_diagonal,plain_mlp]", "trainer.epochs=4")
    regression.run(cfg, tmp_path)
    progress = json.loads((tmp_path / "uci_progress.json").read_text())
    assert len(progress["records"]) == 4
    progress["records"] = progress["records"][:3]  # as if killed during the last job
    (tmp_path / "uci_progress.json").write_text(json.dumps(progress))
    calls = []
    original = uci_protocol.fit_method
    monkeypatch.setattr(
        uci_protocol,
        "fit_method",
        lambda method, split, *a, **k: calls.append((method, split.warm_up)) or original(method, split, *a, **k),
    )
    result = regression.run(
        uci_cfg("uci.methods=[closed_form_diagonal,plain_mlp]", "trainer.epochs=4", "resume=true"), tmp_path
    )
    assert calls == [("plain_mlp", True), ("plain_mlp", False)]  # the untimed warm-up, then the missing fit
    assert len(pd.read_csv(tmp_path / "uci_splits.csv")) == 4
    assert math.isfinite(result["metrics"]["uci/plain_mlp/test_ll_mean"])


def _csv(path, text):
    path.write_text(text)
    return str(path)


def _never_fit(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("training started before the data was checked")

    monkeypatch.setattr(uci_protocol, "fit_method", fail)


@pytest.mark.parametrize(
    "text, target, message",
    [
        ("a,b,y\n" + "".join(f"{i},{i % 3},{i * 2}\n" for i in range(20)), "strength", "no column named `strength`"),
        ("a,b,y\n" + "".join(f"{i},{i % 3},5\n" for i in range(20)), "y", "target column `y` is constant"),
        ("a,b,y\n" + "".join(f"{i},{i % 3},{i}\n" for i in range(6)), "y", "needs at least 10"),
        (
            "a,b,y\n1,2,3\n4,oops,6\n" + "".join(f"{i},1,{i}\n" for i in range(20)),
            "y",
            "column `b`, row 2: 'oops' is not a number",
        ),
    ],
)
def test_bad_csv_is_named_before_any_training(tmp_path, monkeypatch, text, target, message, uci_cfg):
    _never_fit(monkeypatch)
    path = _csv(tmp_path / "table.csv", text)
    cfg = uci_cfg("data=csv", f"data.path={path}", f"data.target={target}")
    with pytest.raises(DataError, match=message):
        regression.run(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "uci_progress.json").exists()


def test_more_splits_than_rows_allow(tmp_path, monkeypatch, uci_cfg):
    _never_fit(monkeypatch)
    path = _csv(tmp_path / "t.csv", "a,y\n" + "".join(f"{i},{i * i}\n" for i in range(12)))
    with pytest.raises(DataError, match="uci.n_splits=20 needs at least 20"):
        regression.run(uci_cfg("data=csv", f"data.path={path}", "data.target=y", "uci.n_splits=20"), tmp_path / "run")


@pytest.mark.parametrize(
    "override, message",
    [
        ("uci.methods=[closed_form_diagonal,stan]", "unknown: \\['stan'\\]"),
        ("uci.methods=[]", "non-empty"),
        ("data.test_fraction=1.5", "data.test_fraction=1.5"),
        ("uci.n_splits=0", "uci.n_splits=0"),
        ("trainer.batch_size=1000", "trainer.batch_size=1000 exceeds the 162 rows"),
        ("model.hidden_sizes=[]", "model.hidden_sizes"),
        ("uci.validation_fraction=0.7", "uci.validation_fraction=0.7"),
        ("model.prior=flat", "model.prior='flat'"),
        ("uci.patience=0", "uci.patience"),
        ("uci.rtol=-1", "uci.rtol"),
        ("model.hidden_sizes=[8,8]", "one hidden layer"),
    ],
)
def test_bad_config_is_rejected_before_work(tmp_path, monkeypatch, override, message, uci_cfg):
    _never_fit(monkeypatch)
    with pytest.raises(ConfigError, match=message):
        regression.run(uci_cfg(override), tmp_path)


@pytest.mark.slow
def test_deterministic_and_heteroscedastic_methods_run_and_predict_sensibly(tmp_path, uci_cfg):
    """Beyond the paper: two hidden layers with propagated moments, and a learned log-variance
    output. On the synthetic data (noise N(0, 0.3^2)) each gets near the noise floor, and the
    heteroscedastic methods' learned noise is near 0.3 (standardized back to original units)."""
    methods = ["closed_form_diagonal", "heteroscedastic", "deterministic_2_hidden", "heteroscedastic_2_hidden"]
    result = regression.run(
        uci_cfg(
            f"uci.methods=[{','.join(methods)}]",
            "uci.deep_hidden_sizes=[12,12]",
            "uci.n_splits=1",
            "uci.max_iterations=400",
        ),
        tmp_path,
    )
    m = result["metrics"]
    floor = -math.log(0.3) - 0.5 * math.log(2 * math.pi) - 0.5
    for method in methods:
        assert floor - 0.6 < m[f"uci/{method}/test_ll_mean"] < floor + 0.15, (method, m[f"uci/{method}/test_ll_mean"])
    per_split = pd.read_csv(tmp_path / "uci_splits.csv")
    assert set(per_split["optimizer"]) == {"lbfgs"}  # nothing sampled: all full-batch
    for method in ("heteroscedastic", "heteroscedastic_2_hidden"):
        noise = per_split[per_split["method"] == method]["noise_std"]
        assert ((noise > 0.15) & (noise < 0.6)).all(), noise


def test_deterministic_and_heteroscedastic_methods_give_finite_mixtures(tmp_path, uci_cfg):
    """The quick version: a few L-BFGS iterations, every output finite, mixture weights summing to one."""
    cfg = uci_cfg("uci.deep_hidden_sizes=[8,8]", "uci.max_iterations=20", "uci.n_splits=1")
    table = uci_protocol.load_regression_table(cfg.data)
    train, test = make_splits(len(table.y), 1, 0.1)[0]
    data = table.split(train, test)
    for method in uci_protocol.DETERMINISTIC_METHODS:
        fitted = uci_protocol.fit_method(method, uci_protocol.Split(data, 0), cfg, torch.device("cpu"), seed=0)
        means, variances, log_weights = fitted.predict(data.x_test)
        assert torch.isfinite(means).all() and (variances > 0).all()
        torch.testing.assert_close(log_weights.exp().sum(0), torch.ones(len(data.y_test), dtype=means.dtype))
        record = uci_protocol.test_metrics(fitted.predict, data, cfg)
        assert math.isfinite(record["test_ll"]) and math.isfinite(record["rmse"]) and fitted.noise_std > 0


def test_deep_hidden_sizes_are_validated(uci_cfg):
    with pytest.raises(ConfigError, match="uci.deep_hidden_sizes"):
        uci_protocol.validate(uci_cfg("uci.deep_hidden_sizes=[50]"))
