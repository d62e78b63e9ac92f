"""Trust, memory: a run's memory is counted from its architecture (the covariance factors included)
and its rows before anything is allocated, and a model file's shapes before a network is built.
Each test builds the case the issue "Trust, fourth pass" reproduced -- a width of 900,000 that was
OOM-killed at 22 GB, a 4 KB model file that allocated 2.8 GB, a full-covariance file whose factors
the bound did not count, 10^7 draws for 10 rows, crafted weights that gave tracebacks -- and checks
the one-line refusal with the memory never spent (peak RSS measured, or a small machine-memory
figure injected; nothing really allocates gigabytes)."""

import copy
import os
import resource
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import one_line_error, small_model_file

from cfbnn_cli.bnn import BayesianNetwork, CategoricalLikelihood, load_model
from cfbnn_cli.bnn.model_file import architecture_of
from cfbnn_cli.cli import compose_config
from cfbnn_cli.pipelines import classification, predict
from cfbnn_cli.pipelines.regression import fit as regression_fit
from cfbnn_cli.runtime import memory
from cfbnn_cli.runtime.errors import ConfigError, DataError

GB = 10**9


def _small_machine(monkeypatch, available=4 * GB):
    """The memory this process may still take, as :func:`memory.available_bytes` would read it."""
    monkeypatch.setattr(memory, "available_bytes", lambda: available)


def test_a_width_the_machine_cannot_hold_is_refused_before_anything_is_allocated(tmp_path, monkeypatch):
    """`model.hidden_sizes=[900000]` on digits (within every count's bound): one line naming the
    key, the need and the fix, with nothing written and no gigabytes spent; the default recipe on the
    same small machine is not refused."""
    _small_machine(monkeypatch)
    cfg = compose_config("train_classification", ["model.hidden_sizes=[900000]", "device=cpu"])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ConfigError) as refused:
        classification.run(cfg, tmp_path)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024  # kB -> bytes
    message = str(refused.value)
    assert message.startswith("model.hidden_sizes=[900000] (135,000,020 parameters"), message
    assert "needs about" in message and "4 GB available" in message and "lower model.hidden_sizes" in message
    assert "\n" not in message and grown < 0.5 * GB and not list(tmp_path.iterdir())
    from cfbnn_cli.bnn.footprint import require_fit_memory

    require_fit_memory("model.hidden_sizes=[50]", 64, [50], 10, rows=1797, prediction_rows=180, fix="-")


def test_a_full_covariance_fit_counts_its_factors(tmp_path, monkeypatch):
    _small_machine(monkeypatch)
    rows = np.random.default_rng(0).normal(size=(60, 4))
    table = tmp_path / "t.csv"
    table.write_text("a,b,c,y\n" + "\n".join(",".join(f"{v:.4f}" for v in row) for row in rows) + "\n")
    cfg = compose_config(
        "train_regression",
        [
            "data=csv",
            f"data.path={table}",
            "data.target=y",
            "fit.method=closed_form_full",
            "likelihood=normal",  # closed_form_full has no heteroscedastic form (the fit's default)
            "model.hidden_sizes=[20000]",
        ],
    )
    with pytest.raises(ConfigError, match=r"model.hidden_sizes=\[20000\] \(fit.method=closed_form_full\) \(800,"):
        regression_fit.run(cfg, tmp_path / "run")  # 800 M numbers: the output layer's 20001 x 20001 factor


def test_the_uci_protocol_counts_each_methods_network_before_writing_anything(tmp_path, monkeypatch):
    """The UCI protocol's widths are counted per method (the deep methods' own widths, a full
    covariance's factors) before its splits file is written; the default methods pass."""
    from cfbnn_cli.pipelines.regression import uci_protocol

    _small_machine(monkeypatch)
    common = ["experiment=uci", "data=boston", "uci.n_splits=1", "device=cpu"]
    for overrides, pattern in [
        (["model.hidden_sizes=[900000]"], r"^model.hidden_sizes=\[900000\] \(uci.methods: closed_form_diagonal\)"),
        (
            ["uci.methods=[deterministic_2_hidden]", "uci.deep_hidden_sizes=[12000,12000]"],
            r"^uci.deep_hidden_sizes=\[12000, 12000\] \(uci.methods: deterministic_2_hidden\)",
        ),
        (
            ["uci.methods=[closed_form_full]", "model.hidden_sizes=[20000]"],
            # 13 inputs: 20000 x (14 + 14 + 14 x 14) + 196 (mask), output 2 x 20001 + 2 x 20001^2 (factor, mask)
            r"\(804,600,200 parameters, the covariance factors included\)",
        ),
    ]:
        cfg = compose_config("train_regression", common + overrides)
        with pytest.raises(ConfigError, match=pattern):
            uci_protocol.run(cfg, tmp_path)
        assert not list(tmp_path.iterdir())
    cfg = compose_config("train_regression", common)
    table = uci_protocol.load_regression_table(cfg.data)
    uci_protocol._require_memory(cfg, uci_protocol.validate(cfg), table.x.shape[1], 455, 51, [])


