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
from cfbnn_cli.pipelines.regression.uci_protocol import make_splits, minibatch_schedule, original_units
from cfbnn_cli.runtime.errors import ConfigError, DataError


def test_preset_composes_the_protocol():
    cfg = compose_config("train_regression", ["experiment=uci"])
    assert cfg.protocol == "uci" and cfg.data.name == "diabetes"
    assert list(cfg.uci.methods) == ["closed_form_diagonal", "closed_form_full", "local_reparameterization", "pyro", "plain_mlp"]
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


def test_minibatch_schedule_covers_each_epoch_without_repeats():
    schedule = minibatch_schedule(100, 32, 7, seed=3)
    assert schedule.shape == (7, 32)
    epoch = schedule[:3].flatten()  # 3 batches of 32 per epoch of 100 rows
    assert len(set(epoch.tolist())) == 96
    torch.testing.assert_close(schedule, minibatch_schedule(100, 32, 7, seed=3))


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
    return run_dir, regression.run(uci_cfg("uci.methods=[closed_form_diagonal,closed_form_full,local_reparameterization,pyro,plain_mlp]"), run_dir)


def test_every_method_is_finite_and_outputs_exist(small_run):
    run_dir, result = small_run
    m = result["metrics"]
    for method in uci_protocol.METHODS:
        if method == "closed_form_lowrank":
            continue
        for key in ("test_ll_mean", "rmse_mean", "train_seconds_per_split", "predict_seconds_per_1000"):
            assert math.isfinite(m[f"uci/{method}/{key}"]), (method, key)
    table = pd.read_csv(run_dir / "uci.csv", index_col=0)
    assert len(table) == 5 and "±" in table["Test LL"].iloc[0]
    assert "\\toprule" in (run_dir / "uci.tex").read_text()
    assert (run_dir / "uci.md").read_text().count("|") > 20
    assert (run_dir / "uci.png").read_bytes()[:4] == b"\x89PNG"
    per_split = pd.read_csv(run_dir / "uci_splits.csv")
    assert len(per_split) == 2 * 5 and set(per_split["split"]) == {0, 1}
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


def test_resume_runs_only_what_is_missing(tmp_path, monkeypatch, uci_cfg):
    cfg = uci_cfg("uci.methods=[closed_form_diagonal,plain_mlp]", "trainer.epochs=4")
    regression.run(cfg, tmp_path)
    progress = json.loads((tmp_path / "uci_progress.json").read_text())
    assert len(progress["records"]) == 4
    progress["records"] = progress["records"][:3]  # as if killed during the last job
    (tmp_path / "uci_progress.json").write_text(json.dumps(progress))
    calls = []
    original = uci_protocol.fit_method
    monkeypatch.setattr(uci_protocol, "fit_method", lambda method, *a, **k: calls.append(method) or original(method, *a, **k))
    result = regression.run(uci_cfg("uci.methods=[closed_form_diagonal,plain_mlp]", "trainer.epochs=4", "resume=true"), tmp_path)
    assert calls == ["plain_mlp"]
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
        ("a,b,y\n1,2,3\n4,oops,6\n" + "".join(f"{i},1,{i}\n" for i in range(20)), "y", "line 3: non-numeric"),
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
        ("trainer.batch_size=1000", "exceeds the 180 training rows"),
        ("model.hidden_sizes=[]", "model.hidden_sizes"),
    ],
)
def test_bad_config_is_rejected_before_work(tmp_path, monkeypatch, override, message, uci_cfg):
    _never_fit(monkeypatch)
    with pytest.raises(ConfigError, match=message):
        regression.run(uci_cfg(override), tmp_path)
