"""The one reader of tables (cfbnn_cli/data/layout.py, cells.py, frames.py, tabular.py), shared by
`cfbnn predict` and the library: columns found by name, the training file's layout taken, text
columns one-hot encoded or named all at once, numbers read the same from a CSV or a DataFrame."""

from __future__ import annotations

import gzip
import logging
import time

import numpy as np
import pandas as pd
import pytest
import torch

from cfbnn_cli.bnn import BayesianNetwork, CategoricalLikelihood, load_model, save_model
from cfbnn_cli.data.classification import ClassificationTable
from cfbnn_cli.data.layout import InputLayout
from cfbnn_cli.data.tabular import iter_feature_chunks, read_table
from cfbnn_cli.pipelines import predict as predict_pipeline
from cfbnn_cli.runtime.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def categorical_model(tmp_path_factory):
    """A regression model that reads `carat` and `depth` as numbers and `cut` one-hot (three
    levels), trained from a file that also had `id` (left out); random weights, fixed seed."""
    folder = tmp_path_factory.mktemp("reader")
    layout = InputLayout(["carat", "cut", "depth"], "price", {"cut": ["Fair", "Good", "Ideal"]}, ["id"])
    torch.manual_seed(0)
    network = BayesianNetwork(5, [8], init_scale=0.5)
    path = save_model(
        folder / "m.pt",
        network,
        feature_mean=[1.0, 0.3, 0.3, 0.4, 60.0],
        feature_std=[0.5, 0.4, 0.4, 0.5, 2.0],
        target_mean=4000.0,
        target_std=3000.0,
        layout=layout,
    )
    frame = pd.DataFrame(
        {
            "id": [f"r{i}" for i in range(6)],
            "carat": [0.3, 1.2, 0.7, 2.0, 0.5, 1.0],
            "cut": ["Ideal", "Fair", "Good", "Ideal", "Good", "Fair"],
            "depth": [61.0, 59.5, 62.3, 60.0, 63.1, 58.0],
            "price": [500, 5000, 2000, 15000, 900, 4000],
        }
    )
    return folder, path, frame


def _by_hand(path, frame):
    """The features written out by hand (one-hot `cut`), through the network directly."""
    saved = load_model(path)
    levels = ["Fair", "Good", "Ideal"]
    x = np.column_stack([frame["carat"], *[(frame["cut"] == level).astype(float) for level in levels], frame["depth"]])
    z = torch.as_tensor((x - saved.feature_mean.numpy()) / saved.feature_std.numpy(), dtype=torch.float32)
    prediction = saved.network.predict(z)
    return prediction.mean.double() * 3000.0 + 4000.0


def test_a_frame_is_read_by_name_in_any_order(categorical_model):
    _, path, frame = categorical_model
    saved = load_model(path)
    assert saved.inputs == ["carat", "cut", "depth"] and saved.columns[1:4] == ["cut=Fair", "cut=Good", "cut=Ideal"]
    ordered = saved.predict(frame[["carat", "cut", "depth"]]).mean
    shuffled = saved.predict(frame[["depth", "price", "cut", "id", "carat"]]).mean  # target, left-out id: ignored
    assert torch.equal(ordered, shuffled)
    torch.testing.assert_close(ordered, _by_hand(path, frame))
    assert torch.equal(saved(frame).mean, ordered)  # the model called on a frame is its predict
    # an array or tensor is read by position in the model's column order (text cells included)
    assert torch.equal(saved.predict(frame[["carat", "cut", "depth"]].to_numpy()).mean, ordered)


def test_a_frame_that_lacks_a_column_or_has_a_foreign_one_is_named(categorical_model):
    _, path, frame = categorical_model
    saved = load_model(path)
    with pytest.raises(ValueError, match=r"missing depth.*it reads carat, cut, depth"):
        saved.predict(frame.drop(columns="depth"))
    with pytest.raises(ValueError, match=r"not used by the model: colour \(leave them out first"):
        saved.predict(frame.assign(colour="E"))
    with pytest.raises(ValueError, match=r"`x`, column `carat`, row 3: 'heavy' is not a number"):
        saved.predict(frame.assign(carat=["0.3", "1.2", "heavy", "2", "0.5", "1"]))
    with pytest.raises(ValueError, match=r"`x`, column `cut`, row 2: level 'Premium' was not seen in training"):
        saved.predict(frame.assign(cut=["Ideal", "Premium", "Good", "Ideal", "Good", "Fair"]))
    # unseen='zeros': the unseen level's row gets every indicator 0 (the others unchanged)
    unseen = frame.assign(cut=["Ideal", "Premium", "Good", "Ideal", "Good", "Fair"])
    zeros = saved.predict(unseen, unseen="zeros").mean
    assert torch.equal(zeros[[0, 2, 3, 4, 5]], saved.predict(frame).mean[[0, 2, 3, 4, 5]])
    by_hand = frame.assign(cut="none of them")
    assert zeros[1] == _by_hand(path, by_hand)[1]


