"""Tables as people have them (cfbnn_cli/data/tabular.py): an unnamed index column, chosen and
dropped columns, blank cells and text named by column and row, labels as text, and new rows
streamed in chunks."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from cfbnn_cli.data.tabular import held_out_split, iter_feature_chunks, read_table
from cfbnn_cli.runtime.errors import ConfigError, DataError


@pytest.fixture
def frame():
    rng = np.random.default_rng(3)
    return pd.DataFrame(
        {
            "patient_id": [f"P{i:03d}" for i in range(12)],
            "age": rng.integers(20, 80, 12).astype(float),
            "bmi": rng.normal(25, 3, 12).round(2),
            "y": rng.normal(size=12).round(3),
        }
    )


def test_a_pandas_index_column_is_recognised_and_left_out(frame, tmp_path):
    frame.drop(columns="patient_id").to_csv(tmp_path / "t.csv")  # pandas' default: an unnamed index column
    table = read_table(tmp_path / "t.csv", "y")
    assert table.columns == ["age", "bmi"]
    np.testing.assert_array_equal(table.x, frame[["age", "bmi"]].to_numpy())
    np.testing.assert_array_equal(table.y, frame["y"].to_numpy())
    assert any("row index" in note for note in table.notes)
    # written again after a round trip through pandas, the index column is called "Unnamed: 0"
    pd.read_csv(tmp_path / "t.csv").to_csv(tmp_path / "twice.csv", index=False)
    assert read_table(tmp_path / "twice.csv", "y").columns == ["age", "bmi"]


def test_a_text_column_is_named_with_its_row_and_data_drop_leaves_it_out(frame, tmp_path):
    frame.to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(
        DataError, match=r"column `patient_id`, row 1: 'P000' is not a number.*data.drop=\[patient_id\]"
    ):
        read_table(tmp_path / "t.csv", "y")
    assert read_table(tmp_path / "t.csv", "y", drop=["patient_id"]).columns == ["age", "bmi"]
    assert read_table(tmp_path / "t.csv", "y", features=["bmi"]).columns == ["bmi"]
    with pytest.raises(
        DataError,
        match=r"data.features names column\(s\) weight that the file does not have; it has patient_id, age, bmi, y",
    ):
        read_table(tmp_path / "t.csv", "y", features=["weight"])
    with pytest.raises(DataError, match=r"data.drop names column\(s\) id that"):
        read_table(tmp_path / "t.csv", "y", drop=["id"])
    with pytest.raises(ConfigError, match="not both"):
        read_table(tmp_path / "t.csv", "y", features=["bmi"], drop=["patient_id"])


def test_blank_cells_are_named_or_their_rows_dropped(frame, tmp_path):
    frame.loc[4, "bmi"] = np.nan
    frame.loc[7, "y"] = np.nan
    frame.to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(DataError, match=r"column `bmi`, row 5: blank.*2 of 12 rows.*data.missing=drop"):
        read_table(tmp_path / "t.csv", "y", drop=["patient_id"])
    table = read_table(tmp_path / "t.csv", "y", drop=["patient_id"], missing="drop")
    kept = frame.drop(index=[4, 7])
    np.testing.assert_array_equal(table.x, kept[["age", "bmi"]].to_numpy())
    np.testing.assert_array_equal(table.y, kept["y"].to_numpy())
    assert any("2 of 12 rows" in note for note in table.notes)
    with pytest.raises(ConfigError, match="data.missing='fill'"):
        read_table(tmp_path / "t.csv", "y", missing="fill")


def test_labels_may_be_text(frame, tmp_path):
    frame["y"] = ["yes", "no", " yes"] * 4
    frame.to_csv(tmp_path / "t.csv", index=False)
    table = read_table(tmp_path / "t.csv", "y", drop=["patient_id"], labels=True)
    assert table.y.tolist() == ["yes", "no", "yes"] * 4  # stripped of spaces


def test_new_rows_stream_in_chunks_with_the_same_values(frame, tmp_path):
    frame.loc[5, "age"] = np.nan
    frame[["bmi", "patient_id", "age"]].to_csv(tmp_path / "new.csv", index=False)
    passed, chunks = iter_feature_chunks(
        tmp_path / "new.csv", ["age", "bmi"], 2, "y", keep=["patient_id"], chunk_rows=5
    )
    chunks = list(chunks)
    assert passed == ["patient_id"] and [len(c.rows) for c in chunks] == [5, 5, 2]
    rows = np.concatenate([c.rows for c in chunks])
    x = np.concatenate([c.x for c in chunks])
    complete = np.concatenate([c.complete for c in chunks])
    assert rows.tolist() == list(range(1, 13))
    assert complete.tolist() == [i != 5 for i in range(12)]
    np.testing.assert_array_equal(x[complete], frame[["age", "bmi"]].to_numpy()[complete])
    assert [row[0] for c in chunks for row in c.passed] == frame["patient_id"].tolist()
    with pytest.raises(DataError, match=r"not used by the model: patient_id \(copy them to the output with --keep"):
        iter_feature_chunks(tmp_path / "new.csv", ["age", "bmi"], 2, "y")


def test_a_text_cell_in_new_rows_is_named_by_column_and_row(frame, tmp_path):
    frame["bmi"] = frame["bmi"].astype(object)
    frame.loc[8, "bmi"] = "heavy"
    frame[["age", "bmi"]].to_csv(tmp_path / "new.csv", index=False)
    _, chunks = iter_feature_chunks(tmp_path / "new.csv", ["age", "bmi"], 2, "y", chunk_rows=4)
    with pytest.raises(DataError, match=r"column `bmi`, row 9: 'heavy' is not a number"):
        list(chunks)


def test_the_held_out_split_is_a_permutation_from_the_seed():
    train, test = held_out_split(50, 0.2, seed=4)
    assert len(test) == 10 and sorted(np.concatenate([train, test]).tolist()) == list(range(50))
    order = np.random.default_rng(4).permutation(50)  # the UCI protocol's split k from seed k
    assert sorted(test.tolist()) == sorted(order[:10].tolist())
    with pytest.raises(DataError, match="at least 10"):
        held_out_split(9, 0.1, 0)
