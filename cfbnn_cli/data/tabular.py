"""A user's own table, as people have them: a CSV with a header row, perhaps an unnamed index
column (pandas' default ``to_csv``), ID or text columns to leave out, blank cells, string labels.

* :func:`read_table` reads a whole training file (``data=csv``): the target column and the
  feature columns (``features``: exactly these; ``drop``: all but these), every problem one
  :class:`~cfbnn_cli.runtime.errors.DataError` naming the column and the row;
* :func:`iter_feature_chunks` streams the rows of a file to predict on in chunks of a fixed
  number of rows (memory independent of the file's length), mapping its columns by name onto a
  model's features; rows with a blank feature come out masked, not refused.

A row is the file's data row counted from 1 (the header is line 1, so row ``r`` is line ``r + 1``
where no line holds an embedded newline).
"""

from __future__ import annotations

import csv
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..runtime.errors import ConfigError, DataError, clip, listing
from ..runtime.safefs import describe_file, shown_path

# what a blank or missing cell looks like in the files people have (pandas' to_csv writes ""; R writes NA)
MISSING_TOKENS = frozenset({"", "na", "nan", "n/a", "null", "none", "?"})
MISSING_POLICIES = ("error", "drop")
MIN_SPLIT_ROWS = 10  # a held-out split needs a few training rows and at least one test row
_UNNAMED = re.compile(r"^(unnamed: *0)?$", re.IGNORECASE)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise DataError(
            f"cannot read {path} ({error.strerror or type(error).__name__}); check the file's "
            "permissions, or point data.path at a readable copy"
        ) from None


def refuse_binary(path: Path, head: bytes) -> None:
    """A NumPy or zip file given where a CSV is read is named as such, with the formats read."""
    for magic, kind in ((b"\x93NUMPY", "a NumPy .npy array"), (b"PK\x03\x04", "a zip archive (an .npz?)")):
        if head.startswith(magic):
            raise DataError(
                f"{path} is {kind}, not a CSV: training reads a .csv with a header row or an .npz of named arrays "
                "(numpy.savez(path, x=x, y=y)), predict a .csv with a header row "
                "(pandas.DataFrame(x, columns=names).to_csv(path, index=False))"
            )


def decoded_lines(path: Path) -> List[str]:
    """The lines of a UTF-8 text file (a byte-order mark dropped); a byte that is not
    UTF-8 is an error naming its line, not a traceback."""
    data = _read_bytes(path)
    refuse_binary(path, data[:8])
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        # the codec counts from after a byte-order mark
        offset = error.start + (3 if data.startswith(b"\xef\xbb\xbf") else 0)
        line = data[:offset].count(b"\n") + 1
        raise DataError(
            f"{path}, line {line}: byte 0x{data[offset]:02x} is not UTF-8 text; re-save the file as UTF-8 "
            "(e.g. `iconv -f latin1 -t utf-8`)"
        ) from None
    return text.splitlines()


def is_missing(cells: np.ndarray) -> np.ndarray:
    """Elementwise: is the (stripped) text cell blank or an NA token?"""
    lowered = np.char.lower(np.char.strip(cells.astype(str)))
    return np.isin(lowered, list(MISSING_TOKENS))


@dataclass
class Table:
    """A training file's rows in original units: ``x`` ``(N, D)`` float64 and ``y`` ``(N,)``
    (float64 for regression; the label strings for classification)."""

    name: str
    x: np.ndarray
    y: np.ndarray
    columns: List[str]
    target: str
    notes: List[str] = field(default_factory=list)  # what was left out, one sentence each


def _header(path: Path, lines: List[str]) -> List[str]:
    if not lines or not lines[0].strip():
        raise DataError(f"{path} is empty (or its first line, the header, is blank)")
    header = [name.strip() for name in next(csv.reader(lines[:1]))]
    if len(header) == 1 and any(sep in header[0] for sep in (";", "\t", "|")):
        separator = next(sep for sep in (";", "\t", "|") if sep in header[0])
        raise DataError(
            f"{path}: the header is one column {header[0][:60]!r}: the file looks {separator!r}-separated, and cfbnn "
            f"reads comma-separated CSV; convert it, e.g. pandas.read_csv(path, sep={separator!r}).to_csv(new_path, "
            "index=False)"
        )
    return header


