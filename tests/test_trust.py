"""Trust: nothing runs from a checkpoint, nothing is written outside its place, a resumed
run is the run asked for, bad files give one-line errors. Each test reproduces the
attack or fault first (see issue "Trust"), then checks the named error or the correct result."""

import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import TRUST_REGRESSION as REGRESSION
from conftest import finish_all, one_line_error
from omegaconf import OmegaConf, open_dict

from cfbnn_cli.cli import compose_config
from cfbnn_cli.data.regression import load_regression_table, tabular_file
from cfbnn_cli.pipelines import regression
from cfbnn_cli.pipelines.regression import gradient_variance_study
from cfbnn_cli.report.aggregate import report
from cfbnn_cli.runtime.checkpoints import load_checkpoint
from cfbnn_cli.runtime.checks import validate_common
from cfbnn_cli.runtime.errors import CheckpointError, ConfigError, DataError
from cfbnn_cli.runtime.io import atomic_write_json
from cfbnn_cli.runtime.rundir import RunDirLock, claim_run_dir, config_fingerprint

UCI = [
    "experiment=uci",
    "data=synthetic",
    "data.input_dim=3",
    "data.n_train=90",
    "data.n_test=30",
    "uci.n_splits=2",
    "trainer.epochs=5",
    "model.hidden_sizes=[8]",
    "uci.predictive_samples=16",
    "uci.methods=[closed_form_diagonal,plain_mlp]",
    "uci.validation_samples=8",
    "uci.max_iterations=500",
    "uci.timing_repeats=1",
    "trainer.batch_size=16",
    "device=cpu",
]


