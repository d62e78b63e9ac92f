"""torchrun data parallelism (runtime/distributed.py through cli.run_pipeline): 2 gloo processes on
CPU train exactly as 1 process on the same global batch."""

import pandas as pd
import pytest
import torch

from cfbnn_cli.cli import SUBCOMMANDS, run_pipeline
from cfbnn_cli.runtime import distributed
from cfbnn_cli.runtime.errors import ConfigError

COMMAND = {sub.config_name: sub for sub in SUBCOMMANDS}


def test_local_rows_split_a_global_batch_between_ranks(monkeypatch):
    batch = torch.arange(10)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "rank", lambda: 1)
    assert distributed.local_rows(batch).tolist() == [1, 3, 5, 7, 9]
    monkeypatch.setattr(distributed, "rank", lambda: 0)
    assert distributed.local_rows(batch).tolist() == [0, 2, 4, 6, 8]


def test_runtime_imports_no_pipeline():
    """The launcher is handed the worker command; nothing in runtime/ names a pipeline."""
    import pathlib
    import re

    import cfbnn_cli.runtime

    for path in pathlib.Path(cfbnn_cli.runtime.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert "pipelines" not in text, path.name
        # the package's lazy exports import its own modules only (relative names)
        for name in re.findall(r"import_module\(([^,)]*)", text):
            assert name.startswith(('f".', '".')), (path.name, name)


def test_the_uci_protocol_refuses_several_processes(tmp_path, uci_cfg):
    with pytest.raises(ConfigError, match="distributed.nproc=2"):
        run_pipeline(COMMAND["train_regression"], uci_cfg("distributed.nproc=2"), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["approximation"])  # deterministic: the two runs must agree to rounding
def test_two_gloo_processes_match_one_process(tmp_path, objective, imagenet_cfg):
    common = ["stage=all", f"objective={objective}", "trainer.epochs=2", "trainer.batch_size=64"]
    single = run_pipeline(COMMAND["imagenet_predict"], imagenet_cfg(*common), tmp_path / "one")
    double = run_pipeline(COMMAND["imagenet_predict"], imagenet_cfg(*common, "distributed.nproc=2"), tmp_path / "two")
    one = pd.read_csv(tmp_path / "one" / "metrics.csv")
    two = pd.read_csv(tmp_path / "two" / "metrics.csv")
    pd.testing.assert_series_equal(one["train_elbo_per_point"], two["train_elbo_per_point"], rtol=1e-4)
    pd.testing.assert_series_equal(one["val_top1"], two["val_top1"])
    a = torch.load(tmp_path / "one" / "checkpoints" / "last.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "two" / "checkpoints" / "last.pt", weights_only=True)["model"]
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)
    assert (tmp_path / "two" / "distributed" / "config.yaml").exists()  # resolved once, before the workers
    assert double["metrics"]["deterministic/top1"] == pytest.approx(single["metrics"]["deterministic/top1"], abs=0.01)
    assert (tmp_path / "two" / "prediction.csv").exists()


def test_train_regression_with_two_gloo_processes_matches_one(tmp_path, regression_cfg):
    """One hidden layer + analytic: nothing is sampled, so 2 ranks must equal 1 process.
    (The one torchrun test of the default suite, ~10 s; imagenet-predict's is marked slow.)"""
    common = ["model.hidden_sizes=[16]", "estimator=analytic", "trainer.epochs=2", "gradient_variance.num_samples=0"]
    sub = COMMAND["train_regression"]
    single = run_pipeline(sub, regression_cfg(*common), tmp_path / "one")
    double = run_pipeline(sub, regression_cfg(*common, "distributed.nproc=2"), tmp_path / "two")
    one = pd.read_csv(tmp_path / "one" / "metrics.csv")
    two = pd.read_csv(tmp_path / "two" / "metrics.csv")
    for column in ("train_elbo_per_point", "test_rmse", "test_ll_closed_form"):
        pd.testing.assert_series_equal(one[column], two[column], rtol=1e-4)
    assert double["metrics"]["final_test_rmse"] == pytest.approx(single["metrics"]["final_test_rmse"], rel=1e-4)