def test_any_numeric_dtype_and_any_strides_read_the_same(tmp_path):
    torch.manual_seed(1)
    save_model(tmp_path / "n.pt", BayesianNetwork(3, [4]), columns=["a", "b", "c"], target="y")
    saved = load_model(tmp_path / "n.pt")
    base = np.array([[1, 2, 0], [3, 4, 1], [5, 6, 1], [7, 8, 0]])
    reference = saved.predict(base.astype(np.float64)).mean
    frame = pd.DataFrame(
        {
            "c": pd.array([0, 1, 1, 0], dtype="boolean"),
            "a": np.array([1, 3, 5, 7], dtype=np.uint8),
            "b": pd.array([2, 4, 6, 8], dtype="Int64"),
        }
    )
    assert torch.equal(saved.predict(frame).mean, reference)
    for dtype in (np.int32, np.float16, np.float32, np.int64):
        assert torch.equal(saved.predict(base.astype(dtype)).mean, reference)
    reversed_rows = base[::-1].astype(np.float64)  # a negative stride
    assert torch.equal(saved.predict(reversed_rows).mean, reference.flip(0))
    assert torch.equal(saved.predict(np.asfortranarray(base)).mean, reference)
    assert torch.equal(saved.predict(torch.as_tensor(base).T.contiguous().T).mean, reference)
    with pytest.raises(ValueError, match=r"`x` must be \(N, 3\) rows of the model's columns"):
        saved.predict(base[:, :2])
    with pytest.raises(ValueError, match="not numbers or text"):
        saved.predict(frame.assign(a=pd.to_datetime(["2020-01-01"] * 4)))


def test_predict_takes_the_training_files_layout_and_copies_only_what_is_kept(categorical_model, tmp_path):
    _, path, frame = categorical_model
    frame.to_csv(tmp_path / "new.csv", index=False)  # the training file's layout: id and price there
    out = predict_pipeline.predict_run(path, tmp_path / "new.csv", out=tmp_path / "p.csv")
    written = pd.read_csv(out)
    assert list(written.columns[:2]) == ["row", "mean"] and "id" not in written  # ignored, not copied
    np.testing.assert_allclose(written["mean"], load_model(path).predict(frame).mean.numpy(), rtol=1e-6)
    kept = pd.read_csv(predict_pipeline.predict_run(path, tmp_path / "new.csv", out=tmp_path / "k.csv", keep=["id"]))
    assert kept["id"].tolist() == frame["id"].tolist()
    for keep, message in (
        (["id", "id"], "--keep names id more than once"),
        (["mean"], "--keep mean: the output already has a column of that name"),
    ):
        with pytest.raises(DataError, match=message):
            predict_pipeline.predict_run(path, tmp_path / "new.csv", out=tmp_path / "x.csv", keep=keep)
    frame.rename(columns={"price": "mean", "id": "row"}).to_csv(tmp_path / "clash.csv", index=False)
    with pytest.raises(DataError, match=r"--keep row, mean: the output already has"):
        predict_pipeline.predict_run(path, tmp_path / "clash.csv", out=tmp_path / "x.csv", keep=["row", "mean"])
    frame.assign(colour="E").to_csv(tmp_path / "foreign.csv", index=False)
    with pytest.raises(DataError, match=r"not used by the model: colour \(copy them to the output with --keep"):
        predict_pipeline.predict_run(path, tmp_path / "foreign.csv", out=tmp_path / "x.csv")
    unseen = frame.assign(cut=["Ideal", "Premium", "Good", "Ideal", "Good", "Fair"])
    unseen.to_csv(tmp_path / "unseen.csv", index=False)
    with pytest.raises(DataError, match=r"column `cut`, row 2: level 'Premium' was not seen in training"):
        predict_pipeline.predict_run(path, tmp_path / "unseen.csv", out=tmp_path / "x.csv")
    zeros = pd.read_csv(
        predict_pipeline.predict_run(path, tmp_path / "unseen.csv", out=tmp_path / "z.csv", unseen="zeros")
    )
    np.testing.assert_allclose(zeros["mean"], load_model(path).predict(unseen, unseen="zeros").mean.numpy(), rtol=1e-6)
    assert not (tmp_path / "x.csv").exists()


