"""cli.py: dispatch, config composition and each command's help, run directories, errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TRUST_REGRESSION, finish_all, one_line_error
from omegaconf import OmegaConf, open_dict

from cfbnn_cli.cli import SUBCOMMANDS, compose_config, find_subcommand
from cfbnn_cli.runtime.checks import validate_common
from cfbnn_cli.runtime.errors import ConfigError


def test_help_lists_subcommands(cfbnn):
    out = cfbnn("--help")
    assert out.returncode == 0
    commands = out.stdout.split("commands:")[1].split("Everything after")[0]  # the command list itself
    for sub in ("train regression", "train classification", "vae", "imagenet-predict", "report PATH"):
        assert f"\n  {sub} " in commands, sub


@pytest.mark.parametrize("args", [["nope"], ["train"], ["train", "clustering"], []])
def test_unknown_or_incomplete_subcommand_exits_2_with_usage(args, cfbnn):
    out = cfbnn(*args)
    assert out.returncode == 2
    assert "usage: cfbnn" in out.stdout + out.stderr


def test_dispatch_table():
    sub, rest = find_subcommand(["train", "regression", "seed=3", "-m"])
    assert sub.config_name == "train_regression" and rest == ["seed=3", "-m"]
    assert find_subcommand(["imagenet-predict"])[0].config_name == "imagenet_predict"
    assert find_subcommand(["regression"])[0] is None


@pytest.mark.parametrize("sub", SUBCOMMANDS, ids=lambda s: s.name)
def test_each_config_composes_with_common_keys(sub):
    cfg = compose_config(sub.config_name, ["seed=5", "device=cpu"], return_hydra_config=True)
    assert cfg.hydra.job.name == sub.config_name
    assert cfg.seed == 5 and cfg.device == "cpu" and cfg.resume is False
    for key in ("epochs", "batch_size", "lr"):
        assert key in cfg.trainer
    with open_dict(cfg):
        del cfg["hydra"]
    validate_common(cfg)


def test_config_groups_and_keys_switch():
    cfg = compose_config("train_regression", ["estimator=sampling", "data=diabetes"])
    assert cfg.estimator == "sampling" and cfg.data.name == "diabetes" and cfg.protocol == "gradient_variance"
    uci = compose_config("train_regression", ["experiment=uci"])  # no `+` needed: experiment is in the defaults
    assert uci.protocol == "uci" and list(uci.model.hidden_sizes) == [50] and "estimator" not in uci
    assert "gradient_variance" not in uci and "evaluation" not in uci  # Table 1's keys are not composed for UCI


@pytest.mark.parametrize(
    "sub, own, foreign",
    [
        (
            "vae",
            [
                "variant",
                "data: digits, fashion_mnist, fashion_mnist_pca90, synthetic, year_prediction_msd",
                "experiment: paper_table2, table2_fashion_mnist, table2_fashion_mnist_pca90",
                "logger: csv, tensorboard",
            ],
            ["paper_table1", "head_small", "protocol", "computers"],
        ),
        (
            "train regression",
            [
                "protocol: fit, gradient_variance, uci",
                "estimator",
                "experiment: paper_table1, uci",
                "logger: csv, tensorboard",
            ],
            ["paper_table2", "variant", "digits", "head_small"],
        ),
        (
            "imagenet-predict",
            [
                "objective",
                "model: head, head_small",
                "data: digits, fake, fashion_mnist, imagenet",
                "logger: csv, tensorboard",
            ],
            ["paper_table1", "variant", "protocol", "synthetic"],
        ),
    ],
)
def test_each_command_help_lists_only_its_own_groups_and_keys(cfbnn, sub, own, foreign):
    """Its own groups, the shared ones among them (``logger``, from conf/shared/), and no other command's."""
    out = cfbnn(*sub.split(), "--help")
    assert out.returncode == 0, out.stderr
    groups = out.stdout.split("Main keys")[0]
    for text in own:
        assert text in out.stdout, text
    for text in foreign:
        assert text not in groups, text