def index_column(header: Sequence[str]) -> bool:
    """Is the first column an unnamed row index (pandas' ``to_csv`` default writes it with an empty
    name; read back and written again it is ``Unnamed: 0``)?"""
    return len(header) > 1 and bool(_UNNAMED.match(header[0]))


def _check_names(path: Path, header: List[str]) -> None:
    seen, duplicates = set(), []
    for name in header:
        if name in seen and name not in duplicates:
            duplicates.append(name)
        seen.add(name)
    if duplicates:
        raise DataError(
            f"{path}: duplicate column name(s) {listing(duplicates)} in the header; every column needs its own "
            "name (which one is the target otherwise?)"
        )
    blank = [i + 1 for i, name in enumerate(header) if not name]
    if blank:
        raise DataError(f"{path}: column {blank[0]} of the header has no name; name it, or leave it out of the file")


def _cells(path: Path, lines: List[str], width: int) -> np.ndarray:
    """The data rows as an ``(N, width)`` array of strings; a row of another width is named."""
    rows = []
    for offset, row in enumerate(csv.reader(lines[1:])):
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) != width:
            raise DataError(f"{path}, line {offset + 2}: expected {width} columns, found {len(row)}")
        rows.append(row)
    if not rows:
        raise DataError(f"{path} has a header but no data rows")
    return np.asarray(rows, dtype=str)


def numeric_column(cells: np.ndarray, missing: np.ndarray, where: str, name: str, first_row: int = 1) -> np.ndarray:
    """A text column as float64 (NaN where ``missing``); the first non-numeric or non-finite cell
    is a :class:`DataError` naming the column and its row."""
    values = np.full(len(cells), np.nan)
    present = ~missing
    try:
        values[present] = cells[present].astype(np.float64)
    except ValueError:
        for index in np.flatnonzero(present):  # only to name the cell: the vectorized cast refused one
            try:
                float(cells[index])
            except ValueError:
                text = str(cells[index])
                raise DataError(
                    f"{where}, column `{name}`, row {first_row + index}: {text[:40]!r}{'...' if len(text) > 40 else ''}"
                    f" is not a number; leave the column out with data.drop=[{name}] (an ID or a text column), "
                    "or encode it as numbers"
                ) from None
    infinite = present & ~np.isfinite(values)
    if infinite.any():
        index = int(np.argmax(infinite))
        raise DataError(
            f"{where}, column `{clip(name, 60)}`, row {first_row + index}: {clip(repr(cells[index]), 40)} is not a "
            "finite number"
        )
    return values


def _chosen_columns(path: Path, header: List[str], target: str, features, drop) -> List[str]:
    if target not in header:
        raise DataError(f"{path}: no column named `{clip(target, 60)}` (data.target); columns are {listing(header)}")
    features = [str(f) for f in features] if features else None
    drop = [str(d) for d in drop or ()]
    present = set(header)
    unknown = [name for name in (features or []) + drop if name not in present]
    if unknown:
        key = "data.features" if features and unknown[0] in features else "data.drop"
        raise DataError(
            f"{path}: {key} names column(s) {listing(unknown)} that the file does not have; it has {listing(header)}"
        )
    if features is not None:
        if target in features:
            raise ConfigError(f"data.features={clip(features)} includes the target `{clip(target, 60)}`; leave it out")
        if drop:
            raise ConfigError(
                "give data.features (the columns to keep) or data.drop (the columns to leave out), not both"
            )
        return features
    if target in drop:
        raise ConfigError(f"data.drop={clip(drop)} includes the target `{clip(target, 60)}`; the target is data.target")
    dropped = set(drop)
    return [name for name in header if name != target and name not in dropped]