def cfbnn(*args, timeout=300):
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    return subprocess.run(
        [sys.executable, "-m", "cfbnn_cli.cli", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def _start(*args):
    """``cfbnn(*args)`` started, not waited for (``finish_all`` collects it)."""
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    command = [sys.executable, "-m", "cfbnn_cli.cli", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _config(*overrides, base=REGRESSION):
    return compose_config("train_regression", list(base) + list(overrides))


class RunsCode:
    """Unpickling this runs ``touch <marker>``: the classic malicious checkpoint."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A small finished `train regression` run (the CLI, so it owns a fingerprint record)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    out = cfbnn("train", "regression", f"hydra.run.dir={run}", *REGRESSION)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def _copy_run(source, target):
    import shutil

    shutil.copytree(source, target)
    return target


# ----------------------------------------------------------------------------- 1. no code from a checkpoint


def _plant_temporary_files(run):
    """The temporary files a killed write leaves in ``run`` (the names atomic_write_bytes gives
    them), and a user's own and another run's, which are not the CLI's."""
    (run / ".results.json.cfbnn-k1ll3d.tmp").write_text("half")
    (run / "checkpoints" / ".last.pt.cfbnn-abc123.tmp").write_bytes(b"half")
    (run / ".notes.tmp").write_text("mine")
    (run / "nested_run").mkdir()
    (run / "nested_run" / ".results.json.cfbnn-other.tmp").write_text("another run's")


@pytest.fixture(scope="module")
def resumed_runs(finished_run, tmp_path_factory):
    """The three CLI runs into copies of the finished run, started at once: one whose last.pt is a
    crafted pickle (``crafted``, with ``done`` removed as if killed, so resume loads it), one resumed
    with another config (``other``), one with the same config (``same``). ``{name: (run dir,
    CompletedProcess)}``; the crafted one also gives its marker file."""
    folder = tmp_path_factory.mktemp("resumed")
    crafted, run, twin = (_copy_run(finished_run, folder / name) for name in ("crafted", "run", "twin"))
    (crafted / "done").unlink()  # as if killed: resume will load the checkpoint
    _plant_temporary_files(twin)  # (test_temporary_files_of_a_killed_write_are_removed_on_the_next_run)
    marker = folder / "PWNED"
    torch.save({"model": RunsCode(marker)}, crafted / "checkpoints" / "last.pt")
    processes = {
        "crafted": _start("train", "regression", f"hydra.run.dir={crafted}", "resume=true", *REGRESSION),
        "other": _start(
            "train", "regression", f"hydra.run.dir={run}", "resume=true", *REGRESSION, "seed=1", "trainer.lr=0.5"
        ),
        "same": _start("train", "regression", f"hydra.run.dir={twin}", "resume=true", "device=auto", *REGRESSION),
    }
    outs = finish_all(processes)
    return {"crafted": (crafted, outs["crafted"], marker), "other": (run, outs["other"]), "same": (twin, outs["same"])}


def test_a_crafted_checkpoint_is_refused_and_runs_nothing(resumed_runs):
    run, out, marker = resumed_runs["crafted"]
    text = one_line_error(out)  # refused, naming the file and the way out...
    assert not marker.exists()
    assert "cannot load the training checkpoint" in text and str(run / "checkpoints" / "last.pt") in text
    assert "start a fresh run dir" in text
    torch.load(run / "checkpoints" / "last.pt", weights_only=False)  # ...where the attack works if pickle is trusted
    assert marker.exists()


@pytest.mark.slow  # the crafted-checkpoint refusal of the training commands (above) runs by default
def test_a_crafted_evaluation_checkpoint_for_imagenet_predict_runs_nothing(tmp_path):
    marker = tmp_path / "PWNED"
    evil = tmp_path / "best.pt"
    torch.save({"model": RunsCode(marker)}, evil)
    out = cfbnn(
        "imagenet-predict",
        f"hydra.run.dir={tmp_path / 'run'}",
        "stage=evaluate",
        f"evaluation.checkpoint={evil}",
        f"features.cache_dir={tmp_path / 'cache'}",
        "model.hidden_sizes=[16,16]",
        "device=cpu",
    )
    text = one_line_error(out)
    assert not marker.exists() and "cannot load the trained head" in text


def test_no_checkpoint_is_loaded_with_pickle_anywhere_in_the_package():
    import cfbnn_cli

    root = os.path.dirname(cfbnn_cli.__file__)
    offenders = []
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(".py"):
                text = open(os.path.join(folder, name)).read()
                if re.search(r"weights_only\s*=\s*False|pickle\.load|import pickle", text):
                    offenders.append(name)
                for call in re.findall(r"torch\.load\([^)]*\)", text):
                    if "weights_only=True" not in call:
                        offenders.append(f"{name}: {call}")
    assert offenders == []


@pytest.mark.parametrize("damage", ["truncated", "garbage", "not_a_dict", "empty"])
def test_a_damaged_checkpoint_is_one_named_error(tmp_path, damage):
    path = tmp_path / "last.pt"
    torch.save({"model": {"w": torch.randn(50, 50)}, "epoch": 3}, path)
    data = path.read_bytes()
    path.write_bytes(
        {"truncated": data[: len(data) // 2], "garbage": b"not a checkpoint at all", "not_a_dict": b"", "empty": b""}[
            damage
        ]
    )
    if damage == "not_a_dict":
        torch.save([1, 2, 3], path)
    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        load_checkpoint(path)


@pytest.mark.slow  # by default: the CLI's one-line refusal of a checkpoint it cannot load (the same message),
# test_a_crafted_checkpoint_is_refused_and_runs_nothing; a truncated file, test_a_damaged_checkpoint_is_one_named_error
def test_a_truncated_checkpoint_via_the_cli_exits_2_without_a_traceback(finished_run, tmp_path):
    run = _copy_run(finished_run, tmp_path / "run")
    (run / "done").unlink()
    last = run / "checkpoints" / "last.pt"
    last.write_bytes(last.read_bytes()[:1000])
    text = one_line_error(cfbnn("train", "regression", f"hydra.run.dir={run}", "resume=true", *REGRESSION))
    assert "cannot load the training checkpoint" in text


# ----------------------------------------------------------------------------- 2. report stays inside its path


def _record(pipeline, metrics, config=None, status="complete"):
    return {"pipeline": pipeline, "schema": 1, "status": status, "config": config or {"seed": 0}, "metrics": metrics}


@pytest.mark.slow  # (slow: the crafted-checkpoint test covers the CLI's one-line refusal by default)
def test_a_checkpoint_of_the_wrong_structure_via_the_cli_is_one_line(finished_run, tmp_path):
    """It loads safely (tensors and plain containers only) but is no training state."""
    run = _copy_run(finished_run, tmp_path / "run")
    last = run / "checkpoints" / "last.pt"
    state = torch.load(last, weights_only=True)
    del state["history"]
    torch.save(state, last)
    (run / "done").unlink()
    text = one_line_error(cfbnn("train", "regression", f"hydra.run.dir={run}", "resume=true", *REGRESSION))
    assert "last.pt is not a checkpoint of this training loop" in text


def test_report_sanitizes_names_and_writes_only_under_its_path(tmp_path):
    root = tmp_path / "a" / "b" / "c" / "runs"
    (root / "0").mkdir(parents=True)
    escape = "x/../../../../../ESCAPED"
    (root / "0" / "results.json").write_text(json.dumps(_record(escape, {"m": 1.0})))
    before = set(tmp_path.rglob("*"))
    written = report(root)
    created = set(tmp_path.rglob("*")) - before
    assert created and all(path.resolve().is_relative_to(root.resolve()) for path in created)
    assert not list(tmp_path.rglob("ESCAPED*")) or all(p.parent == root for p in tmp_path.rglob("*ESCAPED*"))
    assert all("/" not in name and ".." not in name for files in written.values() for name in files)


def test_report_does_not_follow_links_out_of_its_tree(tmp_path):
    outside = tmp_path / "outside"
    (outside / "secret").mkdir(parents=True)
    (outside / "secret" / "results.json").write_text(json.dumps(_record("vae", {"vae/v1/test_ll": -1.0})))
    root = tmp_path / "root"
    (root / "0").mkdir(parents=True)
    (root / "0" / "results.json").write_text(json.dumps(_record("train_regression", {"final_test_rmse": 1.0})))
    (root / "linked_dir").symlink_to(outside / "secret", target_is_directory=True)
    (root / "1").mkdir()
    (root / "1" / "results.json").symlink_to(outside / "secret" / "results.json")
    written = report(root)
    assert set(written) == {"train_regression"}  # nothing read through either link


def test_report_names_and_skips_a_non_numeric_metric_and_failed_runs(tmp_path, capsys):
    for i, metrics in enumerate([{"final_test_rmse": 1.0}, {"final_test_rmse": "oops"}, {"final_test_rmse": 3.0}]):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "results.json").write_text(json.dumps(_record("train_regression", metrics, {"seed": i})))
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "results.json").write_text(
        json.dumps(_record("train_regression", {"final_test_rmse": None}, {"seed": 3}, status="failed"))
    )
    (tmp_path / "4").mkdir()
    (tmp_path / "4" / "results.json").write_bytes(b"\xff\xfe not json")
    report(tmp_path)
    err = capsys.readouterr().err
    assert "metric 'final_test_rmse' is 'oops'" in err and "status is 'failed'" in err and str(tmp_path / "4") in err
    summary = pd.read_csv(tmp_path / "report_train_regression.csv")
    assert summary.loc[summary["metric"] == "final_test_rmse", "n"].item() == 2


# ----------------------------------------------------------------------------- 3. resume is bound to its config


def test_resume_into_a_finished_run_with_another_config_is_refused(finished_run, resumed_runs):
    run, other = resumed_runs["other"]  # each into its own copy of the finished run (started at once)
    text = one_line_error(other)
    assert "seed: 0 -> 1" in text and "trainer.lr: 0.001 -> 0.5" in text
    assert (run / "done").exists()  # nothing lost
    assert (run / "results.json").read_bytes() == (finished_run / "results.json").read_bytes()
    _, same = resumed_runs["same"]
    assert same.returncode == 0 and "already finished, skipping" in same.stdout + same.stderr  # device is ignored


def test_a_uci_run_resumed_with_another_budget_is_refused_and_progress_files_are_bound(tmp_path):
    run = tmp_path / "run"
    cfg = _config(base=UCI)
    claim_run_dir(cfg, run)
    regression.run(cfg, run)
    other = _config("trainer.epochs=4", "resume=true", base=UCI)
    with pytest.raises(ConfigError, match="trainer.epochs: 5 -> 4"):
        claim_run_dir(other, run)
    # a progress file copied in from another configuration is refused too
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "uci_progress.json").write_text((run / "uci_progress.json").read_text())
    with pytest.raises(ConfigError, match="uci_progress.json was written by another configuration"):
        regression.run(other, fresh)
    (fresh / "uci_progress.json").write_text('{"config_fingerprint": "x", "records": [{"split"')
    with pytest.raises(CheckpointError, match="cannot read .*uci_progress.json"):
        regression.run(other, fresh)


def test_fingerprint_ignores_resume_and_device_and_where_the_run_dir_lies(tmp_path):
    base = _config()
    moved = _config("resume=true", "device=auto")
    assert config_fingerprint(base) == config_fingerprint(moved)
    assert config_fingerprint(base) != config_fingerprint(_config("seed=3"))
    # a path inside the run dir counts relative to it: the same run dir, moved, still resumes
    for run in (tmp_path / "run", tmp_path / "moved"):
        run.mkdir()
        (run / "x.csv").write_text("a,y\n1,2\n")
    first, second = _config(), _config()
    with open_dict(first), open_dict(second):
        first.data.path = str(tmp_path / "run" / "x.csv")
        second.data.path = str(tmp_path / "moved" / "x.csv")
    assert config_fingerprint(first, tmp_path / "run") == config_fingerprint(second, tmp_path / "moved")
    assert config_fingerprint(first, tmp_path / "elsewhere") != config_fingerprint(second, tmp_path / "elsewhere")


@pytest.mark.slow  # (8 s: two sweeps; a finished run resumed with another config: the test above)
def test_sweep_jobs_are_bound_to_their_config(tmp_path):
    sweep = tmp_path / "sweep"
    common = [f"hydra.sweep.dir={sweep}", f"features.cache_dir={tmp_path / 'cache'}", "stage=features", "device=cpu"]
    assert cfbnn("imagenet-predict", "-m", "seed=0,1", *common).returncode == 0
    out = cfbnn("imagenet-predict", "-m", "seed=0,5", "resume=true", *common)
    text = one_line_error(out)
    assert "already finished, skipping" in text and "seed: 1 -> 5" in text
    assert json.loads((sweep / "1" / "results.json").read_text())["config"]["seed"] == 1


# ----------------------------------------------------------------------------- 4. one writer per run dir


def test_a_second_run_into_a_locked_dir_exits_2_naming_the_pid_and_touches_nothing(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys, time
        from cfbnn_cli.runtime.rundir import RunDirLock
        with RunDirLock({str(run)!r}):
            print("locked", flush=True)
            time.sleep(120)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        (run / ".hydra").mkdir()
        (run / ".hydra" / "config.yaml").write_text("theirs: 1\n")
        out = cfbnn("train", "regression", f"hydra.run.dir={run}", *REGRESSION)
        text = one_line_error(out)
        assert f"pid {holder.pid}" in text and "another cfbnn run" in text
        assert (run / ".hydra" / "config.yaml").read_text() == "theirs: 1\n"  # the owner's record is untouched
        assert not (run / "checkpoints").exists() and not (run / "results.json").exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_lock_of_a_killed_run_is_taken_over(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ".cfbnn").mkdir()
    (tmp_path / ".cfbnn" / "lock").write_text(json.dumps({"pid": dead.pid, "host": "here", "started": "then"}))
    with caplog.at_level("INFO"), RunDirLock(tmp_path):
        assert json.loads((tmp_path / ".cfbnn" / "lock").read_text())["pid"] == os.getpid()
    assert f'"pid": {dead.pid}' in caplog.text
    with RunDirLock(tmp_path):  # released: a later run takes it at once
        pass


# ----------------------------------------------------------------------------- 5, 6. CSV intake and overflow


def _write_csv(path, header, rows, encoding="utf-8", bom=False, sep=","):
    text = sep.join(header) + "\n" + "".join(sep.join(str(v) for v in row) + "\n" for row in rows)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode(encoding))
    return path


def _rows(n=40, seed=0, scale_y=1.0, scale_x=1.0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3)) * scale_x
    y = (x[:, 0] / scale_x - 2 * x[:, 1] / scale_x + 0.1 * rng.standard_normal(n)) * scale_y
    return x, y