@pytest.mark.parametrize(
    "override,key",
    [
        ("seed=-1", "seed"),
        ("trainer.epochs=-3", "trainer.epochs"),
        ("trainer.batch_size=0", "trainer.batch_size"),
        ("trainer.lr=0", "trainer.lr"),
        ("resume=maybe", "resume"),
    ],
)
def test_invalid_common_values_are_named(override, key):
    cfg = compose_config("train_regression", [override])
    with pytest.raises(ConfigError, match=key.split(".")[-1]):
        validate_common(cfg)


@pytest.mark.parametrize(
    "override, key",
    [("device=gpu", "device"), ("estimator=gibbs", "estimator"), ("likelihood=laplace", "likelihood")],
)
def test_invalid_typed_values_are_named(override, key):
    """device, estimator and likelihood become objects once, at the command's boundary."""
    from cfbnn_cli.run_values import parse_run_values

    cfg = compose_config("train_regression", [override])
    with pytest.raises(ConfigError, match=key):
        parse_run_values(cfg)


def test_cfg_job_prints_composed_config(cfbnn):
    out = cfbnn("vae", "--cfg", "job", "variant=v2")
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["variant"] == "v2" and "trainer" in cfg


def _imagenet_run_args(folder):
    return [
        "imagenet-predict",
        f"hydra.run.dir={folder / 'run'}",
        f"features.cache_dir={folder / 'cache'}",
        "device=cpu",
        "trainer.batch_size=64",
        "trainer.epochs=1",
        "model.hidden_sizes=[16,16]",
        "evaluation.total_samples=16",
        "evaluation.inner_samples=[1,16]",
    ]


def _imagenet_sweep_args(folder):
    return [
        "imagenet-predict",
        "-m",
        "seed=0,1",
        f"hydra.sweep.dir={folder / 'sweep'}",
        "stage=features",
        "device=cpu",
        f"features.cache_dir={folder / 'cache'}",
    ]


