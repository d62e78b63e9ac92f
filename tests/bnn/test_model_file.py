"""Models as files (cfbnn_cli/bnn/model_file.py): save_model / load_model round trips, the
scaling applied on the way in and out, a library-trained model through `cfbnn predict`, and
every malformed field one DataError (fuzzed), never a traceback."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch
from conftest import corrupt_record

from cfbnn_cli.bnn import BayesianNetwork, CategoricalLikelihood, ClosedFormBNN, load_model, save_model
from cfbnn_cli.pipelines import predict as predict_pipeline
from cfbnn_cli.runtime.errors import DataError


def _regression_model(seed=0):
    torch.manual_seed(seed)
    model = ClosedFormBNN(3, 16, init_scale=0.1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def test_a_saved_regression_model_predicts_in_original_units(tmp_path):
    model = _regression_model()
    mean, std = np.array([10.0, -2.0, 0.5]), np.array([2.0, 0.1, 4.0])
    path = save_model(
        tmp_path / "m.pt",
        model,
        feature_mean=mean,
        feature_std=std,
        target_mean=100.0,
        target_std=5.0,
        columns=["a", "b", "c"],
        target="price",
    )
    saved = load_model(path)
    assert saved.task == "regression" and saved.columns == ["a", "b", "c"] and saved.target == "price"
    rows = np.array([[12.0, -2.1, 0.0], [8.0, -1.9, 6.0]])
    got = saved.predict(rows)
    # by hand: standardize, the network's own predictive, back to the target's units
    z = torch.as_tensor((rows - mean) / std, dtype=torch.float32)
    reference = model.predict(z)
    # undone in float64: the network's float32 moments, scaled and shifted without rounding
    assert got.mean.dtype == torch.float64
    torch.testing.assert_close(got.mean, reference.mean.double() * 5.0 + 100.0)
    torch.testing.assert_close(got.variance, reference.variance.double() * 25.0)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(saved.network.state_dict()[name], tensor)


def test_a_library_trained_model_runs_through_cfbnn_predict(tmp_path):
    model = _regression_model(1)
    columns = ["a", "b", "c"]
    save_model(tmp_path / "m.pt", model, feature_mean=[1, 2, 3], feature_std=[1, 1, 2], columns=columns, target="y")
    rows = np.random.default_rng(0).normal(size=(7, 3))
    with open(tmp_path / "new.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "c", "a", "b"])
        writer.writerows([[f"r{i}", r[2], r[0], r[1]] for i, r in enumerate(rows)])
    assert predict_pipeline.main([str(tmp_path / "m.pt"), str(tmp_path / "new.csv"), "--keep", "id"]) == 0
    with open(tmp_path / "predictions.csv") as handle:
        written = list(csv.DictReader(handle))
    assert [r["id"] for r in written] == [f"r{i}" for i in range(7)]
    expected = load_model(tmp_path / "m.pt").predict(rows).mean.numpy()
    np.testing.assert_allclose([float(r["mean"]) for r in written], expected, rtol=1e-6)


@pytest.mark.parametrize("logistic", [False, True])
def test_a_saved_classifier_keeps_its_class_names(tmp_path, logistic):
    torch.manual_seed(0)
    classes = ["cat", "dog"] if logistic else ["a", "b", "c"]
    model = BayesianNetwork(
        4, [8], 1 if logistic else 3, likelihood=CategoricalLikelihood(logistic=logistic), init_scale=0.1
    )
    save_model(tmp_path / "c.pt", model, classes=classes)
    saved = load_model(tmp_path / "c.pt")
    assert saved.task == "classification" and saved.classes == classes
    distribution = saved.predict(np.zeros((5, 4)))
    assert isinstance(distribution, torch.distributions.Categorical)
    assert distribution.probs.shape == (5, len(classes))
    with pytest.raises(ValueError, match="distinct names, one per class"):
        save_model(tmp_path / "bad.pt", model, classes=["only"])


def _record(tmp_path):
    save_model(tmp_path / "good.pt", _regression_model(), columns=["a", "b", "c"])
    return torch.load(tmp_path / "good.pt", weights_only=True)


BREAKAGES = {
    "no architecture": lambda r: r.pop("architecture"),
    "a missing architecture key": lambda r: r["architecture"].pop("hidden_sizes"),
    "a bad activation": lambda r: r["architecture"].update(activation="tanh!"),
    "hidden sizes as a string": lambda r: r["architecture"].update(hidden_sizes="16"),
    "a width of 1e11": lambda r: r["architecture"].update(hidden_sizes=[10**11]),
    "a state dict as a list": lambda r: r.update(state_dict=[1, 2]),
    "a scaling of the wrong shape": lambda r: r["scaling"].update(feature_mean=torch.zeros(5)),
    "a string target mean": lambda r: r["scaling"].update(target_mean="100"),
    "a zero target s.d.": lambda r: r["scaling"].update(target_std=0.0),
    "NaN weights": lambda r: next(iter(r["state_dict"].values())).fill_(math.nan),
    "weights of another architecture": lambda r: r["architecture"].update(hidden_sizes=[17]),
    "columns of another length": lambda r: r.update(columns=["a"]),
    "an unknown estimator": lambda r: r.update(estimator="magic"),
    "a task that contradicts the likelihood": lambda r: r.update(task="classification"),
    "another format": lambda r: r.update(format="something.else"),
    "another version": lambda r: r.update(version=99),
}


@pytest.mark.parametrize("case", sorted(BREAKAGES))
def test_every_malformed_field_is_one_data_error(tmp_path, case):
    record = _record(tmp_path)
    BREAKAGES[case](record)
    torch.save(record, tmp_path / "bad.pt")
    with pytest.raises(DataError) as error:
        load_model(tmp_path / "bad.pt")
    assert str(tmp_path / "bad.pt") in str(error.value) and "\n" not in str(error.value)


def test_model_file_reader_fuzz(tmp_path):
    """Random damage to the fields of a good record: loading either succeeds and predicts finite
    numbers, or is one DataError; nothing else escapes."""
    rng = np.random.default_rng(0)
    junk = [None, "x", -1, 0, 1e300, float("nan"), [], {}, [1.5], torch.zeros(0), torch.full((3,), math.inf)]
    for trial in range(150):
        record = corrupt_record(_record(tmp_path), junk, rng)
        torch.save(record, tmp_path / "fuzz.pt")
        try:
            saved = load_model(tmp_path / "fuzz.pt")
        except DataError as error:
            assert "\n" not in str(error), trial
            continue
        assert torch.isfinite(saved.predict(np.zeros((2, 3))).mean).all(), trial


def test_a_version_1_regression_model_file_still_loads(tmp_path):
    record = _record(tmp_path)
    record.update(format="cfbnn.regression_model", version=1)
    for key in ("task", "classes"):
        record.pop(key)
    torch.save(record, tmp_path / "old.pt")
    assert load_model(tmp_path / "old.pt").task == "regression"


def test_save_model_refuses_what_could_not_predict(tmp_path):
    model = _regression_model()
    with pytest.raises(ValueError, match="3 distinct names"):
        save_model(tmp_path / "m.pt", model, columns=["a", "a", "b"])
    with pytest.raises(ValueError, match="feature_std` must be finite and positive"):
        save_model(tmp_path / "m.pt", model, feature_mean=[0, 0, 0], feature_std=[1, 0, 1])
    with torch.no_grad():
        model.layers[0].loc.fill_(math.nan)
    with pytest.raises(ValueError, match="non-finite weights"):
        save_model(tmp_path / "m.pt", model)
    assert not (tmp_path / "m.pt").exists()
