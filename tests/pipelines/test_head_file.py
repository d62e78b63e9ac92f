"""``head.pt`` (an ``imagenet-predict`` run's head): every malformed field is one DataError naming
the field (fuzzed, as the model file's reader is), and ``cfbnn predict`` on it refuses rows it
cannot classify instead of writing NaN probabilities."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import corrupt_record

from cfbnn_cli.bnn.network import bayesian_head
from cfbnn_cli.pipelines.imagenet import predict_new
from cfbnn_cli.pipelines.imagenet.head_file import HEAD_FILE, load_saved_head, save_head
from cfbnn_cli.runtime.errors import DataError

FEATURES, CLASSES = 6, 3


def _cfg():
    model = SimpleNamespace(hidden_sizes=[8, 8], activation="relu", prior_scale=1.0, init_scale=0.01)
    return SimpleNamespace(
        model=model, objective="approximation", data=SimpleNamespace(name="d"), backbone=SimpleNamespace(name="b")
    )


def _run_dir(tmp_path):
    """A finished run's dir holding a good head.pt."""
    torch.manual_seed(0)
    folder = tmp_path / "run"
    folder.mkdir(exist_ok=True)
    save_head(
        folder, bayesian_head(FEATURES, [8, 8], CLASSES), _cfg(), FEATURES, CLASSES, torch.zeros(6), torch.ones(6)
    )
    (folder / "done").write_text("")
    return folder


def _record(tmp_path):
    return torch.load(_run_dir(tmp_path) / HEAD_FILE, weights_only=True)


def _with(record, dotted, value):
    holder = record
    *parents, last = dotted.split(".")
    for part in parents:
        holder = holder[part]
    if value is _DELETE:
        del holder[last]
    else:
        holder[last] = value
    return record


_DELETE = object()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("architecture", _DELETE, "`architecture` is missing"),
        ("architecture.num_classes", _DELETE, "lacks num_classes"),
        ("architecture.activation", "swish", "architecture.activation is 'swish'"),
        ("architecture.hidden_sizes", "8,8", "architecture.hidden_sizes is '8,8', not a list of two widths"),
        ("architecture.hidden_sizes", [100_000_000_000, 8], r"architecture.hidden_sizes is 100000000000"),
        ("architecture.hidden_sizes", [1_000_000, 1_000_000], "asks for more than"),
        ("architecture.feature_dim", 6.0, "architecture.feature_dim is 6.0"),
        ("architecture.objective", None, "architecture.objective is None"),
        ("architecture.prior_scale", math.nan, "architecture.prior_scale is nan"),
        ("state_dict", [1, 2], "`state_dict` is not a mapping"),
        ("scaling.feature_std", torch.ones(5), r"scaling.feature_std is \(5,\), not 6 numbers"),
        ("scaling.feature_mean", torch.full((6,), math.nan), "scaling.feature_mean holds NaN"),
        ("scaling", "z", "`scaling` is missing or not a mapping"),
    ],
)
def test_each_malformed_field_of_a_head_file_is_one_named_error(tmp_path, field, value, message):
    record = _with(_record(tmp_path), field, value)
    torch.save(record, tmp_path / "bad.pt")
    with pytest.raises(DataError, match=message) as caught:
        load_saved_head(tmp_path / "bad.pt")
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400


def test_a_head_file_with_nan_weights_or_foreign_weights_is_one_named_error(tmp_path):
    record = _record(tmp_path)
    name = next(k for k, v in record["state_dict"].items() if v.is_floating_point())
    record["state_dict"][name] = torch.full_like(record["state_dict"][name], math.nan)
    torch.save(record, tmp_path / "nan.pt")
    with pytest.raises(DataError, match="holds NaN or infinite weights"):
        load_saved_head(tmp_path / "nan.pt")
    record = _record(tmp_path)
    record["state_dict"] = {"w": torch.zeros(3)}
    torch.save(record, tmp_path / "foreign.pt")
    with pytest.raises(DataError, match="does not fit the recorded architecture") as caught:
        load_saved_head(tmp_path / "foreign.pt")
    assert "\n" not in str(caught.value)


def test_head_file_reader_fuzz(tmp_path):
    """Random damage to the fields of a good record: loading either succeeds and classifies with
    finite probabilities, or is one DataError; nothing else escapes."""
    rng = np.random.default_rng(0)
    junk = [
        None,
        "x",
        -1,
        0,
        1e11,
        10**11,
        float("nan"),
        [],
        {},
        [1.5],
        [8],
        torch.zeros(0),
        torch.full((6,), math.inf),
    ]
    good = _record(tmp_path)
    for trial in range(150):
        record = corrupt_record({k: (dict(v) if isinstance(v, dict) else v) for k, v in good.items()}, junk, rng)
        torch.save(record, tmp_path / "fuzz.pt")
        try:
            model, _ = load_saved_head(tmp_path / "fuzz.pt")
        except DataError as error:
            assert "\n" not in str(error), trial
            continue
        mean, _ = model.output_moments(torch.zeros(2, FEATURES), estimator="analytic", noise=())
        assert torch.isfinite(mean).all(), trial


@pytest.mark.slow
def test_predict_refuses_features_that_give_no_finite_probabilities_naming_the_rows(tmp_path, cfbnn):
    folder = _run_dir(tmp_path)
    x = np.random.default_rng(0).normal(size=(4, FEATURES))
    x[[1, 3]] *= 1e20  # was: all-NaN probabilities, argmax 0, exit 0
    np.save(tmp_path / "far.npy", x)
    out = cfbnn("predict", str(folder), str(tmp_path / "far.npy"))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert "row(s) 2, 4 give no finite class probabilities" in out.stderr
    assert not (folder / "predictions.csv").exists()


def test_predict_on_zero_rows_is_one_line_and_exit_2(tmp_path):
    folder = _run_dir(tmp_path)
    np.save(tmp_path / "empty.npy", np.zeros((0, FEATURES)))  # was: a header-only file and exit 0
    assert predict_new.main([str(folder), str(tmp_path / "empty.npy")]) == 2
    assert not (folder / "predictions.csv").exists()


def test_predict_on_good_features_still_writes_probabilities(tmp_path):
    folder = _run_dir(tmp_path)
    np.save(tmp_path / "x.npy", np.random.default_rng(1).normal(size=(3, FEATURES)))
    assert predict_new.main([str(folder), str(tmp_path / "x.npy")]) == 0
    lines = (folder / "predictions.csv").read_text().splitlines()
    assert len(lines) == 4 and lines[0].startswith("row,argmax_mean,class_1,probability_1")


def test_ctrl_c_in_head_predict_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    folder = _run_dir(tmp_path)
    np.save(tmp_path / "x.npy", np.zeros((2, FEATURES)))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(predict_new, "approximate_class_probabilities", interrupted)
    assert predict_new.main([str(folder), str(tmp_path / "x.npy")]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["cfbnn: interrupted; no predictions were written"]
    assert not (folder / "predictions.csv").exists()