def test_duplicate_column_names_are_an_error_naming_them(tmp_path):
    x, y = _rows()
    rows = [[a, a, b, c, v, v] for (a, b, c), v in zip(x, y)]
    path = _write_csv(tmp_path / "dup.csv", ["a", "a", "b", "c", "y", "y"], rows)
    with pytest.raises(DataError, match=r"duplicate column name\(s\) a, y in the header"):
        tabular_file(path, "y")


def test_a_bom_is_stripped_and_a_semicolon_file_gets_a_hint_and_a_directory_is_named(tmp_path):
    x, y = _rows()
    rows = [[*r, v] for r, v in zip(x, y)]
    data = tabular_file(_write_csv(tmp_path / "bom.csv", ["a", "b", "c", "y"], rows, bom=True), "y")
    assert data.input_dim == 3
    table = load_regression_table(OmegaConf.create({"name": "csv", "path": str(tmp_path / "bom.csv"), "target": "y"}))
    assert table.columns == ["a", "b", "c"]
    with pytest.raises(DataError, match="looks ';'-separated"):
        tabular_file(_write_csv(tmp_path / "semi.csv", ["a", "b", "c", "y"], rows, sep=";"), "y")
    with pytest.raises(DataError, match="is a directory, not a data file"):
        tabular_file(tmp_path, "y")