@pytest.fixture(scope="module")
def imagenet_runs(tmp_path_factory):
    """The first CLI run of each of the two tests below (a run, a two-job sweep), each in its own
    folder, started at once: ``{name: (folder, Popen)}``."""
    started = {}
    for name, arguments in (("run", _imagenet_run_args), ("sweep", _imagenet_sweep_args)):
        folder = tmp_path_factory.mktemp(f"imagenet_{name}")
        started[name] = (
            folder,
            subprocess.Popen(
                [sys.executable, "-m", "cfbnn_cli.cli", *arguments(folder)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=dict(os.environ, HYDRA_FULL_ERROR="0"),
            ),
        )
    return started


def test_run_writes_results_last_and_resume_skips_a_finished_job(imagenet_runs, cfbnn_all):
    folder, process = imagenet_runs["run"]
    run_dir, args = folder / "run", _imagenet_run_args(folder)
    out = finish_all({"run": process})["run"]
    assert out.returncode == 0, out.stderr[-2000:]
    # the command ends by saying where its outputs went and printing its main table
    tail = out.stdout[out.stdout.index(f"cfbnn: outputs in {run_dir}") :]
    assert tail.splitlines()[1] == "prediction.md:" and "| Deterministic argmax ŷ (eq. 42)" in tail
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    assert saved.trainer.epochs == 1
    assert (run_dir / "imagenet_predict.log").exists() and (run_dir / "done").exists()
    results = yaml.safe_load((run_dir / "results.json").read_text())
    assert results["pipeline"] == "imagenet_predict" and results["status"] == "complete"
    records = {name: (run_dir / name).read_bytes() for name in ("done", "results.json", ".hydra/config.yaml")}
    # both into the finished run's dir, started at once (the skip writes none of these records)
    runs = cfbnn_all({"again": [*args, "resume=true"], "typo": [*args, "model.activation=tanh"]})
    again, typo = runs["again"], runs["typo"]
    assert again.returncode == 0 and "already finished, skipping" in again.stdout + again.stderr
    # a mistyped value sent to the finished run's dir: one line and exit 2, the finished run's
    # records untouched (its checks ran before the dir was claimed)
    assert typo.returncode == 2 and "model.activation" in typo.stderr and "Traceback" not in typo.stderr
    assert {name: (run_dir / name).read_bytes() for name in records} == records


@pytest.mark.slow  # in process: test_invalid_typed_values_are_named[device]; the CLI's one line and exit 2 for a
# bad value: tests/runtime/test_matmul_precision.py::test_a_bad_value_is_one_line_exit_2_and_nothing_written
def test_invalid_value_exits_2_before_work(tmp_path, cfbnn):
    out = cfbnn("vae", f"hydra.run.dir={tmp_path / 'r'}", "device=tpu")
    assert out.returncode == 2
    text = out.stdout + out.stderr
    assert "device='tpu'" in text and "Traceback" not in text


def test_multirun_makes_one_dir_per_job(imagenet_runs):
    folder, process = imagenet_runs["sweep"]
    sweep = folder / "sweep"
    out = finish_all({"sweep": process})["sweep"]
    assert out.returncode == 0, out.stderr[-2000:]
    assert (sweep / "multirun.yaml").exists()
    for job in (0, 1):
        assert OmegaConf.load(sweep / str(job) / ".hydra" / "config.yaml").seed == job
        assert (sweep / str(job) / "results.json").exists()
    assert OmegaConf.load(sweep / "0" / ".hydra" / "hydra.yaml").hydra.job.name == "imagenet_predict"


def test_console_script_installed():
    out = subprocess.run(["cfbnn", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "train regression" in out.stdout


def _leaves(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.mark.parametrize(
    "command, experiment",
    [
        (command, path.stem)
        for command in ("train_regression", "vae", "imagenet_predict")
        for path in sorted((Path(__file__).resolve().parents[1] / "conf" / command / "experiment").glob("*.yaml"))
    ],
)
def test_every_key_an_experiment_sets_reaches_the_composed_config(command, experiment):
    """An experiment file is applied last: each value it sets wins over the command's own keys
    (``evaluation.trials`` of the VAE, ``gradient_variance`` of Table 1) and its groups'."""
    import yaml
    from omegaconf import OmegaConf

    from cfbnn_cli.cli import compose_config

    path = Path(__file__).resolve().parents[1] / "conf" / command / "experiment" / f"{experiment}.yaml"
    values = {k: v for k, v in yaml.safe_load(path.read_text()).items() if k != "defaults"}
    cfg = compose_config(command, [f"experiment={experiment}"])
    for key, value in _leaves(values):
        assert OmegaConf.select(cfg, key) == value, (experiment, key)


def test_logger_tensorboard_writes_each_epochs_metrics_as_scalars(tmp_path, regression_cfg):
    """logger=tensorboard (lightning-hydra-template's logger group): the rows of metrics.csv
    also as TensorBoard scalars, one per column and epoch, under <run dir>/tensorboard (the CLI
    opens the sink around the pipeline exactly like this, see cli.run_pipeline)."""
    pytest.importorskip("tensorboard")
    import pandas as pd
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from cfbnn_cli.pipelines.regression import gradient_variance_study as pipeline
    from cfbnn_cli.runtime import metrics_sink

    cfg = regression_cfg("logger=tensorboard", "gradient_variance.num_samples=0")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with metrics_sink.logging_to(cfg, run_dir):
        pipeline.run(cfg, run_dir)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    rows = pd.read_csv(run_dir / "metrics.csv")
    series = events.Scalars("train/train_elbo_per_point")
    assert [s.step for s in series] == list(rows["epoch"])
    assert [s.value for s in series] == pytest.approx(list(rows["train_elbo_per_point"]), rel=1e-6)
    metrics_sink.emit("train", {"epoch": 9, "x": 1.0})  # closed after the run: nothing more is written
    plain = regression_cfg("gradient_variance.num_samples=0")
    (tmp_path / "plain").mkdir()
    with metrics_sink.logging_to(plain, tmp_path / "plain"):
        pipeline.run(plain, tmp_path / "plain")
    assert not (tmp_path / "plain" / "tensorboard").exists()  # csv: the default
    with pytest.raises(Exception, match="logger='wandb' is not one of csv, tensorboard"):
        metrics_sink.logging_to(OmegaConf.create({"logger": {"name": "wandb"}}), tmp_path)


def test_an_unknown_key_is_one_line_naming_the_nearest_keys(tmp_path, cfbnn):
    out = cfbnn("train", "regression", f"hydra.run.dir={tmp_path / 'r'}", "trainer.epoch=3")
    assert out.returncode == 2 and not (tmp_path / "r").exists()
    lines = out.stderr.strip().splitlines()
    assert lines == [
        "cfbnn: error: trainer.epoch is not a key of `cfbnn train regression`'s config (did you mean "
        "trainer.epochs?); `cfbnn train regression --help` lists its groups and keys"
    ], out.stderr


# ----------------------------------------------------------------------------- runs you cannot lose

# TRUST_REGRESSION without its data keys, for data=csv (whose config has none of them)
# Table 1's study on a file (data=csv alone selects protocol=fit, which has no gradient_variance keys)
CSV_RUN = [o for o in TRUST_REGRESSION if not o.startswith("data.")] + ["protocol=gradient_variance"]


def _contents(folder: Path) -> dict:
    """Every path under ``folder`` with its bytes (``None`` for a folder): equal means unchanged."""
    return {
        str(path.relative_to(folder)): (None if path.is_dir() else path.read_bytes())
        for path in sorted(folder.rglob("*"))
    }


def test_a_new_run_into_a_finished_runs_dir_is_refused_unless_resumed_or_overwritten(tmp_path, cfbnn):
    """A dir holding a finished run's records (made by hand here; the slow test below trains one) is
    refused, one line naming both ways out, and nothing in it changes."""
    run_dir = tmp_path / "run"
    (run_dir / ".cfbnn").mkdir(parents=True)
    (run_dir / "results.json").write_text('{"status": "complete"}')
    (run_dir / "done").write_text("")
    (run_dir / "model.pt").write_bytes(b"the finished run's model")
    finished = _contents(run_dir)
    refused = cfbnn("train", "regression", f"hydra.run.dir={run_dir}", *TRUST_REGRESSION)
    text = one_line_error(refused)
    assert refused.stderr.strip().splitlines() == [
        f"cfbnn: error: {run_dir} holds a finished run (done, results.json); add resume=true to continue it (a "
        "finished job is skipped) or overwrite=true to replace its outputs, or choose another hydra.run.dir "
        "(hydra.sweep.dir for a sweep)"
    ], text
    assert _contents(run_dir) == finished  # byte for byte


@pytest.mark.slow
def test_a_finished_run_is_continued_with_resume_and_replaced_with_overwrite(tmp_path, cfbnn):
    run_dir = tmp_path / "run"
    args = ["train", "regression", f"hydra.run.dir={run_dir}", *TRUST_REGRESSION]
    first = cfbnn(*args)
    assert first.returncode == 0, first.stderr[-2000:]
    # a redirected stderr gets no progress bars (tqdm's \r lines)
    assert "\r" not in first.stderr and "it/s" not in first.stderr, first.stderr[-2000:]
    finished = _contents(run_dir)
    assert "done" in finished and "model.pt" in finished
    assert "holds a finished run" in one_line_error(cfbnn(*args, "seed=1")) and _contents(run_dir) == finished
    # a data error with overwrite=true: refused before any output, the finished run kept as it was
    missing = cfbnn(
        "train", "regression", f"hydra.run.dir={run_dir}", *CSV_RUN, "data=csv",
        f"data.path={tmp_path / 'missing.csv'}", "data.target=y", "overwrite=true",
    )  # fmt: skip
    assert "data file not found" in one_line_error(missing)
    assert _contents(run_dir) == finished
    both = cfbnn(*args, "resume=true", "overwrite=true")
    assert "resume=true and overwrite=true" in one_line_error(both) and _contents(run_dir) == finished
    skipped = cfbnn(*args, "resume=true")
    assert skipped.returncode == 0 and "already finished, skipping" in skipped.stdout + skipped.stderr
    replaced = cfbnn(*args, "seed=1", "overwrite=true")
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    results = yaml.safe_load((run_dir / "results.json").read_text())
    assert results["status"] == "complete" and results["config"]["seed"] == 1
    assert (run_dir / "model.pt").read_bytes() != finished["model.pt"]


def test_a_run_refused_before_any_output_leaves_no_dir(tmp_path, cfbnn_all):
    runs = cfbnn_all(  # at once, so under two folders (each run removes only the folders it made)
        {
            "refused": ["train", "regression", f"hydra.run.dir={tmp_path / 'new' / 'deeper' / 'run'}", "estimator=foo"],
            "missing": [
                "train", "regression", f"hydra.run.dir={tmp_path / 'other' / 'missing'}", *CSV_RUN, "data=csv",
                f"data.path={tmp_path / 'missing.csv'}", "data.target=y",
            ],
        }
    )  # fmt: skip
    refused, out = runs["refused"], runs["missing"]
    assert "estimator='foo'" in one_line_error(refused)
    assert "data file not found" in one_line_error(out)
    assert not list(tmp_path.iterdir())  # not even the folders above the run dir


@pytest.mark.slow
def test_a_refused_run_leaves_an_existing_dir_as_it_was_and_a_refused_sweep_no_job_dir(tmp_path, cfbnn):
    bad = tmp_path / "bad.csv"
    bad.write_text("a,y\n1,2\nx,3\n")
    # a run dir that was there (an earlier run's: a folder of other files is refused before this):
    # what it held stays, nothing is added (no log, no lock)
    kept = tmp_path / "kept"
    (kept / ".cfbnn").mkdir(parents=True)
    (kept / "notes.txt").write_text("mine")
    before = _contents(kept)
    out = cfbnn(
        "train", "regression", f"hydra.run.dir={kept}", *CSV_RUN, "data=csv", f"data.path={bad}", "data.target=y"
    )
    assert "is not a number" in one_line_error(out) and _contents(kept) == before
    # a sweep: each job's dir is its own, none is left (the sweep dir keeps Hydra's multirun.yaml)
    sweep = tmp_path / "sweep"
    out = cfbnn("train", "regression", "-m", "seed=0,1", f"hydra.sweep.dir={sweep}", "estimator=foo")
    assert "estimator='foo'" in one_line_error(out)
    assert sorted(p.name for p in sweep.iterdir()) == ["multirun.yaml"]


@pytest.mark.slow
def test_progress_bars_only_on_request_when_stderr_is_not_a_terminal(tmp_path, cfbnn):
    """CFBNN_PROGRESS=1 draws them into a file too (rate-limited); a bad value is one line."""
    args = ["train", "regression", f"hydra.run.dir={tmp_path / 'run'}", *TRUST_REGRESSION]
    shown = cfbnn(*args, env={"CFBNN_PROGRESS": "1"})
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "train: epoch 1/2" in shown.stderr
    bad = cfbnn(*args, "hydra.run.dir=" + str(tmp_path / "bad"), env={"CFBNN_PROGRESS": "maybe"})
    assert "CFBNN_PROGRESS='maybe' is not one of 1, 0, auto" in one_line_error(bad)
    assert not (tmp_path / "bad").exists()
