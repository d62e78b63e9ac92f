"""Sweeps: launchers, resume of a killed sweep, `cfbnn report` and its multirun callback."""

import json
import math
import os
import subprocess
import sys

import pandas as pd
import pytest

from cfbnn_cli.report.aggregate import report

FAST = ["stage=features", "device=cpu"]  # imagenet-predict's feature stage: a real job in ~1 s


def cfbnn(*args, env_extra=None):
    env = dict(os.environ, HYDRA_FULL_ERROR="0", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "cfbnn_cli.cli", *args], capture_output=True, text=True, env=env, timeout=600)


def _results(sweep):
    return sorted(sweep.glob("*/results.json"))


@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])
def test_two_by_two_sweep_on_a_launcher_gives_four_results_and_one_table(tmp_path, launcher):
    sweep = tmp_path / "sweep"
    extra = ["hydra.launcher.n_jobs=2"] if launcher == "joblib" else []
    out = cfbnn("imagenet-predict", "-m", "seed=0,1", "objective=sampling,control_variate", f"hydra/launcher={launcher}",
                *extra, f"hydra.sweep.dir={sweep}", f"features.cache_dir={tmp_path / 'cache'}", *FAST)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(_results(sweep)) == 4
    table = pd.read_csv(sweep / "report_imagenet_predict_table.csv")
    assert len(table) == 2 and set(table["objective"]) == {"sampling", "control_variate"}  # grouped by the swept key
    assert (table["runs"] == 2).all()  # seeds are the replicates
    if launcher == "joblib":
        assert "torch threads per job" in out.stdout + out.stderr


def test_a_killed_sweep_resumes_with_only_the_missing_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    common = [f"hydra.sweep.dir={sweep}", f"features.cache_dir={tmp_path / 'cache'}", *FAST]
    first = cfbnn("imagenet-predict", "-m", "seed=0,1", *common)  # as if killed after two jobs
    assert first.returncode == 0 and len(_results(sweep)) == 2
    before = {p: p.stat().st_mtime_ns for p in _results(sweep)}
    resumed = cfbnn("imagenet-predict", "-m", "seed=0,1,2,3", "resume=true", *common)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    text = resumed.stdout + resumed.stderr
    assert text.count("already finished, skipping") == 2
    assert len(_results(sweep)) == 4
    assert all(p.stat().st_mtime_ns == t for p, t in before.items())  # the finished jobs were not redone


def _write_run(folder, pipeline, config, metrics):
    folder.mkdir(parents=True)
    record = {"pipeline": pipeline, "schema": 1, "status": "complete", "config": config, "metrics": metrics}
    (folder / "results.json").write_text(json.dumps(record))


def test_report_on_hand_made_runs_gives_the_known_mean_and_standard_error(tmp_path, capsys):
    values = {("analytic", 0): 1.0, ("analytic", 1): 3.0, ("analytic", 2): 5.0, ("sampling", 0): 10.0, ("sampling", 1): 14.0}
    for i, ((estimator, seed), value) in enumerate(values.items()):
        config = {"seed": seed, "estimator": {"name": estimator}, "trainer": {"epochs": 3}, "device": "cpu"}
        _write_run(tmp_path / str(i), "train_regression", config, {"final_test_rmse": value, "other": None})
    (tmp_path / "9").mkdir()
    (tmp_path / "9" / "results.json").write_text("{ truncated")
    written = report(tmp_path)
    err = capsys.readouterr().err
    assert f"skipping {tmp_path / '9' / 'results.json'}" in err  # the corrupt file is named, the rest aggregated
    summary = pd.read_csv(tmp_path / "report_train_regression.csv")
    rmse = summary[summary["metric"] == "final_test_rmse"].set_index("estimator.name")
    assert list(summary.columns[:2]) == ["estimator.name", "metric"]  # grouped by the swept key only
    assert rmse.loc["analytic", "mean"] == pytest.approx(3.0) and rmse.loc["analytic", "n"] == 3
    assert rmse.loc["analytic", "se"] == pytest.approx(2.0 / math.sqrt(3))  # sd of (1, 3, 5) is 2
    assert rmse.loc["sampling", "mean"] == pytest.approx(12.0)
    assert rmse.loc["sampling", "se"] == pytest.approx(math.sqrt(8.0) / math.sqrt(2))
    markdown = (tmp_path / "report_train_regression_table.md").read_text()
    assert "3.0000 ± 1.1547" in markdown and "12.00 ± 2.00" in markdown
    assert "report_train_regression_table.tex" in written["train_regression"]


def test_report_makes_table_2_from_single_variant_runs(tmp_path):
    for i, (variant, seed, value) in enumerate([("v1", 0, -10.0), ("v1", 1, -12.0), ("v3", 0, -9.0), ("v3", 1, -9.5)]):
        _write_run(tmp_path / str(i), "vae", {"variant": variant, "seed": seed}, {f"vae/{variant}/test_ll": value})
    report(tmp_path)
    table = pd.read_csv(tmp_path / "report_vae_table.csv", index_col=0)
    assert list(table.index) == ["V1", "V3"]
    assert table.loc["V1"].iloc[0] == "-11.00 ± 1.00"
    assert (tmp_path / "report_vae.png").read_bytes()[:4] == b"\x89PNG"


def test_report_with_no_results_fails_and_a_bad_launcher_points_to_the_readme(tmp_path):
    out = cfbnn("report", str(tmp_path))
    assert out.returncode != 0 and "no results.json of a complete run under" in out.stderr
    bad = cfbnn("vae", "-m", "seed=0", "hydra/launcher=nosuch", f"hydra.sweep.dir={tmp_path / 's'}")
    assert bad.returncode != 0
    assert "Could not find 'hydra/launcher/nosuch'" in bad.stderr and "README section 'Sweeps and launchers'" in bad.stderr
