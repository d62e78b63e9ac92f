"""Trust, inputs: every value, file and record the CLI reads either gives the correct result or
one named error (one line on stderr, exit 2) -- bounds on numeric keys, malformed CSV/NPZ
files, checkpoints, feature shards and progress records of the wrong structure, bad
``results.json`` files for ``cfbnn report``, Ctrl-C -- and a fuzz test feeds random bytes and
random JSON structures to each reader. Each case first reproduces what the issue "Trust,
second pass" saw (a traceback, a hang, a silent acceptance)."""

import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import GOOD_PROGRESS_RECORD, finish_all
from conftest import TRUST_REGRESSION as SMALL

from cfbnn_cli.cli import compose_config
from cfbnn_cli.data.regression import tabular_file
from cfbnn_cli.pipelines.imagenet import features as feature_cache
from cfbnn_cli.pipelines.regression.uci_protocol import read_progress
from cfbnn_cli.report.aggregate import report
from cfbnn_cli.report.records import collect
from cfbnn_cli.runtime.checkpoints import load_checkpoint, restore_training_state, save_training_state
from cfbnn_cli.runtime.checks import validate_common
from cfbnn_cli.runtime.errors import CfbnnError, CheckpointError, ConfigError, DataError
from cfbnn_cli.runtime.rundir import claim_run_dir

CSV_SMALL = [
    "data=csv",
    "protocol=gradient_variance",  # the Table 1 study on a file: its own keys below
    "data.target=y",
    "model.hidden_sizes=[8]",
    "trainer.epochs=1",
    "trainer.batch_size=4",
    "gradient_variance.num_samples=4",
    "gradient_variance.batch_size=4",
    "evaluation.num_samples=2",
    "device=cpu",
]


def _command(*args):
    return [sys.executable, "-m", "cfbnn_cli.cli", *args]


# ----------------------------------------------------------------------------- one line, exit 2, for every case