def test_non_utf8_text_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "latin.csv"
    path.write_bytes("a,y\n1,2\n3,4\n# caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match="line 4: byte 0xe9 is not UTF-8"):
        tabular_file(path, "y")
    path.write_bytes(b"\xef\xbb\xbf" + "a,y\n1,2\n\xe9,4\n".encode("latin-1"))
    with pytest.raises(DataError, match="line 3: byte 0xe9"):
        tabular_file(path, "y")


@pytest.mark.parametrize("scale_y, scale_x", [(1e15, 1.0), (1e-300, 1.0), (1.0, 1e200), (1.0, 1e-300)])
def test_extreme_but_finite_scales_give_the_same_model_as_unit_scales(tmp_path, scale_y, scale_x):
    """Standardization is scale-invariant: 1e200 or 1e-300 in a feature column (a target up to
    the scale whose predictions float32 holds) changes nothing once standardized (it used to be
    inf, zeroed, or "constant")."""
    x, y = _rows()
    unit = tabular_file(_write_csv(tmp_path / "unit.csv", ["a", "b", "c", "y"], [[*r, v] for r, v in zip(x, y)]), "y")
    xs, ys = _rows(scale_y=scale_y, scale_x=scale_x)
    scaled = tabular_file(_write_csv(tmp_path / "s.csv", ["a", "b", "c", "y"], [[*r, v] for r, v in zip(xs, ys)]), "y")
    torch.testing.assert_close(scaled.x_train, unit.x_train, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(scaled.y_train, unit.y_train, rtol=1e-6, atol=1e-6)
    assert scaled.target_std == pytest.approx(unit.target_std * scale_y, rel=1e-12)


def test_a_column_that_overflows_float32_when_standardized_is_named(tmp_path):
    from cfbnn_cli.data.regression import RegressionTable

    rng = np.random.default_rng(0)
    x = np.stack([rng.standard_normal(30), 1e-300 * rng.standard_normal(30)], 1)
    x[29, 1] = 1e10  # a test row 1e310 training standard deviations out: beyond float32 (and float64)
    table = RegressionTable("wild", x, rng.standard_normal(30), "y", ["a", "tiny"])
    with pytest.raises(DataError, match="data `wild`: feature column tiny overflow"):
        table.split(np.arange(25), np.arange(25, 30))


def test_a_1e200_target_is_refused_before_training_as_predict_could_not_use_the_model(tmp_path):
    x, y = _rows(n=120, scale_y=1e200)
    path = _write_csv(tmp_path / "big.csv", ["a", "b", "c", "y"], [[*r, v] for r, v in zip(x, y)])
    cfg = _config(
        "data=csv",
        "protocol=gradient_variance",
        f"data.path={path}",
        "data.target=y",
        "trainer.epochs=1",
        "trainer.batch_size=27",
        "gradient_variance.num_samples=0",
        base=[o for o in REGRESSION if not o.startswith(("data.", "trainer.batch_size"))],
    )
    # its predictions' variances in squared units (1e400) overflow: `cfbnn predict` raised on its model.pt
    with pytest.raises(DataError, match="the target `y` .* would overflow float32 beyond an s.d. of 1e\\+18"):
        regression.run(cfg, tmp_path / "run")


def test_non_finite_final_metrics_end_as_failed_with_a_non_zero_exit(tmp_path, monkeypatch, capsys, caplog):
    from hydra.core.hydra_config import HydraConfig

    from cfbnn_cli.cli import SUBCOMMANDS, make_task
    from cfbnn_cli.runtime.errors import NonFiniteResultError

    monkeypatch.setattr(
        regression,
        "run",
        lambda cfg, run_dir, values=None: {"metrics": {"final_test_rmse": float("inf"), "test_ll_se": None}},
    )
    hydra_cfg = OmegaConf.create({"runtime": {"output_dir": str(tmp_path)}, "overrides": {"task": []}})
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: hydra_cfg))
    cfg = _config()
    with pytest.raises(NonFiniteResultError, match="final_test_rmse"):
        make_task(SUBCOMMANDS[0])(cfg)
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["status"] == "failed" and record["metrics"]["final_test_rmse"] is None
    assert not (tmp_path / "done").exists()