def test_the_vaes_decoder_is_counted_before_it_is_built(tmp_path, monkeypatch):
    """The decoder's width within every count's bound, beyond the machine: one line naming both
    widths, nothing written; the paper's sizes pass on the same small machine."""
    from cfbnn_cli.pipelines import vae

    _small_machine(monkeypatch)
    cfg = compose_config("vae", ["model.decoder_hidden=900000", "device=cpu"])
    with pytest.raises(ConfigError, match=r"^model.encoder_hidden=\[500, 500\], model.decoder_hidden=900000 on 64 "):
        vae.run(cfg, tmp_path)
    assert not list(tmp_path.iterdir())
    vae._require_memory(compose_config("vae", ["device=cpu"]), 784)  # Fashion-MNIST's size, the paper's widths


def test_table_1s_study_counts_its_network_before_building_it(tmp_path, monkeypatch):
    from conftest import TRUST_REGRESSION

    from cfbnn_cli.pipelines import regression

    _small_machine(monkeypatch, 100 * 10**6)
    cfg = compose_config("train_regression", [*TRUST_REGRESSION, "model.hidden_sizes=[900000]"])
    with pytest.raises(ConfigError, match=r"model.hidden_sizes=\[900000\] on 4 input features \(12,600,00"):
        regression.run(cfg, tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow  # 15 s: the same through the command, under `ulimit -v` (the injected figure above by default)
def test_the_width_is_refused_through_the_command_under_a_memory_limit(tmp_path):
    limit = 8 * 2**30

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    out = subprocess.run(
        [sys.executable, "-m", "cfbnn_cli.cli", "train", "classification", "model.hidden_sizes=[900000]", "device=cpu",
         f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, preexec_fn=limited, env=dict(os.environ, HYDRA_FULL_ERROR="0"),
    )  # fmt: skip
    one_line_error(out)  # was: OOM-killed at 22 GB, exit 137, no message
    assert "model.hidden_sizes=[900000]" in out.stderr and "available" in out.stderr
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- model files


def _model_record(tmp_path):
    path = small_model_file(tmp_path / "good.pt")
    return path, torch.load(path, weights_only=True)


def _crafted(record, change):
    record = copy.deepcopy(record)
    weights = record["state_dict"]
    if change == "stride0":  # a (10^6, 10^6) view over one stored number
        weights["layers.0.loc"] = torch.zeros(1).expand(10**6, 10**6)
    elif change == "sparse":
        weights["layers.0.loc"] = weights["layers.0.loc"].to_sparse()
    elif change == "meta":
        weights["layers.0.loc"] = torch.empty(weights["layers.0.loc"].shape, device="meta")
    elif change in ("complex", "bool"):
        record["state_dict"] = {k: v.to(torch.complex64) if change == "complex" else v > 0 for k, v in weights.items()}
    elif change == "classes=None":  # a classifier's file without its class names
        classifier = BayesianNetwork(3, [8], 2, likelihood=CategoricalLikelihood("approximation"))
        record.update(task="classification", classes=None, state_dict=classifier.state_dict())
        record["architecture"] = architecture_of(classifier)
    elif change == "full covariance":  # 2,000 inputs, 1,000 units: 4 billion numbers in the factors
        record["architecture"].update(input_dim=2000, hidden_sizes=[1000], covariance=["full", "full"])
        record["scaling"].update(feature_mean=None, feature_std=None)
        record["columns"] = None
    return record


CRAFTED = {
    "stride0": "is a view of shape (1000000, 1000000) over fewer stored numbers",
    "sparse": "is a sparse_coo tensor, not a dense one",
    "meta": "holds no values (a meta tensor)",
    "complex": "holds complex64 values, not real floating-point weights",  # was: loaded with a warning
    "bool": "holds bool values, not real floating-point weights",  # was: loaded silently
    "classes=None": "`classes` is missing",
    "full covariance": "asks for 4,0",
}


@pytest.mark.parametrize("change", sorted(CRAFTED))
def test_a_crafted_model_file_is_one_named_error(tmp_path, change):
    _, record = _model_record(tmp_path)
    torch.save(_crafted(record, change), tmp_path / "crafted.pt")
    with pytest.raises(DataError) as refused:
        load_model(tmp_path / "crafted.pt")
    assert CRAFTED[change] in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


MEASURE = """
    import resource, sys, torch
    from cfbnn_cli.bnn import load_model
    from cfbnn_cli.runtime import memory
    from cfbnn_cli.runtime.errors import DataError
    load_model(sys.argv[1])  # a good file: everything imported and warm
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for path in sys.argv[2:]:
        try:
            load_model(path)
            print("LOADED", path)
        except DataError as error:
            print("REFUSED", str(error)[:300])
    print("GROWN_MB", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
    print("AVAILABLE_UNDER_LIMIT_MB", (memory.available_bytes() or 0) / 2**20)
"""


def _huge_claim(record):
    """A model file's record claiming input 300,000 and hidden 1,000 (its weights those of 3 x 8)."""
    huge = copy.deepcopy(record)
    huge["architecture"].update(input_dim=300_000, hidden_sizes=[1000])
    huge["scaling"].update(feature_mean=None, feature_std=None)
    huge["columns"] = None
    return huge


def test_a_model_files_shapes_are_compared_before_any_network_is_built(tmp_path, monkeypatch):
    """The 4 KB file claiming 300,000 inputs is refused without building its network (which alone
    is 2.4 GB): the network's constructor is never reached."""
    from cfbnn_cli.bnn import model_file

    _, record = _model_record(tmp_path)
    torch.save(_huge_claim(record), tmp_path / "huge.pt")
    assert (tmp_path / "huge.pt").stat().st_size < 8192

    def never(*args, **kwargs):
        raise AssertionError("a network was built before the file's shapes were compared")

    monkeypatch.setattr(model_file, "BayesianNetwork", never)
    with pytest.raises(
        DataError, match=r"'layers.0.loc' has shape \(8, 4\), the architecture gives it \(1000, 300001\)"
    ):
        load_model(tmp_path / "huge.pt")


@pytest.mark.slow  # 7-15 s (a fresh process imports torch): the peak memory itself; the test above by default
def test_a_4_kb_model_file_claiming_a_huge_network_is_refused_without_allocating_it(tmp_path):
    """Input 300,000 and hidden 1,000 in a 4 KB file: before, the network was built (2.8 GB) before its
    shapes were compared. Now the shapes are compared first: peak RSS grows by less than 0.5 GB (it
    does not grow). Run under an address-space limit, which the memory count also reads."""
    good, record = _model_record(tmp_path)
    torch.save(_huge_claim(record), tmp_path / "huge.pt")
    torch.save(_crafted(record, "full covariance"), tmp_path / "full.pt")
    assert (tmp_path / "huge.pt").stat().st_size < 8192
    status = open("/proc/self/status").read()
    limit = 6 * 2**30

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MEASURE), str(good), str(tmp_path / "huge.pt"), str(tmp_path / "full.pt")],
        capture_output=True, text=True, preexec_fn=limited if "VmSize" in status else None,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert "'layers.0.loc' has shape (8, 4), the architecture gives it (1000, 300001)" in out.stdout, out.stdout
    assert "LOADED" not in lines and float(lines["GROWN_MB"]) < 500, out.stdout
    if "VmSize" in status:  # Linux: the count sees the limit, not the machine's memory
        assert float(lines["AVAILABLE_UNDER_LIMIT_MB"]) < limit / 2**20, out.stdout


