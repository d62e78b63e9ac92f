"""pipelines/regression (Table 1): training, gradient variance, outputs, resume, errors."""

import json

import numpy as np
import pandas as pd
import pytest
import torch

from cfbnn_cli.bnn.network import BayesianNetwork
from cfbnn_cli.pipelines import regression
from cfbnn_cli.runtime.errors import ConfigError
from cfbnn_cli.runtime.numerics import NonFiniteLossError


def _formatted_table(path) -> pd.DataFrame:
    """A Markdown table as written by report.tables (first column the index)."""
    lines = [line for line in path.read_text().splitlines() if line.startswith("|")]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    header, body = cells[0], cells[2:]
    return pd.DataFrame([row[1:] for row in body], index=[row[0] for row in body], columns=header[1:])


@pytest.mark.parametrize("estimator", ["analytic", "sampling", "deterministic", "deterministic_full"])
def test_trains_lowers_loss_and_writes_outputs(tmp_path, estimator, regression_cfg):
    result = regression.run(regression_cfg(f"estimator={estimator}"), tmp_path)
    history = pd.read_csv(tmp_path / "metrics.csv")
    assert list(history["epoch"]) == [1, 2, 3]
    assert history["train_elbo_per_point"].iloc[-1] > history["train_elbo_per_point"].iloc[0]
    assert np.isfinite(history[["test_rmse", "test_ll_closed_form", "test_ll_monte_carlo"]].values).all()
    table = _formatted_table(tmp_path / "gradient_variance.md")
    assert (
        list(table.index) == ["Analytic", "Sampling", "Deterministic (nothing sampled)", "Ratio sampling / analytic"]
        and table.shape[1] == 6
    )
    assert "/" in table.iloc[0, 0]
    # the third row: nothing is sampled at any depth, so no layer's gradient varies
    assert set(table.loc["Deterministic (nothing sampled)"]) == {"0 / 0"}
    # the CSV holds the numbers themselves, one per column, as results.json has them
    data = pd.read_csv(tmp_path / "gradient_variance.csv")
    assert list(data.columns) == [
        "epoch",
        "layer",
        "parameter",
        "analytic",
        "sampling",
        "deterministic",
        "ratio_sampling_over_analytic",
        "converged",
    ]
    assert len(data) == 2 * 3 * 2  # epochs 0 and 3, three layers, two parameters
    final = data[(data.epoch == 3) & (data.layer == "final") & (data.parameter == "weight_means")].iloc[0]
    assert final["sampling"] == result["metrics"]["gradvar/sampling/epoch3/final/mean"]
    assert (data.deterministic == 0).all()
    assert all(v == 0.0 for k, v in result["metrics"].items() if k.startswith("gradvar/deterministic/"))
    # calibration of the final predictive: coverage of central intervals, nested and in [0, 1], and its figure
    coverage = [result["metrics"][f"calibration/coverage_{level}"] for level in (50, 80, 90, 95)]
    assert all(0.0 <= c <= 1.0 for c in coverage) and coverage == sorted(coverage)
    assert result["figures"]["calibration"] == "calibration.png" and (tmp_path / "calibration.png").is_file()
    # the ratio row is the two estimators' ratio, to two significant digits
    m = result["metrics"]
    for epoch, heading in ((0, "Upon initialization (epoch 0)"), (3, "End of training (epoch 3, not converged)")):
        means, scales = table.loc["Ratio sampling / analytic", f"{heading}: Final Layer"].split(" / ")
        ratio = m[f"gradvar/sampling/epoch{epoch}/final/mean"] / m[f"gradvar/analytic/epoch{epoch}/final/mean"]
        assert float(means) == pytest.approx(ratio, rel=0.05)
        assert float(scales) == pytest.approx(
            m[f"gradvar_ratio_sampling_over_analytic/epoch{epoch}/final/scale"], rel=0.05
        )
    assert (tmp_path / "gradient_variance.md").read_text().count("|") > 10
    assert "\\toprule" in (tmp_path / "gradient_variance.tex").read_text()
    for figure in ("gradient_variance.png", "training.png"):
        assert (tmp_path / figure).read_bytes()[:4] == b"\x89PNG"
    assert result["metrics"]["final_test_rmse"] == pytest.approx(history["test_rmse"].iloc[-1])
    assert (tmp_path / "checkpoints" / "last.pt").exists()