def _write_inputs(folder: Path):
    """The files of the CLI cases: a 1-column CSV, an NPZ with a 3-D x, a file where a run dir
    would go."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "one_column.csv").write_text("y\n1\n2\n3\n4\n5\n6\n7\n8\n")
    np.savez(folder / "three_d.npz", x=np.ones((12, 2, 2)), y=np.arange(12.0))
    (folder / "a_file").write_text("not a folder\n")


def _cli_cases(folder: Path):
    return {
        "1-column CSV": ["train", "regression", *CSV_SMALL, f"data.path={folder / 'one_column.csv'}"],
        "3-D x in an NPZ": ["train", "regression", *CSV_SMALL, f"data.path={folder / 'three_d.npz'}"],
        "hidden_sizes=-5": ["train", "regression", *SMALL, "model.hidden_sizes=-5"],
        "20-digit seed": ["train", "regression", *SMALL, "seed=99999999999999999999"],
        "run dir is a file": ["train", "regression", *SMALL, f"hydra.run.dir={folder / 'a_file'}"],
    }


EXPECTED = {
    "1-column CSV": "holds only the target `y`: no feature column",
    "3-D x in an NPZ": "array `x` has shape (12, 2, 2); it must be 2-D",
    "hidden_sizes=-5": "model.hidden_sizes=-5 must be a non-empty list of positive integers",
    "20-digit seed": "seed=99999999999999999999 must be <= 4294967295",
    "run dir is a file": "a file is in the way; choose another hydra.run.dir",
}


@pytest.fixture(scope="module")
def cli_outcomes(tmp_path_factory):
    """Every CLI case started at once (each fails before any work; most of their time is imports)."""
    folder = tmp_path_factory.mktemp("cli_cases")
    _write_inputs(folder)
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    processes = {}
    for index, (name, args) in enumerate(_cli_cases(folder).items()):
        run = [f"hydra.run.dir={folder / 'runs' / f'case{index}'}"] if "run dir" not in name else []
        processes[name] = subprocess.Popen(
            _command(*args, *run), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=folder
        )
    return finish_all(processes)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_each_bad_input_is_one_line_on_stderr_and_exit_2(cli_outcomes, case):
    out = cli_outcomes[case]
    code, stdout, stderr = out.returncode, out.stdout, out.stderr
    assert code == 2, (code, stderr[-3000:])
    assert "Traceback" not in stdout + stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("cfbnn: error:")]
    assert len(errors) == 1 and EXPECTED[case] in errors[0], stderr[-2000:]
    assert [line for line in stderr.splitlines() if line.strip()] == errors  # that line alone
    assert "cfbnn: error" not in stdout  # errors go to stderr only


def test_a_run_refused_by_its_data_leaves_no_run_dir(cli_outcomes, tmp_path_factory):
    """A data error raised before any output (the 1-column CSV): one line, and no run dir left
    behind (Hydra made it for this run); tests/test_trust.py covers a failure after an output."""
    folder = next(p for p in tmp_path_factory.getbasetemp().glob("cli_cases*"))
    assert "holds only the target `y`" in cli_outcomes["1-column CSV"].stderr
    assert not (folder / "runs" / "case0").exists()


# ----------------------------------------------------------------------------- readers, in process


def test_an_unreadable_csv_is_a_named_error(tmp_path, monkeypatch):
    path = tmp_path / "locked.csv"
    path.write_text("a,y\n1,2\n2,3\n3,5\n4,4\n")
    path.chmod(0)
    if os.geteuid() == 0:  # root reads any file: make the read fail as it does for other users
        real = Path.read_bytes
        monkeypatch.setattr(
            Path,
            "read_bytes",
            lambda self: (
                (_ for _ in ()).throw(PermissionError(13, "Permission denied")) if self == path else real(self)
            ),
        )
    with pytest.raises(
        DataError, match="cannot read .*locked.csv \\(Permission denied\\); check the file's permissions"
    ):
        tabular_file(path, "y")


@pytest.mark.parametrize(
    "arrays, message",
    [
        (dict(x=np.array([[1, 2]] * 6, dtype=object), y=np.arange(6.0)), "array `x` holds Python objects"),
        (dict(x=np.arange(6.0), y=np.arange(6.0)), r"array `x` has shape \(6,\)"),
        (dict(x=np.ones((6, 2)), y=np.arange(4.0)), "`x` has 6 rows and the target `y` 4"),
        (dict(x=np.array([["a", "b"]] * 6), y=np.arange(6.0)), "array `x` is of type <U1, not numeric"),
        (dict(x=np.ones((6, 2, 2)), y=np.arange(6.0)), r"array `x` has shape \(6, 2, 2\)"),
        (dict(a=np.ones(6), b=np.ones(5), y=np.arange(6.0)), r"column arrays have \[5, 6\] rows"),
        (dict(a=np.ones((6, 2)), y=np.arange(6.0)), r"column array `a` has shape \(6, 2\)"),
        (dict(x=np.ones((6, 2)), y=np.ones((6, 2))), r"target `y` has shape \(6, 2\)"),
        (dict(x=np.ones((6, 2))), "no array named `y`"),
    ],
)
def test_malformed_npz_files_are_named_errors(tmp_path, arrays, message):
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError, match=message):
        tabular_file(path, "y")


@pytest.mark.parametrize(
    "content, message",
    [
        (b"PK\x03\x04 this is not a zip", "is not a readable .npz archive"),
        (b"hello", "is not a readable .npz archive"),
        (None, "holds a single array, not an .npz archive"),
    ],
)
def test_a_file_that_is_not_an_npz_archive_is_a_named_error(tmp_path, content, message):
    path = tmp_path / "data.npz"
    if content is None:
        with open(path, "wb") as handle:
            np.save(handle, np.ones(3))
    else:
        path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        tabular_file(path, "y")


def test_a_good_npz_still_loads_both_ways(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "xy.npz", x=rng.normal(size=(20, 3)), y=rng.normal(size=20))
    np.savez(tmp_path / "columns.npz", a=rng.normal(size=20), b=rng.normal(size=20), y=rng.normal(size=(20, 1)))
    assert tabular_file(tmp_path / "xy.npz", "y").input_dim == 3
    assert tabular_file(tmp_path / "columns.npz", "y").input_dim == 2


def _state(**changes):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters())
    return model, optimizer, changes


@pytest.mark.parametrize(
    "change, message",
    [
        ({"epoch": -3}, "its epoch is -3"),
        ({"epoch": "x"}, "its epoch is 'x'"),
        ({"epoch": True}, "its epoch is True"),
        ({"generators": {"data_order": 1}}, "generator states are not byte tensors"),
        ({"model": [1, 2]}, "its model is a list"),
        ({"optimizer": None}, "its optimizer is a NoneType"),
    ],
)
def test_a_training_checkpoint_with_bad_contents_is_one_named_error(tmp_path, change, message):
    model, optimizer, _ = _state()
    generator = torch.Generator().manual_seed(0)
    path = tmp_path / "last.pt"
    save_training_state(path, model, optimizer, 2, {"data_order": generator}, "f")
    state = torch.load(path, weights_only=True)
    state.update(change)
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=message):
        restore_training_state(path, model, optimizer, {"data_order": generator}, "cpu", "f")


def _progress(tmp_path, records):
    path = tmp_path / "uci_progress.json"
    path.write_text(json.dumps({"config_fingerprint": "f", "records": records}))
    return path


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rmse": None}, "rmse is missing, not a number"),  # was averaged over the splits that had it
        ({"split": -1}, "split -1 is not a non-negative integer"),
        ({"split": True}, "split True is not a non-negative integer"),
        ({"iterations": 2.5}, "iterations 2.5 is not a count"),
        ({"converged": "yes"}, "converged is not true/false"),
        ({"method": "nope"}, "method 'nope' is not one of"),
    ],
)
def test_a_progress_record_with_bad_contents_is_one_named_error(tmp_path, change, message):
    record = {k: v for k, v in {**GOOD_PROGRESS_RECORD, **change}.items() if v is not None or k == "equal_time_test_ll"}
    with pytest.raises(CheckpointError, match=message):
        read_progress(_progress(tmp_path, [record]), "f", 2, ["plain_mlp"])
    assert read_progress(_progress(tmp_path, [GOOD_PROGRESS_RECORD]), "f", 2, ["plain_mlp"]) == [GOOD_PROGRESS_RECORD]
    with pytest.raises(CheckpointError, match="appears twice"):
        read_progress(_progress(tmp_path, [GOOD_PROGRESS_RECORD, GOOD_PROGRESS_RECORD]), "f", 2, ["plain_mlp"])


def _shard_folder(tmp_path, shards, fields):
    folder = tmp_path / "features"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"fields": fields}))
    for index, shard in enumerate(shards):
        torch.save(shard, folder / f"train_{index:05d}.pt")
    return folder


def _shard(rows=4, width=3, labels=None):
    return {
        "features": torch.ones(rows, width, dtype=torch.float16),
        "labels": torch.arange(rows) % 2 if labels is None else labels,
        "ok": torch.ones(rows, dtype=torch.bool),
    }


@pytest.mark.parametrize(
    "shards, message",
    [
        ([{"a": 1}], "lacks the tensors features, labels and ok"),
        ([{**_shard(), "features": torch.ones(4)}], r"its features are \(4,\)"),
        ([{**_shard(), "labels": torch.ones(4)}], "its labels are not one integer per row"),
        ([{**_shard(), "ok": torch.ones(3, dtype=torch.bool)}], "have 4, 4 and 3 rows"),
        ([_shard(), _shard(width=5)], r"shards hold features of widths \[3, 5\]"),
        ([_shard(labels=torch.tensor([0, 1, 1000000, 0]))], "labels run from 0 to 1000000, outside the 2 classes"),
        # a NaN in a cached shard is the cache's fault, not the learning rate's
        (
            [{**_shard(), "features": torch.tensor([[1.0, 2, 3], [1, float("nan"), 3], [1, 2, 3], [1, 2, 3]])}],
            r"its features hold NaN or infinite values \(rows \[1\]\)\); delete",
        ),
    ],
)
def test_a_feature_shard_of_the_wrong_structure_is_one_named_error(tmp_path, shards, message):
    folder = _shard_folder(tmp_path, shards, {"data": "toy"})
    rows = 4 * len(shards)
    with pytest.raises(CheckpointError, match=message):
        feature_cache.extract([None] * rows, "train", None, folder, {"data": "toy"}, "cpu", shard_size=4, num_classes=2)


def test_good_feature_shards_still_load(tmp_path):
    folder = _shard_folder(tmp_path, [_shard(), _shard()], {"data": "toy"})
    features, labels, skipped = feature_cache.extract(
        [None] * 8, "train", None, folder, {"data": "toy"}, "cpu", shard_size=4, num_classes=2
    )
    assert features.shape == (8, 3) and labels.tolist() == [0, 1] * 4 and skipped == 0


# ----------------------------------------------------------------------------- numeric keys are bounded


@pytest.mark.parametrize(
    "override, message",
    [
        ("runtime.threads=1000000", "more than 4 per core"),
        ("seed=4294967296", "must be <= 4294967295"),
        ("data.n_train=-3", "data.n_train=-3 must be >= 2"),  # was accepted: 994 rows trained, 3 tested, "complete"
        ("data.input_dim=0", "data.input_dim=0 must be >= 1"),
        ("model.hidden_sizes=[8,0]", r"model.hidden_sizes=\[8, 0\] must be a non-empty list"),
        ("data.n_test=0", "data.n_test=0 must be >= 1"),
        ("data.noise_std=-1", "data.noise_std=-1 must be a finite number >= 0"),
        ("data.seed=-1", "data.seed=-1 must be >= 0"),
    ],
)
def test_numeric_keys_out_of_range_are_refused_before_any_work(override, message):
    from cfbnn_cli.pipelines.regression import validate

    cfg = compose_config("train_regression", [*SMALL, override])
    with pytest.raises(ConfigError, match=message):
        validate_common(cfg)
        validate(cfg)


@pytest.mark.parametrize(
    "command, override, message",
    [
        ("vae", "model.encoder_hidden=-5", "model.encoder_hidden=-5 must be a non-empty list"),  # was a TypeError
        ("vae", "data.rows=0", "data.rows=0 must be >= 10"),
        ("vae", "data.noise_std=-0.1", "data.noise_std=-0.1 must be a finite number >= 0"),
        ("imagenet_predict", "model.hidden_sizes=-5", "model.hidden_sizes=-5 must be a non-empty list"),
        ("imagenet_predict", "model.hidden_sizes=[8]", r"must be two positive widths"),
        ("imagenet_predict", "data.train_size=0", "data.train_size=0 must be >= 1"),
        ("imagenet_predict", "data.train_fraction=1.5", "data.train_fraction=1.5 must be a number between 0 and 1"),
        ("imagenet_predict", "split.seed=-2", "split.seed=-2 must be >= 0"),
    ],
)
def test_every_commands_sizes_and_data_keys_are_bounded(command, override, message):
    from cfbnn_cli.pipelines import imagenet, vae

    data = ["data=synthetic"] if command == "vae" else []
    cfg = compose_config(command, [*data, override])
    with pytest.raises(ConfigError, match=message):
        (vae if command == "vae" else imagenet).validate(cfg)


# ----------------------------------------------------------------------------- cfbnn report


def _results(folder, metrics=None, config=None, pipeline="train_regression"):
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "pipeline": pipeline,
        "schema": 1,
        "status": "complete",
        "config": {"seed": 0} if config is None else config,
        "metrics": {"final_test_rmse": 1.0} if metrics is None else metrics,
    }
    (folder / "results.json").write_text(json.dumps(record))
    return folder / "results.json"


def test_report_skips_and_names_every_unreadable_record_and_counts_only_contributing_runs(tmp_path, capsys):
    root = tmp_path / "runs"
    _results(root / "good0", config={"seed": 0})
    _results(root / "good1", {"final_test_rmse": 3.0}, config={"seed": 1})
    (root / "deep").mkdir(parents=True)
    (root / "deep" / "results.json").write_text("[" * 100000 + "]" * 100000)
    _results(root / "config_string", config="seed=0")
    _results(root / "config_list", config=[1, 2])
    (root / "huge").mkdir()
    (root / "huge" / "results.json").write_text(
        '{"pipeline": "train_regression", "config": {"seed": 2}, "metrics": {"final_test_rmse": 1' + "0" * 400 + "}}"
    )
    _results(root / "seed_list", config={"seed": [1]})
    _results(root / "all_nan", {"final_test_rmse": float("nan")}, config={"seed": 5})
    (root / "loop").mkdir()
    (root / "loop" / "results.json").symlink_to(root / "loop" / "results.json")
    (root / "fifo").mkdir()
    os.mkfifo(root / "fifo" / "results.json")
    done = threading.Event()
    outcome = {}

    def run():
        outcome["written"] = report(root)
        done.set()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    assert done.wait(120), "cfbnn report hangs (a FIFO named results.json)"
    err = capsys.readouterr().err
    for folder, reason in [
        ("deep", "nested"),
        ("config_string", "its config is a str"),
        ("config_list", "its config is a list"),
        ("huge", "an integer of 401 digits"),
        ("seed_list", "its seed is [1]"),
        ("all_nan", "every metric is NaN"),
        ("loop", "does not lead to a file"),
        ("fifo", "not a regular file"),
    ]:
        assert f"skipping {root / folder / 'results.json'}: " in err and reason in err, (folder, err)
    table = (root / "report_train_regression_table.md").read_text()
    assert "2 runs" in table  # the two that contributed, not the ten files
    summary = __import__("pandas").read_csv(root / "report_train_regression.csv")
    assert summary.loc[summary["metric"] == "final_test_rmse", "mean"].item() == pytest.approx(2.0)


def test_report_of_only_unusable_runs_is_an_error_naming_them(tmp_path, capsys):
    _results(tmp_path / "nan", {"a": float("nan"), "b": float("inf")})
    with pytest.raises(DataError, match="no results.json of a complete run"):
        report(tmp_path)
    assert f"skipping {tmp_path / 'nan' / 'results.json'}: every metric is NaN" in capsys.readouterr().err


def test_report_out_naming_a_file_is_one_line(tmp_path):
    _results(tmp_path / "runs" / "0")
    (tmp_path / "taken").write_text("mine\n")
    out = subprocess.run(
        _command("report", str(tmp_path / "runs"), "--out", str(tmp_path / "taken")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "--out" in out.stderr and "is a file, not a folder" in out.stderr
    assert (tmp_path / "taken").read_text() == "mine\n"


# ----------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_ends_with_one_line_and_exit_130_and_leaves_a_resumable_run(tmp_path):
    """Resuming from last.pt itself is tested by the kill -9 tests (tests/test_trust.py)."""
    run = tmp_path / "run"
    args = [
        "train",
        "regression",
        f"hydra.run.dir={run}",
        *SMALL,
        "trainer.epochs=150",
        "gradient_variance.num_samples=0",
        "gradient_variance.epochs=[]",
    ]
    process = subprocess.Popen(_command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (run / "checkpoints" / "last.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    assert [line for line in stderr.splitlines() if line.startswith("cfbnn:")] == [
        f"cfbnn: interrupted; the last checkpoint ({run / 'checkpoints' / 'last.pt'}) is kept: rerun with "
        "resume=true to continue"
    ]
    state = load_checkpoint(run / "checkpoints" / "last.pt")
    assert 1 <= state["epoch"] < 3000 and not (run / "done").exists()  # a finished epoch to resume from
    assert (run / ".cfbnn" / "lock").read_text() == ""  # the lock was released


# ----------------------------------------------------------------------------- fuzz


def _random_json(rng: random.Random, depth=0):
    kinds = ["int", "float", "str", "none", "bool", "nan", "huge"] + (["list", "dict"] * 2 if depth < 6 else [])
    kind = rng.choice(kinds)
    if kind == "list":
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "dict":
        keys = [
            "pipeline",
            "config",
            "metrics",
            "seed",
            "status",
            "records",
            "split",
            "method",
            "test_ll",
            "rmse",
            "config_fingerprint",
            "x",
            rng.choice("abcdefgh"),
        ]
        return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 5))}
    return {
        "int": lambda: rng.randint(-5, 5),
        "float": lambda: rng.uniform(-1e3, 1e3),
        "str": lambda: rng.choice(["", "a", "vae", "plain_mlp", "complete"]),
        "none": lambda: None,
        "bool": lambda: rng.random() < 0.5,
        "nan": lambda: float("nan"),
        "huge": lambda: 10 ** rng.randint(300, 500),
    }[kind]()


def _mutations(rng: random.Random, valid):
    """``valid`` with one random field replaced by a random structure, repeatedly."""
    record = json.loads(json.dumps(valid))
    node = record
    path = []
    while isinstance(node, (dict, list)) and node and rng.random() < 0.7:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append((node, key))
        node = node[key]
    if path:
        parent, key = path[-1]
        parent[key] = _random_json(rng)
    return record


def _feed(reader, payloads):
    """Each payload gives a result or a CfbnnError; anything else (a traceback) fails the test."""
    for payload in payloads:
        try:
            reader(payload)
        except CfbnnError:
            pass
        except Exception as error:  # noqa: BLE001 - the point: no other exception may escape
            raise AssertionError(f"{type(error).__name__}: {error} for input {str(payload)[:300]!r}") from error


def _bytes_payloads(rng: random.Random, count=60):
    return [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 400))) for _ in range(count)]


def test_fuzz_the_csv_reader(tmp_path):
    rng = random.Random(1)
    path = tmp_path / "data.csv"
    texts = [b for b in _bytes_payloads(rng)]
    alphabet = '0123456789.,-+eE \n"naiNfy;\t\xef'
    texts += ["y,a\n" + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200))) for _ in range(100)]

    def read(payload):
        path.write_bytes(payload if isinstance(payload, bytes) else payload.encode("utf-8", "surrogatepass"))
        data = tabular_file(path, "y")
        assert torch.isfinite(data.x_train).all() and torch.isfinite(data.y_train).all()

    _feed(read, texts)


def test_fuzz_the_npz_reader(tmp_path):
    rng = random.Random(2)
    path = tmp_path / "data.npz"
    payloads = _bytes_payloads(rng, 30)
    choices = [
        np.ones((6, 2)),
        np.arange(6.0),
        np.ones((6, 2, 2)),
        np.array(["a"] * 6),
        np.ones((0, 2)),
        np.array([1, 2], dtype=object),
        np.full((6, 2), np.nan),
        np.ones((5, 3)),
        np.arange(6) % 2,
    ]
    for _ in range(80):
        names = rng.sample(["x", "y", "a", "b"], rng.randint(0, 4))
        payloads.append({name: rng.choice(choices) for name in names})

    def read(payload):
        if isinstance(payload, bytes):
            path.write_bytes(payload)
        else:
            np.savez(path, **payload)
        data = tabular_file(path, "y")
        assert torch.isfinite(data.x_train).all()

    _feed(read, payloads)


def test_fuzz_the_checkpoint_readers(tmp_path):
    rng = random.Random(3)
    path = tmp_path / "last.pt"
    model, optimizer, _ = _state()
    generator = torch.Generator().manual_seed(0)
    save_training_state(
        path,
        model,
        optimizer,
        1,
        {"data_order": generator},
        "f",
        history=[{"epoch": 1}],
        best={"epoch": 1, "value": 0.5},
    )
    valid = torch.load(path, weights_only=True)
    payloads = _bytes_payloads(rng, 30)
    values = [
        1,
        -3,
        "x",
        None,
        [1],
        {"a": 1},
        torch.ones(2),
        torch.ones(3, dtype=torch.uint8),
        {"weight": torch.ones(9)},
    ]
    for _ in range(60):
        state = dict(valid)
        for key in rng.sample(sorted(state), rng.randint(1, 3)):
            if rng.random() < 0.3:
                del state[key]
            else:
                state[key] = rng.choice(values)
        payloads.append(state)

    def read(payload):
        if isinstance(payload, bytes):
            path.write_bytes(payload)
        else:
            torch.save(payload, path)
        load_checkpoint(path)
        restore_training_state(path, model, optimizer, {"data_order": generator}, "cpu", "f")

    _feed(read, payloads)


def test_fuzz_the_progress_record_reader(tmp_path):
    rng = random.Random(4)
    path = tmp_path / "uci_progress.json"
    valid = {"config_fingerprint": "f", "records": [GOOD_PROGRESS_RECORD, {**GOOD_PROGRESS_RECORD, "split": 1}]}
    payloads = _bytes_payloads(rng, 30) + [json.dumps(_random_json(rng)) for _ in range(60)]
    payloads += [json.dumps(_mutations(rng, valid)) for _ in range(150)]
    payloads.append("[" * 50000 + "]" * 50000)

    def read(payload):
        path.write_bytes(payload if isinstance(payload, bytes) else payload.encode())
        for record in read_progress(path, "f", 3, ["plain_mlp"]):
            assert math.isfinite(record["rmse"]) or math.isnan(record["rmse"]) or math.isinf(record["rmse"])

    _feed(read, payloads)


def test_fuzz_the_results_and_run_dir_records(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from cfbnn_cli.report import section_figures

    def drawn_not_encoded(fig, path, layout=True):  # the records are fuzzed, not the PNG encoder (~0.1 s a figure)
        plt.close(fig)
        return Path(path).name

    monkeypatch.setattr(section_figures, "save_figure", drawn_not_encoded)
    rng = random.Random(5)
    root = tmp_path / "runs"
    valid = {
        "pipeline": "train_regression",
        "schema": 1,
        "status": "complete",
        "config": {"seed": 0, "trainer": {"lr": 0.1}},
        "metrics": {"final_test_rmse": 1.0, "final_test_ll": -1.0},
    }
    payloads = _bytes_payloads(rng, 20) + [json.dumps(_random_json(rng)) for _ in range(40)]
    payloads += [json.dumps(_mutations(rng, valid)) for _ in range(120)]

    def read(payload):
        for name in ("0", "1"):
            (root / name).mkdir(parents=True, exist_ok=True)
        (root / "0" / "results.json").write_bytes(payload if isinstance(payload, bytes) else payload.encode())
        (root / "1" / "results.json").write_text(json.dumps({**valid, "config": {"seed": 1, "trainer": {"lr": 0.1}}}))
        collect(root)
        report(root, out=tmp_path / "out")

    _feed(read, payloads)
    cfg = compose_config("train_regression", SMALL)
    run = tmp_path / "run"
    (run / ".cfbnn").mkdir(parents=True)

    def claim(payload):
        (run / ".cfbnn" / "config.json").write_bytes(payload if isinstance(payload, bytes) else payload.encode())
        claim_run_dir(cfg, run)

    _feed(claim, _bytes_payloads(rng, 20) + [json.dumps(_random_json(rng)) for _ in range(40)] + ["[" * 50000])
