"""torchrun data parallelism: 2 gloo processes on CPU train exactly as 1 process on the same global batch."""

import pandas as pd
import pytest
import torch
from test_imagenet import cfg_for

from cfbnn_cli.pipelines import imagenet
from cfbnn_cli.runtime import distributed


def test_local_rows_split_a_global_batch_between_ranks(monkeypatch):
    batch = torch.arange(10)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "rank", lambda: 1)
    assert distributed.local_rows(batch).tolist() == [1, 3, 5, 7, 9]
    monkeypatch.setattr(distributed, "rank", lambda: 0)
    assert distributed.local_rows(batch).tolist() == [0, 2, 4, 6, 8]


@pytest.mark.parametrize("objective", ["analytic_approx"])  # deterministic: the two runs must agree to rounding
def test_two_gloo_processes_match_one_process(tmp_path, objective):
    common = ["stage=all", f"objective={objective}", "trainer.epochs=2", "trainer.batch_size=64"]
    single = imagenet.run(cfg_for(tmp_path, *common), tmp_path / "one")
    double = imagenet.run(cfg_for(tmp_path, *common, "distributed.nproc=2"), tmp_path / "two")
    one = pd.read_csv(tmp_path / "one" / "metrics.csv")
    two = pd.read_csv(tmp_path / "two" / "metrics.csv")
    pd.testing.assert_series_equal(one["train_elbo_per_point"], two["train_elbo_per_point"], rtol=1e-4)
    pd.testing.assert_series_equal(one["val_top1"], two["val_top1"])
    a = torch.load(tmp_path / "one" / "checkpoints" / "last.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "two" / "checkpoints" / "last.pt", weights_only=False)["model"]
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)
    assert (tmp_path / "two" / "distributed" / "config.yaml").exists()  # resolved once, before the workers
    assert double["metrics"]["deterministic/top1"] == pytest.approx(single["metrics"]["deterministic/top1"], abs=0.01)
    assert (tmp_path / "two" / "prediction.csv").exists()


def test_train_regression_with_two_gloo_processes_matches_one(tmp_path):
    """One hidden layer + analytic: nothing is sampled, so 2 ranks must equal 1 process."""
    from test_regression_pipeline import tiny_cfg

    from cfbnn_cli.pipelines import regression

    common = ["model.hidden_sizes=[16]", "estimator=analytic", "trainer.epochs=2", "gradient_variance.num_samples=0"]
    single = regression.run(tiny_cfg(*common), tmp_path / "one")
    double = regression.run(tiny_cfg(*common, "distributed.nproc=2"), tmp_path / "two")
    one = pd.read_csv(tmp_path / "one" / "metrics.csv")
    two = pd.read_csv(tmp_path / "two" / "metrics.csv")
    for column in ("train_elbo_per_point", "test_rmse", "test_ll_closed_form"):
        pd.testing.assert_series_equal(one[column], two[column], rtol=1e-4)
    assert double["metrics"]["final_test_rmse"] == pytest.approx(single["metrics"]["final_test_rmse"], rel=1e-4)