@pytest.mark.parametrize("estimator", ["analytic", "deterministic"])
def test_heteroscedastic_likelihood_trains_a_second_output_and_its_two_predictives_agree(
    tmp_path, estimator, regression_cfg
):
    """likelihood=heteroscedastic: the network gains the log-variance output; the closed-form
    predictive (Gauss-Hermite over the log-variance) and Monte Carlo of every layer score the
    same test points alike; the learned noise is near the teacher's (0.5 on this data)."""
    result = regression.run(
        regression_cfg("likelihood=heteroscedastic", f"estimator={estimator}", "trainer.epochs=6"), tmp_path
    )
    history = pd.read_csv(tmp_path / "metrics.csv")
    assert history["train_elbo_per_point"].iloc[-1] > history["train_elbo_per_point"].iloc[0]
    last = history.iloc[-1]
    # a few Monte Carlo draws of a net with little weight uncertainty: two estimates of one density
    assert abs(last["test_ll_closed_form"] - last["test_ll_monte_carlo"]) < 0.02
    assert 0.2 < last["noise_std"] < 1.5
    assert "network 8-16-16-2 (outputs: mean and log noise variance)" in (tmp_path / "gradient_variance.md").read_text()
    state = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    output_locs = [v for k, v in state["model"].items() if k.endswith("loc")]
    assert output_locs[-1].shape[0] == 2
    assert result["metrics"]["gradvar/analytic/epoch0/final/mean"] > 0


def test_unknown_likelihood_is_refused_before_work(tmp_path, regression_cfg):
    with pytest.raises(ConfigError, match=r"likelihood='poisson' is not one of \['normal', 'heteroscedastic'\]"):
        regression.run(regression_cfg("likelihood=poisson"), tmp_path)
    assert not (tmp_path / "metrics.csv").exists()


def test_convergence_is_judged_on_the_recent_rate_of_the_elbo():
    from cfbnn_cli.pipelines.regression.gradient_variance_study import convergence_note, epoch_heading

    linear = [{"train_elbo_per_point": -60.0 + 0.13 * e} for e in range(10)]  # still rising at its average rate
    flat = [{"train_elbo_per_point": -60.0 + 10 * (1 - 0.5**e)} for e in range(30)]  # geometric: flat at the end
    assert not convergence_note(linear)["converged"] and "not converged" in convergence_note(linear)["text"]
    assert convergence_note(flat)["converged"] and convergence_note(flat)["text"].startswith("converged")
    assert not convergence_note(linear[:2])["converged"]  # too few epochs to tell
    assert epoch_heading(0, 10, False) == "Upon initialization (epoch 0)"
    assert epoch_heading(10, 10, False) == "End of training (epoch 10, not converged)"
    assert epoch_heading(50, 50, True) == "End of training (epoch 50, converged)"
    assert epoch_heading(5, 10, None) == "Epoch 5 of 10"


def test_analytic_gradient_variance_is_lower_on_the_final_layer(tmp_path, regression_cfg):
    result = regression.run(regression_cfg("trainer.epochs=1", "gradient_variance.epochs=[0]"), tmp_path)
    m = result["metrics"]
    for kind in ("mean", "scale"):
        assert m[f"gradvar/analytic/epoch0/final/{kind}"] < m[f"gradvar/sampling/epoch0/final/{kind}"]
        assert m[f"gradvar_ratio_sampling_over_analytic/epoch0/final/{kind}"] > 1.5


def test_resume_continues_from_checkpoint_bit_for_bit(tmp_path, interrupt_on_call, regression_cfg):
    """A run stopped in epoch 3 and resumed with the same config ends exactly as an
    uninterrupted run (from last.pt of epoch 1: it is written after the first epoch, then by
    time, so epochs 2-3 are redone); resuming with another trainer.epochs is refused, naming
    the key."""
    from cfbnn_cli.pipelines.regression import gradient_variance_study as study
    from cfbnn_cli.runtime.rundir import claim_run_dir

    cfg = regression_cfg("trainer.epochs=4", "gradient_variance.num_samples=0")
    regression.run(cfg, tmp_path / "whole")
    reference = pd.read_csv(tmp_path / "whole" / "metrics.csv")

    claim_run_dir(cfg, tmp_path / "stopped")  # as the CLI does before running
    restore = interrupt_on_call(study, "evaluate", 3)  # the test evaluation, once per epoch
    with pytest.raises(KeyboardInterrupt):
        regression.run(cfg, tmp_path / "stopped")
    restore()
    assert torch.load(tmp_path / "stopped" / "checkpoints" / "last.pt", weights_only=True)["epoch"] == 1
    resumed = regression_cfg("trainer.epochs=4", "gradient_variance.num_samples=0", "resume=true")
    claim_run_dir(resumed, tmp_path / "stopped")
    regression.run(resumed, tmp_path / "stopped")
    after = pd.read_csv(tmp_path / "stopped" / "metrics.csv")
    pd.testing.assert_frame_equal(after.drop(columns="epoch_seconds"), reference.drop(columns="epoch_seconds"))

    longer = regression_cfg("trainer.epochs=6", "gradient_variance.num_samples=0", "resume=true")
    with pytest.raises(ConfigError, match=r"trainer\.epochs: 4 -> 6"):
        claim_run_dir(longer, tmp_path / "stopped")


