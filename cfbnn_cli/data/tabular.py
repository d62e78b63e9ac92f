"""A user's own table, as people have them: a CSV with a header row (or the same gzip-compressed),
perhaps an unnamed index column (pandas' default ``to_csv``), ID or text columns to leave out or
to one-hot encode, blank cells, string labels.

* :func:`read_table` reads a whole training file (``data=csv``): the target column and the
  feature columns (``features``: exactly these; ``drop``: all but these; ``categorical``: those
  one-hot encoded, or ``"auto"``), every problem one :class:`~cfbnn_cli.runtime.errors.DataError`
  naming the column and the row; its :class:`~.layout.InputLayout` is what the model file keeps;
* :func:`iter_feature_chunks` streams the rows of a file to predict on in chunks of a fixed
  number of rows (memory independent of the file's length), mapping its columns by name onto a
  model's layout (:meth:`~.layout.InputLayout.match`); rows with a blank feature come out masked,
  not refused.

A row is the file's data row counted from 1 (the header is line 1, so row ``r`` is line ``r + 1``
where no line holds an embedded newline).
"""

from __future__ import annotations

import csv
import gzip
import logging
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..runtime.errors import ConfigError, DataError, clip
from ..runtime.safefs import describe_file, shown_path
from .cells import (
    MISSING_TOKENS,
    canonical_cells,
    did_you_mean,
    infinite_cell_error,
    is_missing,
    names,
    parse_numbers,
    shown,
    sorted_levels,
    text_cell_error,
)
from .layout import TARGET_TRANSFORMS, UNSEEN_POLICIES, InputLayout, index_column

__all__ = ["MISSING_TOKENS", "MISSING_POLICIES", "is_missing", "index_column", "read_table", "iter_feature_chunks"]

log = logging.getLogger(__name__)
MISSING_POLICIES = ("error", "drop")
MIN_SPLIT_ROWS = 10  # a held-out split needs a few training rows and at least one test row
# data.categorical=auto: a text column with at most this many levels (and fewer than half the rows) is
# one-hot encoded; one with more (an ID, a name, free text) still needs data.drop or naming
AUTO_MAX_LEVELS = 50
ID_MIN_ROWS = 20  # an integer column distinct in every one of at least this many rows is probably an ID
GZIP_MAGIC = b"\x1f\x8b"
_COMPRESSED = (
    (b"BZh", "bzip2 (.bz2)", "bunzip2"),
    (b"\xfd7zXZ\x00", "xz (.xz)", "unxz"),
    (b"(\xb5/\xfd", "zstd", "unzstd"),
)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise DataError(
            f"cannot read {path} ({error.strerror or type(error).__name__}); check the file's "
            "permissions, or point data.path at a readable copy"
        ) from None


def refuse_binary(path: Path, head: bytes) -> None:
    """A NumPy, zip or compressed file given where a CSV is read is named as such, with the formats read."""
    for magic, kind in ((b"\x93NUMPY", "a NumPy .npy array"), (b"PK\x03\x04", "a zip archive (an .npz?)")):
        if head.startswith(magic):
            raise DataError(
                f"{path} is {kind}, not a CSV: training reads a .csv with a header row or an .npz of named arrays "
                "(numpy.savez(path, x=x, y=y)), predict a .csv with a header row "
                "(pandas.DataFrame(x, columns=names).to_csv(path, index=False))"
            )
    for magic, kind, tool in _COMPRESSED:
        if head.startswith(magic):
            raise DataError(
                f"{path} is compressed with {kind}, not a CSV: decompress it first (`{tool} -k {path}`), or "
                "compress it with gzip, which cfbnn reads"
            )


def _gunzipped(path: Path, data: bytes) -> bytes:
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as error:
        raise DataError(
            f"{path} is gzip-compressed but cannot be decompressed ({error}); the file is damaged: "
            "re-create it, or decompress what is left with `gunzip -c`"
        ) from None


def decoded_lines(path: Path) -> List[str]:
    """The lines of a UTF-8 text file (a byte-order mark dropped; a gzip file decompressed); a
    byte that is not UTF-8 is an error naming its line, not a traceback."""
    data = _read_bytes(path)
    if data.startswith(GZIP_MAGIC):
        data = _gunzipped(path, data)
    refuse_binary(path, data[:8])
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        # the codec counts from after a byte-order mark
        offset = error.start + (3 if data.startswith(b"\xef\xbb\xbf") else 0)
        line = data[:offset].count(b"\n") + 1
        raise DataError(
            f"{path}, line {line}: byte 0x{data[offset]:02x} is not UTF-8 text; re-save the file as UTF-8 "
            "(e.g. `iconv -f latin1 -t utf-8` if it is Latin-1 text)"
        ) from None
    return text.splitlines()