def _run_task(run_dir, monkeypatch, pipeline_run):
    """The CLI's task for ``train regression`` in this process, with ``pipeline_run`` as the pipeline."""
    from hydra.core.hydra_config import HydraConfig

    from cfbnn_cli.cli import SUBCOMMANDS, make_task

    monkeypatch.setattr(regression, "run", pipeline_run)
    hydra_cfg = OmegaConf.create({"runtime": {"output_dir": str(run_dir)}, "overrides": {"task": []}})
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: hydra_cfg))
    make_task(SUBCOMMANDS[0])(_config())


def test_a_run_that_fails_after_an_output_says_why_in_its_run_dir(tmp_path, monkeypatch):
    """Once the run has written an output, a failure is recorded in the dir (``status: failed``, the
    error, no ``done``); ``cfbnn report`` names and skips it."""
    from cfbnn_cli.report.records import collect

    def fails_after_an_epoch(cfg, run_dir, values=None):
        (run_dir / "metrics.csv").write_text("epoch,train_elbo_per_point\n1,-3.0\n")
        raise DataError("data.csv, line 7: non-numeric value")

    with pytest.raises(DataError):
        _run_task(tmp_path, monkeypatch, fails_after_an_epoch)
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["status"] == "failed" and "line 7: non-numeric value" in record["error"]
    assert (tmp_path / "metrics.csv").exists() and not (tmp_path / "done").exists()
    with pytest.raises(DataError, match="no results.json of a complete run"):
        collect(tmp_path)


