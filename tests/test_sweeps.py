"""Sweeps: launchers (slow: each starts worker processes), resume of a killed sweep, the
multirun's report callback, a launcher error's hint."""

import pandas as pd
import pytest

FAST = ["stage=features", "device=cpu"]  # imagenet-predict's feature stage: a real job in ~1 s


def _results(sweep):
    return sorted(sweep.glob("*/results.json"))


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])
def test_two_by_two_sweep_on_a_launcher_gives_four_results_and_one_table(tmp_path, launcher, cfbnn):
    sweep = tmp_path / "sweep"
    extra = ["hydra.launcher.n_jobs=2"] if launcher == "joblib" else []
    out = cfbnn(
        "imagenet-predict",
        "-m",
        "seed=0,1",
        "objective=sampling,control_variate",
        f"hydra/launcher={launcher}",
        *extra,
        f"hydra.sweep.dir={sweep}",
        f"features.cache_dir={tmp_path / 'cache'}",
        *FAST,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(_results(sweep)) == 4
    table = pd.read_csv(sweep / "report_imagenet_predict_table.csv")
    assert len(table) == 2 and set(table["objective"]) == {"sampling", "control_variate"}  # grouped by the swept key
    assert (table["runs"] == 2).all()  # seeds are the replicates
    if launcher == "joblib":  # jobs share the cores: each logs the threads it took and the jobs it counted
        logs = "".join(path.read_text() for path in sweep.glob("*/*.log"))
        assert "torch threads (" in logs and "cfbnn job(s) on this machine" in logs


@pytest.mark.slow  # (slow: a whole sweep killed and resumed; resume of one job is in the default suite)
def test_a_killed_sweep_resumes_with_only_the_missing_jobs(tmp_path, cfbnn):
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


def test_report_with_no_results_fails_and_a_bad_launcher_points_to_the_readme(tmp_path, cfbnn):
    out = cfbnn("report", str(tmp_path))
    assert out.returncode != 0 and "no results.json of a complete run under" in out.stderr
    bad = cfbnn("vae", "-m", "seed=0", "hydra/launcher=nosuch", f"hydra.sweep.dir={tmp_path / 's'}")
    assert bad.returncode != 0
    assert (
        "Could not find 'hydra/launcher/nosuch'" in bad.stderr and "'Sweeps and launchers' in docs/cli.md" in bad.stderr
    )