# ----------------------------------------------------------------------------- --num-samples


def test_num_samples_is_bounded_and_its_draws_counted(tmp_path, capsys, monkeypatch):
    good, _ = _model_record(tmp_path)
    (tmp_path / "new.csv").write_text("a,b,c\n" + "\n".join("0.1,0.2,0.3" for _ in range(10)) + "\n")
    common = [str(good), str(tmp_path / "new.csv"), "--out", str(tmp_path / "p.csv"), "--estimator", "sampling"]

    def one_line():
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    assert predict.main([*common, "--num-samples", "1000000000000"]) == 2  # was: a traceback
    assert "--num-samples 1000000000000 must be in 1..1,000,000" in one_line()
    with pytest.raises(SystemExit) as exit:  # was: argparse's usage block and `cfbnn predict: error:`
        predict.main([*common, "--num-samples", "1e12"])
    assert exit.value.code == 2
    assert one_line().startswith("cfbnn: error: argument --num-samples: '1e12' is not a whole number")
    _small_machine(monkeypatch, 50 * 10**6)  # 10^6 draws of 8 units held at once: 256 MB
    assert predict.main([*common, "--num-samples", "1000000"]) == 2  # was: 10^7 took 3.5 GB for 10 rows
    assert "--num-samples 1,000,000 (the model's widest layer has 8 units" in one_line()
    assert not (tmp_path / "p.csv").exists()


def test_the_memory_figure_reads_the_machine_and_the_process_limits():
    available = memory.available_bytes()
    meminfo = open("/proc/meminfo").read() if os.path.exists("/proc/meminfo") else ""
    if "MemAvailable" in meminfo:
        machine = int(meminfo.split("MemAvailable:")[1].split()[0]) * 1024
        assert 0 < available <= machine * 1.05  # the machine's, or less under a limit
    assert memory.format_bytes(77.1e9) == "77.1 GB" and memory.format_bytes(512) == "512 bytes"
