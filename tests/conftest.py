"""Shared fixtures: Hydra's global state, the CLI as a subprocess, small configs of each command.

The tests mirror the package (``tests/moments``, ``tests/bnn``, ``tests/pipelines``, ...);
builders two modules need live here as fixtures, not in a test module another imports.
"""

import os
import subprocess
import sys

import pytest

from cfbnn_cli.cli import _before_torch_loads, compose_config

# the CLI's OpenMP setting for this process too, before torch loads: idle torch threads spin only
# briefly, so that the tests' in-process work does not fight whatever else runs on the 2 cores (the
# suite's own CLI subprocesses, another job): on a busy 2-core machine OpenMP's default spin made a
# tiny `train regression` in process take 5-8x its time (test_table1's four runs: 68 s -> 10 s)
_before_torch_loads()

import torch  # noqa: E402  (after the OpenMP setting above)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# small but real settings of each command (seconds, not minutes, on 2 cores)
TINY_REGRESSION = [
    "data.n_train=400",
    "data.n_test=100",
    "data.input_dim=8",
    "model.hidden_sizes=[16,16]",
    "trainer.epochs=3",
    "trainer.batch_size=100",
    "trainer.lr=0.01",
    "gradient_variance.num_samples=300",
    "gradient_variance.batch_size=100",
    "evaluation.num_samples=4",
    "device=cpu",
]
SMALL_UCI = [
    "experiment=uci",
    "data=synthetic",
    "data.input_dim=4",
    "data.n_train=160",
    "data.n_test=40",
    "data.noise_std=0.3",
    "uci.n_splits=2",
    "trainer.epochs=60",
    "model.hidden_sizes=[16]",
    "uci.predictive_samples=64",
    "uci.validation_samples=16",
    "uci.patience=10",
    "uci.evaluate_every=2",
    "uci.max_iterations=1500",
    "uci.timing_repeats=2",
    "trainer.batch_size=32",
    "device=cpu",
]
TINY_VAE = [
    "data=synthetic",
    "data.input_dim=6",
    "data.rows=300",
    "model.encoder_hidden=[16,16]",
    "model.latent_dim=2",
    "model.decoder_hidden=12",
    "trainer.epochs=4",
    "trainer.batch_size=25",
    "trainer.lr=0.01",
    "evaluation.inner_samples=8",
    "evaluation.trials=3",
    "device=cpu",
]
TINY_IMAGENET = [
    "model.hidden_sizes=[32,32]",
    "trainer.epochs=3",
    "trainer.batch_size=64",
    "trainer.lr=0.01",
    "evaluation.total_samples=64",
    "evaluation.inner_samples=[1,4,16,64]",
    "evaluation.timing_images=64",
    "device=cpu",
    "evaluation.paper_head_timing=false",  # ~2.5 s on the CPU; one test turns it on
]


# the trust tests' small `train regression` run (tests/test_trust*.py)
TRUST_REGRESSION = [
    "data.n_train=200",
    "data.n_test=50",
    "data.input_dim=4",
    "model.hidden_sizes=[8,8]",
    "trainer.epochs=2",
    "trainer.batch_size=50",
    "gradient_variance.num_samples=20",
    "gradient_variance.batch_size=50",
    "evaluation.num_samples=4",
    "device=cpu",
]


def one_line_error(out, code=2):
    """The text of a finished CLI process that exited ``code`` without a traceback."""
    text = out.stdout + out.stderr
    assert out.returncode == code, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    return text


def corrupt_record(record: dict, junk: list, rng) -> dict:
    """``record`` with one or two of its fields (or a nested dict's fields) set to a random ``junk``
    value, in place: the fuzz tests' mutation of a saved file's record."""
    for _ in range(int(rng.integers(1, 3))):
        holder = record
        key = str(rng.choice(sorted(holder)))
        if isinstance(holder[key], dict) and holder[key] and rng.random() < 0.7:
            holder = holder[key]
            key = str(rng.choice(sorted(holder)))
        holder[key] = junk[int(rng.integers(len(junk)))]
    return record


