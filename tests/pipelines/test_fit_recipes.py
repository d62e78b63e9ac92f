"""The own-data fit's recipes: two or more hidden layers integrated by moment propagation (nothing
sampled, so L-BFGS sees one function) with priors N(0, 1/(H+1)); a fit that learned nothing is
reported as failed; the heteroscedastic likelihood from the fit to `cfbnn predict` and the library."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import one_line_error

from cfbnn_cli.bnn import load_model
from cfbnn_cli.cli import compose_config
from cfbnn_cli.pipelines import predict as predict_pipeline
from cfbnn_cli.pipelines import regression
from cfbnn_cli.train.fit_checks import FitFailedError


def _smooth(rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3))
    y = np.sin(2 * x[:, 0]) + 0.5 * x[:, 1] + 0.3 * rng.normal(size=rows)
    return pd.DataFrame({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "y": y})


def _cfg(path, *extra, likelihood="normal"):
    common = ["data=csv", f"data.path={path}", "data.target=y", "device=cpu", "fit.refit=false"]
    return compose_config("train_regression", [*common, f"likelihood={likelihood}", *extra])


def test_a_deep_fit_propagates_moments_converges_and_predicts_in_one_pass(tmp_path):
    _smooth(300, 0).to_csv(tmp_path / "t.csv", index=False)
    run = tmp_path / "run"
    run.mkdir()
    cfg = _cfg(tmp_path / "t.csv", "model.hidden_sizes=[16,16]", "fit.reference=false")
    metrics = regression.run(cfg, run)["metrics"]
    assert metrics["fit/converged"] == 1 and "converged" in (run / "fit.md").read_text()
    saved = load_model(run / "model.pt")
    assert saved.estimator == "deterministic"  # nothing sampled: L-BFGS minimized one function
    assert saved.network.prior_scale == pytest.approx(1 / math.sqrt(17))  # model.prior_scale=auto, H = 16
    # the noise is N(0, 0.3^2) around a smooth function: the deep fit learned it
    assert metrics["fit/test_rmse"] < 0.7 * metrics["fit/mean_rmse"]
    x = torch.randn(7, 3, dtype=torch.float64)
    one = saved.predict(x)  # the model's own estimator: no draws, so two calls agree exactly
    torch.testing.assert_close(saved.predict(x).mean, one.mean, rtol=0, atol=0)


def test_a_fit_that_learned_nothing_fails_with_the_reason_and_a_suggestion(tmp_path):
    """200x200 hidden units on 54 rows: the posterior stays at its prior (the ELBO prefers it), the
    network predicts the mean with the target's spread as its noise: failed, not "converged"."""
    _smooth(60, 1).to_csv(tmp_path / "t.csv", index=False)
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(FitFailedError) as failed:
        regression.run(_cfg(tmp_path / "t.csv", "model.hidden_sizes=[200,200]", "fit.refit=true"), run)
    message = str(failed.value)
    assert message.startswith("the fit failed: closed_form_diagonal with hidden layers [200, 200] on t:")
    assert "explain less than 5 % of the target's variance" in message and "model.hidden_sizes=[50]" in message
    assert failed.value.exit_code == 1 and "fit/test_ll" in failed.value.metrics and "fit.md" in failed.value.tables
    assert "FAILED: " in (run / "fit.md").read_text()
    assert not (run / "model.pt").exists() and not (run / "checkpoints" / "refit").exists()  # nor refit


def test_a_deep_network_worse_than_one_hidden_layer_on_the_same_rows_fails(tmp_path):
    """fit.reference: a deep fit is measured against one hidden layer of 50 on its own held-out rows;
    two layers of two units cannot follow sin(2 a), and are reported as failed beside the number."""
    _smooth(300, 0).to_csv(tmp_path / "t.csv", index=False)
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(FitFailedError, match="more than 0.1 below that of one hidden layer of 50") as failed:
        regression.run(_cfg(tmp_path / "t.csv", "model.hidden_sizes=[2,2]"), run)
    metrics = failed.value.metrics
    assert metrics["fit/reference_ll"] > metrics["fit/test_ll"] + 0.1
    assert (run / "checkpoints" / "reference" / "last.pt").is_file()  # the reference is a phase of its own


@pytest.mark.slow
def test_a_failed_fit_exits_1_and_records_its_numbers(tmp_path, cfbnn):
    _smooth(60, 1).to_csv(tmp_path / "t.csv", index=False)
    run = tmp_path / "run"
    out = cfbnn(
        "train", "regression", "data=csv", f"data.path={tmp_path / 't.csv'}", "data.target=y",
        "model.hidden_sizes=[200,200]", f"hydra.run.dir={run}", "device=cpu",
    )  # fmt: skip
    text = one_line_error(out, code=1)
    assert "cfbnn: error: the fit failed" in text and "converged" not in out.stderr.splitlines()[-1]
    record = json.loads((run / "results.json").read_text())
    assert record["status"] == "failed" and record["metrics"]["fit/test_rows"] == 6
    assert not (run / "done").exists() and "fit.md" in record["tables"]