def test_a_model_file_with_duplicate_class_names_is_refused(tmp_path):
    model = BayesianNetwork(2, [4], 3, likelihood=CategoricalLikelihood())
    save_model(tmp_path / "c.pt", model, classes=["a", "b", "c"])
    record = torch.load(tmp_path / "c.pt", weights_only=True)
    record["classes"] = ["a", "a", "b"]
    torch.save(record, tmp_path / "c.pt")
    with pytest.raises(DataError, match="`classes` names the same one twice"):
        load_model(tmp_path / "c.pt")


def test_a_large_target_offset_is_undone_in_float64(tmp_path):
    """A target near 1e12 with an s.d. of 1.2: float32 cannot resolve it, the float64 undo can."""
    torch.manual_seed(2)
    network = BayesianNetwork(1, [6], init_scale=0.3)
    save_model(tmp_path / "big.pt", network, target_mean=1e12, target_std=1.2, columns=["a"], target="y")
    x = np.linspace(-2, 2, 9)[:, None]
    pd.DataFrame({"a": x[:, 0]}).to_csv(tmp_path / "new.csv", index=False)
    written = pd.read_csv(predict_pipeline.predict_run(tmp_path / "big.pt", tmp_path / "new.csv"), dtype=float)
    with torch.no_grad():
        reference = network.predict(torch.as_tensor(x, dtype=torch.float32))
    expected = reference.mean.double().numpy() * 1.2 + 1e12
    assert written["mean"].nunique() == 9 and (written["upper_90"] - written["lower_90"] > 0.1).all()
    np.testing.assert_allclose(written["mean"] - 1e12, expected - 1e12, atol=1e-3)
    half_width = 1.6448536 * written["sd"]
    np.testing.assert_allclose(written["upper_90"] - written["mean"], half_width, rtol=1e-4, atol=1e-3)


def test_numeric_labels_are_compared_as_numbers(caplog):
    labels = np.array(["1", "1.0", "2", " 2", "01", "2.50"])
    with caplog.at_level(logging.WARNING):
        table = ClassificationTable("t", np.zeros((6, 1)), labels, ["a"], "label")
    assert table.classes == ["1", "2", "2.5"] and table.y.tolist() == [0, 0, 1, 1, 0, 2]
    assert "1, 1.0 -> 1" in caplog.text or "01, 1, 1.0 -> 1" in caplog.text


def _text_table(tmp_path, rows=30):
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(
        {
            "id": np.arange(1000, 1000 + rows),
            "name": [f"n{i}" for i in range(rows)],
            "cut": rng.choice(["Fair", "Good", "Ideal"], rows),
            "colour": rng.choice(["D", "E"], rows),
            "carat": rng.uniform(0.2, 2, rows).round(2),
            "price": rng.uniform(300, 9000, rows).round(),
        }
    )
    frame.to_csv(tmp_path / "t.csv", index=False)
    return frame


def test_every_text_column_is_named_at_once_with_the_drop_to_paste(tmp_path, caplog):
    frame = _text_table(tmp_path)
    with pytest.raises(DataError) as refused:
        read_table(tmp_path / "t.csv", "price", drop=["id"])
    message = str(refused.value)
    assert "column `name`, row 1: 'n0' is not a number; 3 column(s) hold text: name, cut, colour" in message
    assert "'data.drop=[id,name,cut,colour]'" in message and "'data.categorical=[name,cut,colour]'" in message
    # encoded: one indicator per level, levels sorted; the ID is named in one warning line
    with caplog.at_level(logging.WARNING):
        table = read_table(tmp_path / "t.csv", "price", drop=["name"], categorical=["cut", "colour"])
    assert table.columns == ["id", "cut=Fair", "cut=Good", "cut=Ideal", "colour=D", "colour=E", "carat"]
    np.testing.assert_array_equal(table.x[:, 1:4].argmax(1), pd.Categorical(frame["cut"]).codes)
    assert table.layout.left_out == ["name"] and table.layout.categorical["colour"] == ["D", "E"]
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1 and "id hold a different whole number in every row" in warning[0]
    assert "'data.drop=[name,id]'" in warning[0]
    # auto: the text columns with few levels; the one that is a name in every row still needs data.drop
    with pytest.raises(DataError, match=r"1 column\(s\) hold text: name.*'data.drop=\[id,name\]'"):
        read_table(tmp_path / "t.csv", "price", drop=["id"], categorical="auto")
    auto = read_table(tmp_path / "t.csv", "price", drop=["id", "name"], categorical="auto")
    assert sorted(auto.layout.categorical) == ["colour", "cut"]
    with pytest.raises(
        DataError, match=r"data.categorical names cutt, not among the feature columns.*did you mean cut"
    ):
        read_table(tmp_path / "t.csv", "price", drop=["name"], categorical=["cutt"])