def finish_all(processes, timeout=300):
    """``{name: CompletedProcess}`` of processes started at once (``{name: Popen}``, text pipes)."""
    finished = {}
    for name, process in processes.items():
        stdout, stderr = process.communicate(timeout=timeout)
        finished[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return finished


# a valid record of a UCI run's progress file (uci_progress.json), which the trust tests vary
GOOD_PROGRESS_RECORD = {
    "split": 0,
    "method": "plain_mlp",
    "train_seconds": 1.0,
    "iterations": 3,
    "optimizer": "adam",
    "converged": False,
    "stopped_early": True,
    "test_ll": -1.0,
    "rmse": 0.5,
    "predict_seconds_per_1000": 0.01,
    "noise_std": 0.3,
    "equal_time_test_ll": None,
}


def small_model_file(path):
    """A model file at ``path`` of a one-hidden-layer network (8 units) reading columns a, b, c."""
    import numpy as np

    from cfbnn_cli.bnn import ClosedFormBNN, save_model

    torch.manual_seed(0)
    return save_model(
        path,
        ClosedFormBNN(3, 8, init_scale=0.1).eval(),
        feature_mean=np.zeros(3),
        feature_std=np.ones(3),
        columns=["a", "b", "c"],
        target="y",
    )


@pytest.fixture(autouse=True)
def _clear_hydra():
    """Hydra keeps global state between compose/initialize calls; reset it around each test."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


def _compose(command, base, overrides):
    overrides = list(overrides)
    groups = {o.split("=", 1)[0] for o in overrides if "=" in o and "." not in o.split("=", 1)[0]}
    # another option of a group drops the base's keys of that group (they may not exist there)
    kept = [o for o in base if o.split("=", 1)[0].split(".")[0] not in groups]
    return compose_config(command, kept + overrides)


@pytest.fixture(scope="session")
def regression_cfg():
    """``regression_cfg(*overrides)``: a tiny Table 1 run's config (``train regression``)."""
    return lambda *overrides: _compose("train_regression", TINY_REGRESSION, overrides)


@pytest.fixture(scope="session")
def uci_cfg():
    """``uci_cfg(*overrides)``: a small UCI-protocol config (synthetic data, 2 splits)."""
    return lambda *overrides: _compose("train_regression", SMALL_UCI, overrides)


@pytest.fixture(scope="session")
def vae_cfg():
    """``vae_cfg(*overrides)``: a tiny ``cfbnn vae`` config (synthetic data)."""
    return lambda *overrides: _compose("vae", TINY_VAE, overrides)


@pytest.fixture
def imagenet_cfg(tmp_path):
    """``imagenet_cfg(*overrides)``: a tiny ``cfbnn imagenet-predict`` config (digits, cache under tmp_path)."""
    return lambda *overrides: _compose(
        "imagenet_predict", TINY_IMAGENET + [f"features.cache_dir={tmp_path / 'cache'}"], overrides
    )


@pytest.fixture(scope="session")
def tiny_overrides():
    """The small settings of each command, as command-line overrides."""
    return {"train_regression": TINY_REGRESSION, "uci": SMALL_UCI, "vae": TINY_VAE, "imagenet_predict": TINY_IMAGENET}


@pytest.fixture
def cfbnn():
    """``cfbnn(*args, timeout=..., env=...)``: the command in a subprocess (one-line errors, no traceback)."""

    def run(*args, timeout=600, env=None, cwd=None):
        environment = dict(os.environ, HYDRA_FULL_ERROR="0", **(env or {}))
        return subprocess.run(
            [sys.executable, "-m", "cfbnn_cli.cli", *args],
            capture_output=True,
            text=True,
            env=environment,
            timeout=timeout,
            cwd=cwd,
        )

    return run


@pytest.fixture
def cfbnn_all():
    """``cfbnn_all({name: args}, env=...)``: independent CLI runs started at once (the 2 cores
    share their imports), ``{name: CompletedProcess}`` as ``cfbnn`` gives each."""

    def run(commands, timeout=600, env=None):
        environment = dict(os.environ, HYDRA_FULL_ERROR="0", **(env or {}))
        processes = {
            name: subprocess.Popen(
                [sys.executable, "-m", "cfbnn_cli.cli", *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=environment,
            )
            for name, args in commands.items()
        }
        return finish_all(processes, timeout=timeout)

    return run


@pytest.fixture
def interrupt_on_call(monkeypatch):
    """``interrupt_on_call(owner, name, call)``: replace ``owner.name`` so that its ``call``-th
    call raises KeyboardInterrupt (a run stopped mid-way, as Ctrl-C would); returns a function
    that puts the original back (for the resumed run)."""

    def install(owner, name: str, call: int):
        original, calls = getattr(owner, name), {"n": 0}

        def interrupting(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == call:
                raise KeyboardInterrupt
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, interrupting)
        return lambda: monkeypatch.setattr(owner, name, original)

    return install