def test_a_run_that_fails_before_any_output_leaves_an_existing_dir_as_it_was(tmp_path, monkeypatch):
    """A data error before any output (the pipeline loads its data first): the dir keeps exactly
    what it held -- no lock, no config record, no .hydra/, no failed results.json. (A run dir of an
    earlier, unfinished run: cfbnn writes no run into a folder of other files.)"""
    (tmp_path / ".cfbnn").mkdir()
    (tmp_path / "notes.txt").write_text("mine")

    def no_data(cfg, run_dir, values=None):
        raise DataError("data file not found: data.csv (set data.path=...)")

    with pytest.raises(DataError):
        _run_task(tmp_path, monkeypatch, no_data)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".cfbnn", "notes.txt"]
    assert not list((tmp_path / ".cfbnn").iterdir())


# ----------------------------------------------------------------------------- 7, 8. smaller defects


@pytest.mark.parametrize(
    "override, words",
    [("data=nope", "Could not find 'data/nope'"), ("trainer.nosuchkey=1", "nosuchkey"), ("seed=[", "seed=[")],
)
def test_hydra_composition_errors_exit_2_with_hydras_message(tmp_path, override, words):
    text = one_line_error(cfbnn("train", "regression", f"hydra.run.dir={tmp_path}", override))
    assert words in text