def test_column_names_are_checked_with_suggestions_and_complete_lists(tmp_path):
    names = [f"column_{i}" for i in range(9)]
    pd.DataFrame(np.ones((3, 9)), columns=names).to_csv(tmp_path / "wide.csv", index=False)
    with pytest.raises(DataError, match="did you mean column_8") as refused:
        read_table(tmp_path / "wide.csv", "column8")
    assert ", ".join(names) in str(refused.value)  # every column, not the first 8
    with pytest.raises(ConfigError, match=r"data.features names column_1 more than once; give each column once"):
        read_table(tmp_path / "wide.csv", "column_0", features=["column_1", "column_1", "column_2"])


def test_gzip_infinite_cells_and_messages_without_numpy_reprs(tmp_path):
    frame = pd.DataFrame({"a": [1.0, 2.0, 3.0, 4.0], "b": ["1", "inf", "3", "4"], "y": [1.0, 2.0, 3.0, 5.0]})
    frame.to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(DataError) as refused:
        read_table(tmp_path / "t.csv", "y")
    assert "column `b`, row 2: 'inf' is not a finite number" in str(refused.value)
    assert "np.str_" not in str(refused.value)
    dropped = read_table(tmp_path / "t.csv", "y", missing="drop")  # an infinite cell counts as blank
    assert dropped.x[:, 1].tolist() == [1.0, 3.0, 4.0] and "blank (or infinite)" in dropped.notes[-1]
    with gzip.open(tmp_path / "t.csv.gz", "wt") as handle:
        frame.assign(b=["1", "2", "3", "4"]).to_csv(handle, index=False)
    table = read_table(tmp_path / "t.csv.gz", "y")
    assert table.name == "t" and table.x[:, 1].tolist() == [1.0, 2.0, 3.0, 4.0]
    _, chunks = iter_feature_chunks(tmp_path / "t.csv.gz", ["b", "a"], 2, "y", chunk_rows=3)
    assert np.concatenate([c.x for c in chunks])[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    (tmp_path / "broken.csv.gz").write_bytes(gzip.compress(b"a,y\n1,2\n")[:12])
    with pytest.raises(DataError, match="gzip-compressed but cannot be decompressed"):
        read_table(tmp_path / "broken.csv.gz", "y")


@pytest.mark.slow
def test_a_wide_table_is_read_in_linear_time(tmp_path):
    """200,000 columns, 5 rows: every lookup by name (a dict), the cells parsed as one array."""
    width = 200_000
    header = ",".join(f"c{i}" for i in range(width)) + ",y"
    row = ",".join(["1.5"] * width) + ",2"
    (tmp_path / "wide.csv").write_text("\n".join([header] + [row] * 5) + "\n")
    started = time.perf_counter()
    table = read_table(tmp_path / "wide.csv", "y", drop=["c7"])
    seconds = time.perf_counter() - started
    assert table.x.shape == (5, width - 1) and seconds < 30, seconds


def test_a_label_table_keeps_its_layout_and_a_skewed_target_gets_a_hint(tmp_path, caplog):
    from cfbnn_cli.cli import compose_config
    from cfbnn_cli.data.classification import load_classification_table
    from cfbnn_cli.data.regression import load_regression_table

    frame = _text_table(tmp_path)
    skewed = np.random.default_rng(1).lognormal(0.0, 1.0, len(frame))
    frame.assign(label=np.where(frame["carat"] > 1, "1.0", "2"), price=skewed).to_csv(tmp_path / "l.csv", index=False)
    base = ["data=csv", f"data.path={tmp_path / 'l.csv'}", "data.drop=[id,name]", "data.categorical=[cut,colour]"]
    cfg = compose_config("train_classification", [*base, "data.target=label", "data.drop=[id,name,price]"])
    table = load_classification_table(cfg.data)
    assert table.classes == ["1", "2"] and table.layout.categorical["cut"] == ["Fair", "Good", "Ideal"]
    assert table.layout.left_out == ["id", "name", "price"]
    with caplog.at_level(logging.INFO):
        cfg = compose_config("train_regression", [*base, "data.target=price", "data.drop=[id,name,label]"])
        load_regression_table(cfg.data)
    assert "positive and right-skewed" in caplog.text and "data.target_transform=log" in caplog.text