def _noisy_in_x(rows, seed):
    """y = a + noise of s.d. 0.1 where b < 0 and 1 where b > 0: an input-dependent noise."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1.5, 1.5, size=(rows, 2))
    y = x[:, 0] + np.where(x[:, 1] > 0, 1.0, 0.1) * rng.normal(size=rows)
    return pd.DataFrame({"a": x[:, 0], "b": x[:, 1], "y": y})


def test_a_heteroscedastic_fit_predicts_its_noise_per_row_in_the_cli_and_the_library(tmp_path):
    _noisy_in_x(600, 2).to_csv(tmp_path / "t.csv", index=False)
    results = {}
    for likelihood in ("normal", "heteroscedastic"):
        run = tmp_path / likelihood
        run.mkdir()
        results[likelihood] = regression.run(_cfg(tmp_path / "t.csv", likelihood=likelihood), run)["metrics"]
    # the same held-out rows (one split, one seed): a noise that follows b scores them far better (the
    # true noise's gain is 0.8 nats per row: E log s.d. = log 0.32 against the pooled s.d.'s log 0.71)
    assert results["heteroscedastic"]["fit/test_ll"] > results["normal"]["fit/test_ll"] + 0.3
    run = tmp_path / "heteroscedastic"
    (run / "results.json").write_text("{}")
    (run / "done").write_text("")
    saved = load_model(run / "model.pt")
    assert saved.method == "heteroscedastic" and saved.network.output_dim == 2
    rows = np.array([[0.0, -1.0], [0.0, 1.0]])
    quiet, loud = saved.predict(rows).noise.sqrt()
    assert quiet < 0.4 < 0.8 < loud  # s.d. 0.1 and 1 in the data
    pd.DataFrame({"a": rows[:, 0], "b": rows[:, 1]}).to_csv(tmp_path / "new.csv", index=False)
    written = pd.read_csv(predict_pipeline.predict_run(run, tmp_path / "new.csv", out=tmp_path / "p.csv"))
    np.testing.assert_allclose(written["noise"], saved.predict(rows).noise, rtol=1e-5)
    width = written["upper_90"] - written["lower_90"]
    assert width[1] > 2.5 * width[0]  # each row's interval follows its own noise


def test_a_heteroscedastic_fits_noise_is_the_median_rows_not_swamped_by_a_few_far_out_rows():
    """fit.md's noise s.d. (and the learned-nothing check on it) of a heteroscedastic network: a few
    rows far out in the inputs, where the log-variance output extrapolates to hundreds, move it by
    less than the spread of the ordinary rows' noise (their mean would multiply it by > 100)."""
    from cfbnn_cli.bnn.estimators import ClosedForm
    from cfbnn_cli.bnn.likelihoods import HeteroscedasticNormalLikelihood
    from cfbnn_cli.bnn.network import BayesianNetwork
    from cfbnn_cli.pipelines.regression.uci_methods import heteroscedastic_noise_std

    generator = torch.Generator().manual_seed(0)
    network = BayesianNetwork(
        3, [20], 2, likelihood=HeteroscedasticNormalLikelihood(), init_scale=0.1, generator=generator
    )
    with torch.no_grad():  # the log-variance output rises with every hidden unit: it grows far out
        network.layers[-1].loc[1, :-1].abs_()
    x = torch.randn(400, 3, generator=generator)
    with torch.no_grad():
        l_out = network.output_moments(torch.cat([x, -x]) * 300, estimator=ClosedForm(), noise=())[0][..., 1]
    far = (torch.cat([x, -x]) * 300)[l_out.argsort(descending=True)[:3]]  # the 3 rows of the largest noise
    both = torch.cat([x, far])
    with torch.no_grad():
        l = network.output_moments(both, estimator=ClosedForm(), noise=())[0][..., 1]
    ordinary = l[:400].mul(0.5).exp()
    assert float(l[400:].min()) > float(l[:400].max()) + 20  # the far rows' noise is e^10 times larger
    assert float(l.exp().mean().sqrt()) > 100 * float(ordinary.median())  # what a root mean square reads
    value = heteroscedastic_noise_std(network, both, ClosedForm())
    low, high = torch.quantile(ordinary, torch.tensor([0.4, 0.6], dtype=ordinary.dtype))
    assert float(low) <= value <= float(high)