def test_trainer_lr_must_be_finite():
    with pytest.raises(ConfigError, match="trainer.lr=inf must be a positive, finite number"):
        validate_common(_config("trainer.lr=inf"))


def test_atomic_files_get_the_normal_umask_mode(tmp_path):
    previous = os.umask(0o022)
    try:
        atomic_write_json(tmp_path / "a.json", {"x": 1})
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644


def test_temporary_files_of_a_killed_write_are_removed_on_the_next_run(resumed_runs):
    # the resumed run with its own config (resumed_runs' "same", into a copy of the finished run
    # holding _plant_temporary_files' files): the next run, without a CLI start of its own
    run, out = resumed_runs["same"]
    assert out.returncode == 0
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*.tmp")) == [
        ".notes.tmp",
        "nested_run/.results.json.cfbnn-other.tmp",
    ]


def test_test_evaluation_is_chunked(monkeypatch):
    """Peak memory: the predictive never sees more rows at once than one chunk."""
    from cfbnn_cli.bnn.network import BayesianNetwork
    from cfbnn_cli.data.regression import synthetic_teacher

    monkeypatch.setattr(gradient_variance_study, "rows_per_chunk", lambda elements_per_row: 300)
    seen = []
    original = BayesianNetwork.predictive_components
    monkeypatch.setattr(
        BayesianNetwork,
        "predictive_components",
        lambda self, x, *a, **k: seen.append(len(x)) or original(self, x, *a, **k),
    )
    data = synthetic_teacher(input_dim=4, n_train=50, n_test=1000)
    model = BayesianNetwork(4, [8, 8], init_scale=0.1, generator=torch.Generator().manual_seed(0))
    metrics = gradient_variance_study.evaluate(model, data, 4, torch.Generator().manual_seed(0))
    assert seen == [300, 300, 300, 100] and np.isfinite(metrics["test_ll_closed_form"])


# ----------------------------------------------------------------------------- fault injection: kill -9, resume


def _progress_saved(run):
    return (run / "checkpoints" / "last.pt").exists() or (run / "uci_progress.json").exists()


