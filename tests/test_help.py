"""Every command's --help names the valid values of its choice keys (kept in step with the code), and
`cfbnn report --help` is plain text."""

import subprocess
import sys

import pytest

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


def test_bash_completion_completes_two_word_commands_and_config_keys(tmp_path):
    """``eval "$(cfbnn completion bash)"``: the command words, then Hydra's own completion of
    that command's groups and keys (``-sc install=bash`` prints the same script)."""
    import shutil

    if shutil.which("bash") is None:
        pytest.skip("no bash")
    script = tmp_path / "complete.sh"
    script.write_text(
        'eval "$(' + sys.executable + ' -m cfbnn_cli.cli completion bash)"\n'
        "cfbnn() { " + sys.executable + ' -m cfbnn_cli.cli "$@"; }\n'
        'complete_line() { COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 )); COMP_LINE="$*"; '
        'COMP_POINT=${#COMP_LINE}; _cfbnn_complete; echo "${COMPREPLY[*]}"; }\n'
        "complete_line cfbnn t\n"
        "complete_line cfbnn train r\n"
        "complete_line cfbnn train regression data=c\n"
        "complete_line cfbnn vae model.latent_dim=3 trainer.pat\n"
    )
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "train" and lines[1] == "regression"
    assert "data=csv" in lines[2].split() and all(w.startswith("data=c") for w in lines[2].split())
    assert lines[3] == "trainer.patience="
    installed = subprocess.run(
        [sys.executable, "-m", "cfbnn_cli.cli", "vae", "-sc", "install=bash"], capture_output=True, text=True
    )
    assert installed.returncode == 0 and "_cfbnn_complete" in installed.stdout
