"""runtime.matmul_precision: TF32 (``high``) or full float32 (``highest``, the default) matrix
products, set at the start of every run, put back when it ends, validated before any work."""

import json
import logging
import os
import sys

import pytest
import torch
from conftest import TRUST_REGRESSION, one_line_error
from omegaconf import OmegaConf

from cfbnn_cli import cli
from cfbnn_cli.runtime.checks import validate_common
from cfbnn_cli.runtime.errors import ConfigError
from cfbnn_cli.runtime.rundir import config_fingerprint


@pytest.fixture
def precision_kept():
    """The process's matmul precision as it was before the test, whatever the test does."""
    before = torch.get_float32_matmul_precision()
    yield before
    torch.set_float32_matmul_precision(before)


@pytest.fixture
def in_process(monkeypatch):
    """``run(*overrides) -> (exit code, the precision the pipeline saw)``: ``cfbnn train regression``
    through the CLI's Hydra task in this process, the pipeline itself replaced by a probe."""
    seen = []

    def probe(sub, cfg, run_dir, values=None):
        seen.append(torch.get_float32_matmul_precision())
        return {"metrics": {"probe": 1.0}}

    monkeypatch.setattr(cli, "run_pipeline", probe)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # Hydra's argv, set by _run_hydra
    environment, handlers = dict(os.environ), list(logging.getLogger().handlers)
    sub = cli.find_subcommand(["train", "regression"])[0]

    def run(*overrides):
        seen.clear()
        code = cli._run_hydra(sub, cli.config_dir(), list(overrides))
        return code, (seen[0] if seen else None)

    try:
        yield run
    finally:
        os.environ.clear()
        os.environ.update(environment)
        root = logging.getLogger()
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
            handler.close()


def test_the_key_reaches_torch_at_the_run_start_and_is_put_back_after(tmp_path, in_process, precision_kept):
    torch.set_float32_matmul_precision("medium")  # what the process had before the run
    code, seen = in_process(f"hydra.run.dir={tmp_path / 'tf32'}", "device=cpu", "runtime.matmul_precision=high")
    assert code in (0, None) and seen == "high"
    assert torch.get_float32_matmul_precision() == "medium"  # as it was before the run
    # a second run in the same process, at the default: full float32, not the first run's TF32
    code, seen = in_process(f"hydra.run.dir={tmp_path / 'default'}", "device=cpu")
    assert code in (0, None) and seen == "highest"
    assert torch.get_float32_matmul_precision() == "medium"
    recorded = json.loads((tmp_path / "tf32" / "results.json").read_text())
    assert recorded["config"]["runtime"]["matmul_precision"] == "high"
    assert recorded["environment"]["matmul_precision"] == "high"  # in effect while results.json was written


@pytest.mark.slow  # its in-process twin runs by default: test_the_key_reaches_torch_at_the_run_start_and_is_put_back_after
def test_a_real_table1_run_records_the_precision_in_effect(tmp_path, cfbnn):
    run_dir = tmp_path / "run"
    out = cfbnn(
        "train", "regression", f"hydra.run.dir={run_dir}", *TRUST_REGRESSION, "trainer.epochs=1",
        "runtime.threads=1", "runtime.matmul_precision=high",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads((run_dir / "results.json").read_text())
    assert record["status"] == "complete" and record["environment"]["matmul_precision"] == "high"


def test_a_bad_value_is_one_line_exit_2_and_nothing_written(tmp_path, cfbnn):
    out = cfbnn("train", "regression", f"hydra.run.dir={tmp_path / 'new' / 'run'}", "runtime.matmul_precision=fast")
    one_line_error(out)  # exit 2, no traceback
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("cfbnn: error: runtime.matmul_precision='fast' is not one of highest, high, medium")
    assert not list(tmp_path.iterdir())  # no run dir, not even the folder above it


@pytest.mark.parametrize("value", ["fast", "HIGH", "tf32", 1, True, None])
def test_validation_names_the_key_the_value_and_the_choices(value):
    cfg = OmegaConf.create(
        {
            "seed": 0,
            "device": "cpu",
            "resume": False,
            "runtime": {"threads": "auto", "flush_denormals": True, "matmul_precision": value},
        }
    )
    with pytest.raises(ConfigError, match=r"runtime\.matmul_precision=.* is not one of highest, high, medium"):
        validate_common(cfg)
    for good in ("highest", "high", "medium"):
        cfg.runtime.matmul_precision = good
        validate_common(cfg)


def test_the_default_keeps_the_fingerprint_of_runs_made_before_the_key():
    """A run dir made before the key existed (full float32 products) still resumes at the
    default; a run at TF32 is a different configuration."""
    before = {"seed": 0, "runtime": {"threads": "auto", "flush_denormals": True}}
    at = lambda precision: {"seed": 0, "runtime": {**before["runtime"], "matmul_precision": precision}}  # noqa: E731
    assert config_fingerprint(at("highest")) == config_fingerprint(before)
    assert config_fingerprint(at("high")) != config_fingerprint(before)