def read_table(
    path,
    target: str,
    *,
    features: Optional[Sequence[str]] = None,
    drop: Sequence[str] = (),
    missing: str = "error",
    labels: bool = False,
    lines: Optional[List[str]] = None,
) -> Table:
    """The training rows of a CSV file (see the module docstring).

    ``labels``: the target holds class labels (any text; kept as strings), else numbers.
    ``missing``: ``"error"`` refuses a blank cell in a used column, naming it; ``"drop"`` leaves
    incomplete rows out (counted in :attr:`Table.notes`).
    """
    path = Path(path)
    if missing not in MISSING_POLICIES:
        raise ConfigError(f"data.missing={missing!r} must be one of {', '.join(MISSING_POLICIES)}")
    lines = decoded_lines(path) if lines is None else lines
    header = _header(path, lines)
    notes = []
    offset = 0
    if index_column(header):
        notes.append(f"the first column has no name ({header[0]!r}): a row index (pandas' to_csv writes one), left out")
        offset = 1
    cells = _cells(path, lines, len(header))[:, offset:]
    header = header[offset:]
    _check_names(path, header)
    columns = _chosen_columns(path, header, target, features, drop)
    if not columns and header == [target]:
        raise DataError(
            f"{path} holds only the target `{target}`: no feature column to learn from; add the input columns to the file"
        )
    if not columns:
        raise DataError(f"{path}: no feature column is left beside the target `{target}`; keep at least one")
    where = str(path)
    feature_cells = cells[:, [header.index(name) for name in columns]]
    target_cells = cells[:, header.index(target)]
    absent = np.concatenate([is_missing(feature_cells), is_missing(target_cells)[:, None]], axis=1)
    # a text column (an ID, a name) is named before blank cells: it needs data.drop whatever else
    x = np.stack(
        [numeric_column(feature_cells[:, j], absent[:, j], where, name) for j, name in enumerate(columns)], axis=1
    )
    y = (
        np.char.strip(target_cells.astype(str))
        if labels
        else numeric_column(target_cells, absent[:, -1], where, target)
    )
    incomplete = absent.any(axis=1)
    if incomplete.any() and missing == "error":
        row, column = np.argwhere(absent)[0]
        name = (columns + [target])[column]
        raise DataError(
            f"{where}, column `{name}`, row {row + 1}: blank (or NA); {int(incomplete.sum())} of {len(cells)} rows "
            "have a blank cell: data.missing=drop leaves them out, or fill them in"
        )
    if incomplete.any():
        notes.append(f"{int(incomplete.sum())} of {len(cells)} rows with a blank cell left out (data.missing=drop)")
    keep = np.flatnonzero(~incomplete)
    if len(keep) == 0:
        raise DataError(f"{where}: every row has a blank cell in a used column; nothing is left to train on")
    x, y = x[keep], y[keep]
    return Table(path.stem, x, y, columns, target, notes)


def held_out_split(rows: int, test_fraction: float, seed: int):
    """``(train, test)`` row indices: a permutation from ``seed`` (the UCI protocol's split ``k``
    is this with ``seed = k``)."""
    if rows < MIN_SPLIT_ROWS:
        raise DataError(f"the table has {rows} rows; a fit with held-out rows needs at least {MIN_SPLIT_ROWS}")
    test = max(1, int(round(test_fraction * rows)))
    if rows - test < 2:
        raise DataError(f"data.test_fraction={test_fraction} leaves {rows - test} training rows of {rows}")
    order = np.random.default_rng(seed).permutation(rows)
    return np.sort(order[test:]), np.sort(order[:test])


# ----------------------------------------------------------------------------- new rows, streamed


@dataclass
class FeatureChunk:
    """One chunk of new rows: ``x`` ``(n, D)`` float64 (NaN in incomplete rows), ``complete``
    ``(n,)``, ``rows`` the file's row numbers, ``passed`` the pass-through columns' text."""

    x: np.ndarray
    complete: np.ndarray
    rows: np.ndarray
    passed: List[List[str]]


def open_text(path: Path):
    """A UTF-8 text handle on ``path`` (a byte-order mark dropped); binary files named as such."""
    if path.is_dir() or not path.is_file():
        raise DataError(f"{shown_path(path)}: {describe_file(path)} (the rows to predict: a CSV with a header row)")
    with open(path, "rb") as raw:
        refuse_binary(path, raw.read(8))
    return open(path, encoding="utf-8-sig", newline="")