def _kill_at(args, run, delay):
    """Start the command, wait until it has saved some progress, then ``delay`` seconds
    more, and SIGKILL it (if it is still running). Returns whether it was killed."""
    process = subprocess.Popen(
        [sys.executable, "-m", "cfbnn_cli.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, HYDRA_FULL_ERROR="0"),
    )
    try:
        while process.poll() is None and not _progress_saved(run):
            time.sleep(0.01)
        process.wait(timeout=delay)
        return False  # it finished before the kill
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        process.wait()
        return True


def _timed(args):
    started = time.perf_counter()
    out = cfbnn(*args)
    assert out.returncode == 0, out.stderr[-3000:]
    return time.perf_counter() - started


def _results_without_timing(run):
    record = json.loads((run / "results.json").read_text())
    return {k: v for k, v in record["metrics"].items() if not re.search(r"seconds|_ms|wall|speed|time", k)}


def _kill_and_resume_matches(tmp_path, command, overrides, seeds, compare):
    reference = tmp_path / "reference"
    duration = _timed([*command, f"hydra.run.dir={reference}", *overrides])
    rng = np.random.default_rng(1234)
    killed_mid_way = 0
    for index, seed in enumerate(seeds):
        run = tmp_path / f"killed{seed}"
        # the first run right after its first saved progress (so that one kill surely lands mid-way,
        # however fast the machine is), the others at a random moment after it (start-up is about
        # half of a small run)
        delay = rng.uniform(0.0, 0.4) * duration
        killed = _kill_at([*command, f"hydra.run.dir={run}", *overrides], run, 0.0 if index == 0 else delay)
        killed_mid_way += killed and _progress_saved(run) and not (run / "done").exists()
        out = cfbnn(*command, f"hydra.run.dir={run}", *overrides, "resume=true")
        assert out.returncode == 0, out.stderr[-3000:]
        assert _results_without_timing(run) == _results_without_timing(reference)
        compare(run, reference)
    assert killed_mid_way >= 1  # at least one run was killed after saving progress, before finishing


def _same_regression_outputs(run, reference):
    drop = ["epoch_seconds"]
    pd.testing.assert_frame_equal(
        pd.read_csv(run / "metrics.csv").drop(columns=drop), pd.read_csv(reference / "metrics.csv").drop(columns=drop)
    )
    assert (run / "gradient_variance.csv").read_text() == (reference / "gradient_variance.csv").read_text()


def _same_uci_outputs(run, reference):
    keep = ["split", "method", "test_ll", "rmse", "noise_std", "iterations", "converged", "stopped_early"]
    pd.testing.assert_frame_equal(
        pd.read_csv(run / "uci_splits.csv")[keep], pd.read_csv(reference / "uci_splits.csv")[keep]
    )


# Kill -9 and resume (slow tests): each protocol once, right after its first saved progress (a kill that
# surely lands mid-way), and at random moments. The default suite's resume tests interrupt in process.
@pytest.mark.slow
def test_kill_9_then_resume_equals_an_uninterrupted_regression_run(tmp_path):
    overrides = [*REGRESSION, "trainer.epochs=4", "data.n_train=2000"]
    _kill_and_resume_matches(tmp_path, ["train", "regression"], overrides, [0], _same_regression_outputs)


@pytest.mark.slow
def test_kill_9_then_resume_equals_an_uninterrupted_uci_run(tmp_path):
    overrides = [*UCI, "uci.n_splits=3", "trainer.epochs=30"]
    _kill_and_resume_matches(tmp_path, ["train", "regression"], overrides, [0], _same_uci_outputs)


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["regression", "uci"])
def test_kill_9_at_many_points(tmp_path, protocol):
    if protocol == "regression":
        _kill_and_resume_matches(
            tmp_path,
            ["train", "regression"],
            [*REGRESSION, "trainer.epochs=6", "data.n_train=2000"],
            range(2, 8),
            _same_regression_outputs,
        )
    else:
        _kill_and_resume_matches(
            tmp_path,
            ["train", "regression"],
            [*UCI, "uci.n_splits=4", "trainer.epochs=30"],
            range(2, 8),
            _same_uci_outputs,
        )