def test_nan_loss_stops_with_epoch_and_step_and_keeps_checkpoint(tmp_path, monkeypatch, regression_cfg):
    cfg = regression_cfg("gradient_variance.num_samples=0")
    original = BayesianNetwork.elbo  # the training step's ELBO (one process)
    calls = {"n": 0}

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        value = original(self, *args, **kwargs)
        return value * float("nan") if calls["n"] > 5 else value  # 4 steps per epoch: fails in epoch 2

    monkeypatch.setattr(BayesianNetwork, "elbo", flaky)
    with pytest.raises(NonFiniteLossError, match="epoch 2, step 1"):
        regression.run(cfg, tmp_path)
    assert torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["epoch"] == 1


@pytest.mark.parametrize(
    "override,key",
    [
        ("estimator=gibbs", "estimator"),
        ("trainer.batch_size=5000", "trainer.batch_size"),
        ("model.hidden_sizes=[16,0]", "model.hidden_sizes"),
        ("gradient_variance.epochs=[0,9]", "gradient_variance.epochs"),
    ],
)
def test_invalid_config_fails_before_work(tmp_path, override, key, regression_cfg):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        regression.run(regression_cfg(override), tmp_path)
    assert not (tmp_path / "metrics.csv").exists()


def test_cli_end_to_end_small(tmp_path, cfbnn, tiny_overrides):
    run_dir = tmp_path / "run"
    out = cfbnn("train", "regression", f"hydra.run.dir={run_dir}", *tiny_overrides["train_regression"])
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads((run_dir / "results.json").read_text())
    assert record["pipeline"] == "train_regression" and record["status"] == "complete"
    assert record["config"]["trainer"]["epochs"] == 3
    assert "gradient_variance.csv" in record["tables"] and record["figures"]["training"] == "training.png"
    assert (run_dir / "done").exists()


@pytest.mark.slow  # a CLI start of its own (5 s); by default the message is
# tests/data/test_regression_data.py::test_missing_msd_names_the_script and a data error's one line and
# exit 2 from the CLI tests/test_trust_inputs.py::test_each_bad_input_is_one_line_on_stderr_and_exit_2
def test_cli_names_the_fetch_script_for_missing_msd_data(tmp_path, cfbnn):
    missing = cfbnn(
        "train", "regression", f"hydra.run.dir={tmp_path / 'r2'}", "data=year_prediction_msd",
        f"data.path={tmp_path}/none.txt",
    )  # fmt: skip
    assert missing.returncode == 2 and "fetch_year_prediction_msd.py" in missing.stdout + missing.stderr


@pytest.mark.slow
def test_readme_main_command(tmp_path):
    """The README's main job exactly as written (default config), end to end."""
    import subprocess

    out = subprocess.run(
        ["cfbnn", "train", "regression", f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=1200
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads((tmp_path / "results.json").read_text())["status"] == "complete"


def test_batch_sizes_larger_than_a_small_data_set_are_named_together():
    """A file of one's own with fewer rows than the defaults' 500: both batch sizes in one message,
    with values that fit (they came one run at a time)."""
    from types import SimpleNamespace

    from cfbnn_cli.cli import compose_config
    from cfbnn_cli.pipelines.regression.gradient_variance_study import _check_against_data
    from cfbnn_cli.runtime.errors import ConfigError

    cfg = compose_config("train_regression", [])
    small = SimpleNamespace(num_train=180, name="csv")
    with pytest.raises(ConfigError) as error:
        _check_against_data(cfg, small)
    assert str(error.value) == (
        "trainer.batch_size=500 and gradient_variance.batch_size=500 are larger than the 180 training rows of "
        "data=csv; lower them, e.g. trainer.batch_size=180 gradient_variance.batch_size=180"
    )
    _check_against_data(cfg, SimpleNamespace(num_train=500, name="csv"))  # equal fits