@dataclass
class Table:
    """A training file's rows in original units: ``x`` ``(N, D)`` float64 (categorical columns
    one-hot encoded) and ``y`` ``(N,)`` (float64 for regression; the label strings for
    classification); ``columns`` the ``D`` features' names, ``layout`` how the model reads a table."""

    name: str
    x: np.ndarray
    y: np.ndarray
    columns: List[str]
    target: str
    notes: List[str] = field(default_factory=list)  # what was left out, one sentence each
    layout: Optional[InputLayout] = None


def header_of(path: Path, lines: List[str]) -> List[str]:
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


def check_names(path, header: Sequence[str]) -> None:
    """Every column has a name of its own."""
    seen, duplicates = set(), []
    for name in header:
        if name in seen and name not in duplicates:
            duplicates.append(name)
        seen.add(name)
    if duplicates:
        raise DataError(
            f"{path}: duplicate column name(s) {names(duplicates)} in the header; every column needs its own "
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


def chosen_columns(path, header: List[str], target: str, features, drop) -> List[str]:
    """The feature columns ``data.features`` / ``data.drop`` choose from ``header`` (every name
    checked: in the file, given once, not the target)."""
    present = set(header)
    if target not in present:
        raise DataError(
            f"{path}: no column named `{clip(target, 60)}` (data.target){did_you_mean(target, header)}; "
            f"columns are {names(header)}"
        )
    features = [str(f) for f in features] if features is not None else None
    drop = [str(d) for d in drop or ()]
    for key, given in (("data.features", features or []), ("data.drop", drop)):
        twice = sorted(name for name, count in Counter(given).items() if count > 1)
        if twice:
            raise ConfigError(f"{key} names {names(twice)} more than once; give each column once")
        unknown = [name for name in given if name not in present]
        if unknown:
            raise DataError(
                f"{path}: {key} names column(s) {names(unknown)} that the file does not have"
                f"{did_you_mean(unknown[0], header)}; it has {names(header)}"
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


def categorical_choice(path, categorical, columns: List[str]):
    """``(named columns, auto)`` of ``data.categorical`` (a list of feature columns, or ``"auto"``)."""
    if categorical is None or categorical == "none":
        return [], False
    if isinstance(categorical, str):
        if categorical != "auto":
            raise ConfigError(
                f"data.categorical={categorical!r} must be a list of columns (e.g. 'data.categorical=[color,cut]') or auto"
            )
        return [], True
    chosen = [str(c) for c in categorical]
    if len(set(chosen)) != len(chosen):
        raise ConfigError(f"data.categorical names {names(sorted({c for c in chosen if chosen.count(c) > 1}))} twice")
    features = set(columns)
    unknown = [c for c in chosen if c not in features]
    if unknown:
        raise DataError(
            f"{path}: data.categorical names {names(unknown)}, not among the feature columns "
            f"({names(columns)}){did_you_mean(unknown[0], columns)}"
        )
    return chosen, False


def _text_columns(path, cells, columns, categorical, auto, drop, features, where):
    """``(categorical columns, numbers)``: the columns to one-hot encode (named, and under
    ``auto`` the text columns with few levels) and every other column's cells as float64 (NaN
    blank); every other column holding text is named in one error with the complete data.drop
    to paste."""
    named = set(categorical)
    numeric = [j for j, c in enumerate(columns) if c not in named]
    if not numeric:
        return list(categorical), np.empty((len(cells), 0))
    text = cells[:, numeric]
    absent = is_missing(text)
    values, bad = parse_numbers(text, absent)
    if bad is None:
        return list(categorical), values
    found = [numeric[i] for i in np.flatnonzero(bad.any(axis=0))]
    chosen = list(categorical)
    if auto:
        rows = len(cells)
        for j in found:
            levels = np.unique(np.char.strip(cells[:, j][~is_missing(cells[:, j])]))
            if len(levels) <= AUTO_MAX_LEVELS and len(levels) < rows / 2:
                chosen.append(columns[j])
        chosen_set = set(chosen)
        found = [j for j in found if columns[j] not in chosen_set]
    if not found:
        chosen_set = set(chosen)
        return [c for c in columns if c in chosen_set], values[:, [columns[j] not in chosen_set for j in numeric]]
    first = int(np.argmax(bad[:, numeric.index(found[0])]))
    text_names = [columns[j] for j in found]
    where_first = (
        f"{where}, column `{clip(text_names[0], 60)}`, row {first + 1}: {shown(cells[first, found[0]])} is not a number"
    )
    if features is not None:
        kept = [c for c in features if c not in set(text_names)]
        leave = f"'data.features=[{','.join(kept)}]'"
    else:
        leave = f"'data.drop=[{','.join(list(drop) + text_names)}]'"
    levels = {columns[j]: len(np.unique(cells[:, j])) for j in found[:200]}
    many = [c for c, count in levels.items() if count > AUTO_MAX_LEVELS]
    raise DataError(
        f"{where_first}; {len(text_names)} column(s) hold text: {names(text_names)}. Leave them out with {leave}, "
        f"or one-hot encode them with 'data.categorical=[{','.join(list(categorical) + text_names)}]'"
        + (
            f" ({names(many)} {'has' if len(many) == 1 else 'have'} more than {AUTO_MAX_LEVELS} levels: an ID or free text?)"
            if many
            else ""
        )
    )


def _warn_id_columns(path, x, layout: InputLayout, drop, features) -> None:
    """One warning line naming the integer columns that hold a different value in every row."""
    numeric = [c for c in layout.columns if c not in layout.categorical]
    if len(x) < ID_MIN_ROWS or not numeric:
        return
    feature_at = {name: i for i, name in enumerate(layout.features)}
    block = x[:, [feature_at[c] for c in numeric]]
    finite = np.isfinite(block).all(axis=0)
    whole = finite & np.all(block == np.round(block), axis=0)
    ordered = np.sort(block, axis=0)
    distinct = ~np.any(ordered[1:] == ordered[:-1], axis=0)
    ids = [numeric[i] for i in np.flatnonzero(whole & distinct)]
    if not ids:
        return
    if features is not None:
        fix = f"'data.features=[{','.join(c for c in features if c not in set(ids))}]'"
    else:
        fix = f"'data.drop=[{','.join(list(drop) + ids)}]'"
    log.warning(
        "%s: column(s) %s hold a different whole number in every row (an ID?) and are trained on as features; "
        "if they are IDs, leave them out with %s",
        path,
        names(ids),
        fix,
    )


def read_table(
    path,
    target: str,
    *,
    features: Optional[Sequence[str]] = None,
    drop: Sequence[str] = (),
    missing: str = "error",
    labels: bool = False,
    lines: Optional[List[str]] = None,
    categorical=None,
    unseen: str = "error",
    target_transform: str = "none",
) -> Table:
    """The training rows of a CSV file (see the module docstring).

    ``labels``: the target holds class labels (any text; kept as strings), else numbers.
    ``missing``: ``"error"`` refuses a blank cell in a used column, naming it; ``"drop"`` leaves
    incomplete rows out (counted in :attr:`Table.notes`; an infinite number counts as blank).
    ``categorical``: the feature columns to one-hot encode (their levels: the distinct values,
    numbers by value), or ``"auto"`` (every text column with at most ``AUTO_MAX_LEVELS`` levels);
    ``unseen`` and ``target_transform`` are recorded in the layout for prediction.
    """
    path = Path(path)
    if missing not in MISSING_POLICIES:
        raise ConfigError(f"data.missing={missing!r} must be one of {', '.join(MISSING_POLICIES)}")
    if unseen not in UNSEEN_POLICIES:
        raise ConfigError(f"data.unseen={unseen!r} must be one of {', '.join(UNSEEN_POLICIES)}")
    if target_transform not in TARGET_TRANSFORMS:
        raise ConfigError(f"data.target_transform={target_transform!r} must be one of {', '.join(TARGET_TRANSFORMS)}")
    lines = decoded_lines(path) if lines is None else lines
    header = header_of(path, lines)
    notes = []
    offset = 0
    if index_column(header):
        notes.append(f"the first column has no name ({header[0]!r}): a row index (pandas' to_csv writes one), left out")
        offset = 1
    cells = _cells(path, lines, len(header))[:, offset:]
    header = header[offset:]
    check_names(path, header)
    columns = chosen_columns(path, header, target, features, drop)
    if not columns and header == [target]:
        raise DataError(
            f"{path} holds only the target `{target}`: no feature column to learn from; add the input columns to the file"
        )
    if not columns:
        raise DataError(f"{path}: no feature column is left beside the target `{target}`; keep at least one")
    where = str(path)
    position = {name: i for i, name in enumerate(header)}  # one lookup per name: linear in the width
    feature_cells = cells[:, [position[name] for name in columns]]
    target_cells = cells[:, position[target]]
    named, auto = categorical_choice(path, categorical, columns)
    # a text column (an ID, a name) is named before blank cells: it needs data.drop whatever else
    chosen, numbers = _text_columns(path, feature_cells, columns, named, auto, list(drop or ()), features, where)
    levels = {}
    column_at = {name: j for j, name in enumerate(columns)}
    for column in chosen:
        j = column_at[column]
        present = ~is_missing(feature_cells[:, j])
        levels[column] = sorted_levels(canonical_cells(feature_cells[present, j])[0].tolist())
        if not levels[column]:
            raise DataError(f"{where}: the categorical column `{clip(column, 60)}` is blank in every row")
    chosen_set = set(columns)
    layout = InputLayout(
        columns,
        target,
        levels,
        [name for name in header if name != target and name not in chosen_set],
        unseen,
        target_transform,
    )
    if len(set(layout.features)) != len(layout.features):
        twice = sorted(name for name, count in Counter(layout.features).items() if count > 1)
        raise DataError(f"{where}: a column is named like a level's indicator ({names(twice)}); rename that column")
    rows = np.arange(1, len(cells) + 1)
    if levels:  # the numeric columns as parsed above, the categorical ones as text
        numbers = iter(numbers.T)
        values = [feature_cells[:, j] if c in levels else next(numbers) for j, c in enumerate(columns)]
    else:
        values = numbers
    x, complete = layout.encode(values, where, rows, infinite_missing=missing == "drop")
    absent_target = is_missing(target_cells)
    if labels:
        y = np.char.strip(target_cells.astype(str))
    else:
        y, bad = parse_numbers(target_cells[:, None], absent_target[:, None])
        if bad is not None:
            row = int(np.argmax(bad[:, 0]))
            raise text_cell_error(where, target, row + 1, target_cells[row])
        y = y[:, 0]
        infinite = np.isinf(y)
        if infinite.any() and missing != "drop":
            row = int(np.argmax(infinite))
            raise infinite_cell_error(where, target, row + 1, target_cells[row])
        absent_target = absent_target | infinite
        if target_transform == "log":
            bad = ~absent_target & ~(y > 0)
            if bad.any():
                row = int(np.argmax(bad))
                raise DataError(
                    f"{where}, column `{clip(target, 60)}`, row {row + 1}: {shown(target_cells[row])} is not positive; "
                    f"data.target_transform=log needs a target > 0 ({int(bad.sum())} of {len(y)} rows are not): leave "
                    "those rows out of the file, or use data.target_transform=none"
                )
    incomplete = ~complete | absent_target
    if incomplete.any() and missing == "error":
        row = int(np.argmax(incomplete))
        blank_cells = is_missing(feature_cells[row])  # (an infinite cell was refused above)
        name = columns[int(np.argmax(blank_cells))] if not complete[row] else target
        raise DataError(
            f"{where}, column `{name}`, row {row + 1}: blank (or NA); {int(incomplete.sum())} of {len(cells)} rows "
            "have a blank cell: data.missing=drop leaves them out, or fill them in"
        )
    if incomplete.any():
        notes.append(
            f"{int(incomplete.sum())} of {len(cells)} rows with a blank (or infinite) cell left out (data.missing=drop)"
        )
    keep = np.flatnonzero(~incomplete)
    if len(keep) == 0:
        raise DataError(f"{where}: every row has a blank cell in a used column; nothing is left to train on")
    x, y = x[keep], y[keep]
    _warn_id_columns(path, x, layout, list(drop or ()), features)
    return Table(table_name(path), x, y, layout.features, target, notes, layout)


def table_name(path) -> str:
    """A table's name: its file's name without the extension (``.csv.gz``: both)."""
    path = Path(path)
    return Path(path.stem).stem if path.suffix == ".gz" else path.stem


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
    """A UTF-8 text handle on ``path`` (a byte-order mark dropped; a gzip file decompressed as it
    is read); binary files named as such."""
    if path.is_dir() or not path.is_file():
        raise DataError(f"{shown_path(path)}: {describe_file(path)} (the rows to predict: a CSV with a header row)")
    with open(path, "rb") as raw:
        head = raw.read(8)
    if head.startswith(GZIP_MAGIC):
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    refuse_binary(path, head)
    return open(path, encoding="utf-8-sig", newline="")


def iter_feature_chunks(
    path,
    layout,
    input_dim: int,
    target: Optional[str],
    *,
    keep: Sequence[str] = (),
    chunk_rows: int = 8192,
    reserved: Sequence[str] = (),
    unseen: Optional[str] = None,
) -> Tuple[List[str], Iterator[FeatureChunk]]:
    """``(pass-through column names, chunks)`` of the new rows of ``path``.

    ``layout``: the model's :class:`~.layout.InputLayout` (a list of names: numeric columns;
    ``None``: generated data, read by position, every column but ``target``). Its columns are
    found by name (:meth:`~.layout.InputLayout.match`: the target and the columns the training run
    left out are ignored; any other column is refused unless ``keep`` lists it, and then copied to
    the output). ``reserved``: the output's own column names, which ``keep`` may not take.
    """
    path = Path(path)
    if layout is not None and not isinstance(layout, InputLayout):
        layout = InputLayout([str(c) for c in layout], str(target))
    handle = open_text(path)
    reader = csv.reader(handle)
    try:
        try:
            header = [name.strip() for name in next(reader)]
        except StopIteration:
            raise DataError(f"{path} is empty (or its first line, the header, is blank)") from None
        except (UnicodeDecodeError, csv.Error, OSError, EOFError) as error:
            raise DataError(f"{path}, line 1: {_reading_problem(error)}") from None
        if not any(header):
            raise DataError(f"{path} is empty (or its first line, the header, is blank)")
        if layout is None:
            positions, passed = _by_position(path, header, input_dim, target, list(keep), reserved)
            layout = InputLayout([header[i] for i in positions], str(target or ""))
        else:
            positions, passed = layout.match(header, str(path), list(keep), reserved=reserved)
    except DataError:
        handle.close()
        raise
    return [header[i] for i in passed], _chunks(
        path, handle, reader, len(header), positions, layout, passed, chunk_rows, unseen
    )


def _reading_problem(error: Exception) -> str:
    if isinstance(error, UnicodeDecodeError):
        return "bytes that are not UTF-8 text; re-save the file as UTF-8"
    if isinstance(error, (OSError, EOFError)):
        return f"the gzip stream cannot be read ({str(error)[:120]}); the file is damaged"
    return f"not readable as CSV ({str(error)[:120]})"


def _by_position(path, header, input_dim, target, keep, reserved):
    """Generated training data: the features are every column but the target and ``keep``, in order."""
    from .layout import check_keep

    offset = 1 if index_column(header) else 0
    named = header[offset:]
    position = {}
    for i, name in enumerate(named, start=offset):
        if name in position:
            raise DataError(f"{path}: column names appear twice: {names([name])}")
        position[name] = i
    check_keep(keep, position, named, str(path), reserved)
    kept = set(keep)
    used = [i for i in range(offset, len(header)) if header[i] != target and header[i] not in kept]
    if len(used) != input_dim:
        raise DataError(
            f"{path} has {len(used):,} feature columns; the model was trained on {input_dim} (generated data, "
            "read by position)"
        )
    return used, [position[name] for name in keep]


def _chunks(path, handle, reader, width, positions, layout, passed, chunk_rows, unseen) -> Iterator[FeatureChunk]:
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
            except (UnicodeDecodeError, csv.Error, OSError, EOFError) as error:
                raise DataError(f"{path}, near line {reader.line_num + 1}: {_reading_problem(error)}") from None
            if not block:
                return
            cells = np.asarray(block, dtype=str)
            rows = np.asarray(numbers)
            features = cells[:, positions]
            x, complete = layout.encode(features, str(path), rows, unseen=unseen)
            yield FeatureChunk(x, complete, rows, cells[:, passed].tolist())