def iter_feature_chunks(
    path,
    columns: Optional[Sequence[str]],
    input_dim: int,
    target: Optional[str],
    *,
    keep: Sequence[str] = (),
    chunk_rows: int = 8192,
) -> Tuple[List[str], Iterator[FeatureChunk]]:
    """``(pass-through column names, chunks)`` of the new rows of ``path``.

    ``columns``: the model's feature names (``None``: generated data, read by position, every
    column but ``target``). Columns the model does not use are named in an error unless ``keep``
    lists them (they are copied to the output); the target may be present and is ignored.
    """
    path = Path(path)
    handle = open_text(path)
    reader = csv.reader(handle)
    try:
        header = [name.strip() for name in next(reader)]
    except StopIteration:
        handle.close()
        raise DataError(f"{path} is empty (or its first line, the header, is blank)") from None
    except (UnicodeDecodeError, csv.Error) as error:
        handle.close()
        raise DataError(f"{path}, line 1: {_reading_problem(error)}") from None
    if not any(header):
        handle.close()
        raise DataError(f"{path} is empty (or its first line, the header, is blank)")
    try:
        positions, passed = _map_columns(path, header, columns, input_dim, target, list(keep))
    except DataError:
        handle.close()
        raise
    names = [header[i] for i in positions]
    return [header[i] for i in passed], _chunks(path, handle, reader, len(header), positions, names, passed, chunk_rows)


def _reading_problem(error: Exception) -> str:
    if isinstance(error, UnicodeDecodeError):
        return "bytes that are not UTF-8 text; re-save the file as UTF-8"
    return f"not readable as CSV ({str(error)[:120]})"


def _map_columns(path, header, columns, input_dim, target, keep):
    offset = 1 if index_column(header) else 0
    named = header[offset:]
    counts = Counter(named)
    duplicated = sorted(name for name, count in counts.items() if count > 1)
    if duplicated:
        raise DataError(f"{path}: column names appear twice: {listing(duplicated)}")
    unknown_keep = [name for name in keep if name not in counts]
    if unknown_keep:
        raise DataError(
            f"{path}: --keep names column(s) {listing(unknown_keep)} that the file does not have; it has {listing(named)}"
        )
    if columns is None:  # generated training data: features by position
        used = [i for i in range(offset, len(header)) if header[i] != target and header[i] not in keep]
        if len(used) != input_dim:
            raise DataError(
                f"{path} has {len(used):,} feature columns; the model was trained on {input_dim} (generated data, "
                "read by position)"
            )
        position = {name: i for i, name in reversed(list(enumerate(header)))}
        return used, [position[name] for name in keep]
    wanted, kept = set(columns), set(keep)
    missing = [name for name in columns if name not in counts]
    extra = [name for name in named if name not in wanted and name != target and name not in kept]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {listing(missing)}")
        if extra:
            parts.append(f"not used by the model: {listing(extra)} (copy them to the output with --keep, e.g. an ID)")
        raise DataError(
            f"{path}: the columns differ from the model's features ({'; '.join(parts)}); it needs "
            f"{listing(columns)} (the target `{clip(target, 60)}` may be there and is ignored)"
        )
    position = {name: i for i, name in reversed(list(enumerate(header)))}
    return [position[name] for name in columns], [position[name] for name in keep]


def _chunks(path, handle, reader, width, positions, names, passed, chunk_rows) -> Iterator[FeatureChunk]:
    row_number = 0
    with handle:
        while True:
            block, numbers = [], []
            try:
                for row in reader:
                    line = reader.line_num
                    if not row or all(not cell.strip() for cell in row):
                        continue
                    if len(row) != width:
                        raise DataError(f"{path}, line {line}: expected {width} columns, found {len(row)}")
                    row_number += 1
                    block.append(row)
                    numbers.append(row_number)
                    if len(block) == chunk_rows:
                        break
            except (UnicodeDecodeError, csv.Error) as error:
                raise DataError(f"{path}, near line {reader.line_num + 1}: {_reading_problem(error)}") from None
            if not block:
                return
            cells = np.asarray(block, dtype=str)
            features = cells[:, positions]
            absent = is_missing(features)
            x = np.stack(
                [
                    numeric_column(features[:, j], absent[:, j], str(path), name, numbers[0])
                    for j, name in enumerate(names)
                ],
                axis=1,
            )
            yield FeatureChunk(x, ~absent.any(axis=1), np.asarray(numbers), cells[:, passed].tolist())
