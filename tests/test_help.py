"""Every command's --help names the valid values of its choice keys (kept in step with the code), and
`cfbnn report --help` is plain text."""

import subprocess
import sys

from cfbnn_cli.bnn.network import ESTIMATORS
from cfbnn_cli.pipelines.regression.gradient_variance_study import LIKELIHOODS
from cfbnn_cli.pipelines.regression.uci_methods import METHODS


def _help(*words):
    out = subprocess.run([sys.executable, "-m", "cfbnn_cli.cli", *words, "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_train_regression_help_lists_every_estimator_likelihood_and_uci_method():
    text = _help("train", "regression").split("The composed config:")[0]
    for value in [*ESTIMATORS, *LIKELIHOODS, *METHODS]:
        assert value in text, value


def test_report_help_is_plain_text():
    text = _help("report")
    assert "``" not in text and ":func:" not in text and "Aggregate every results.json under PATH" in text
