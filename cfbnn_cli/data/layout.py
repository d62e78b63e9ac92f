"""How a model reads a table: by column name, whatever the order or the source.

An :class:`InputLayout` is saved in every model file that was trained on named columns. It holds
the columns the model reads (``columns``, in its order), the categorical ones with their levels
(each one-hot encoded: one indicator per level, in the order of ``levels``), the columns its
training file had that the run left out (``left_out``: ``data.drop``, or outside
``data.features``), the target and its transform. Two methods read rows with it, for
``cfbnn predict``, the library's ``SavedModel.predict`` and the training file alike:

* :meth:`InputLayout.match` finds the model's columns in a header by name (a dict: linear in the
  header's width) under one rule: a column the model reads and lacks is named; the target, an
  unnamed leading index column and the columns the training run left out are ignored; any other
  column is refused unless the caller copies it (``--keep``).
* :meth:`InputLayout.encode` turns the matched columns' values into the network's features:
  numbers parsed (text cells or any numeric dtype), levels one-hot encoded, a blank cell marking
  its row incomplete, every problem one :class:`~cfbnn_cli.runtime.errors.DataError` naming the
  column and the row.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..runtime.errors import DataError, clip
from .cells import canonical_cells, infinite_cell_error, is_missing, names, parse_numbers, shown, text_cell_error

UNSEEN_POLICIES = ("error", "zeros")
TARGET_TRANSFORMS = ("none", "log")
_UNNAMED = re.compile(r"^(unnamed: *0)?$", re.IGNORECASE)


def index_column(header: Sequence[str]) -> bool:
    """Is the first column an unnamed row index (pandas' ``to_csv`` default writes it with an empty
    name; read back and written again it is ``Unnamed: 0``)?"""
    return len(header) > 1 and bool(_UNNAMED.match(str(header[0])))


def feature_name(column: str, level: str) -> str:
    """The name of the indicator of ``level`` of a categorical ``column``."""
    return f"{column}={level}"


@dataclass
class InputLayout:
    columns: List[str]  # the columns the model reads, in its order
    target: str
    categorical: Dict[str, List[str]] = field(default_factory=dict)  # column -> its levels (one-hot)
    left_out: List[str] = field(default_factory=list)  # the training file's other columns: ignored
    unseen: str = "error"  # a level not seen in training: "error" | "zeros" (every indicator 0)
    target_transform: str = "none"  # "none" | "log": the network fits log(target)

    @cached_property
    def features(self) -> List[str]:
        """The network's input features: each numeric column, each categorical level's indicator."""
        if not self.categorical:
            return list(self.columns)
        out: List[str] = []
        for column in self.columns:
            levels = self.categorical.get(column)
            out.extend([feature_name(column, level) for level in levels] if levels is not None else [column])
        return out

    # ------------------------------------------------------------------ the model file's record

    def record(self) -> dict:
        """Plain lists, strings and dicts (a model file loads with ``weights_only=True``)."""
        return {
            "columns": list(self.columns),
            "target": self.target,
            "categorical": {k: list(v) for k, v in self.categorical.items()},
            "left_out": list(self.left_out),
            "unseen": self.unseen,
            "target_transform": self.target_transform,
        }

    @classmethod
    def from_record(cls, record, input_dim: int) -> "InputLayout":
        """The layout of a model file's record; ``ValueError`` naming the field that does not hold."""

        def strings(value, what):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"layout.{what} is not a list of names")
            return value

        if not isinstance(record, dict):
            raise ValueError("layout is not a mapping")
        columns = strings(record.get("columns"), "columns")
        if len(set(columns)) != len(columns):
            raise ValueError("layout.columns names a column twice")
        categorical = record.get("categorical", {})
        if not isinstance(categorical, dict) or not set(categorical) <= set(columns):
            raise ValueError("layout.categorical is not a mapping of the layout's columns to levels")
        for column, levels in categorical.items():
            strings(levels, f"categorical[{clip(column, 40)}]")
            if not levels or len(set(levels)) != len(levels):
                raise ValueError(f"layout.categorical[{clip(column, 40)}] is empty or names a level twice")
        left_out = strings(record.get("left_out", []), "left_out")
        target = record.get("target")
        if not isinstance(target, str):
            raise ValueError("layout.target is not a name")
        unseen = record.get("unseen", "error")
        transform = record.get("target_transform", "none")
        if unseen not in UNSEEN_POLICIES:
            raise ValueError(f"layout.unseen is {clip(unseen, 40)!r}, not one of {UNSEEN_POLICIES}")
        if transform not in TARGET_TRANSFORMS:
            raise ValueError(f"layout.target_transform is {clip(transform, 40)!r}, not one of {TARGET_TRANSFORMS}")
        layout = cls(columns, target, categorical, left_out, unseen, transform)
        if len(layout.features) != input_dim:
            raise ValueError(f"layout gives {len(layout.features)} features; the network takes {input_dim}")
        return layout

    # ------------------------------------------------------------------ matching a header

    def match(
        self,
        header: Sequence[str],
        where: str,
        keep: Sequence[str] = (),
        *,
        reserved: Sequence[str] = (),
        extra_fix: str = "copy them to the output with --keep, e.g. an ID",
    ) -> Tuple[List[int], List[int]]:
        """``(positions of the model's columns, positions of keep)`` in ``header`` (see the module
        docstring for the rule). ``reserved``: names the output already has (``--keep`` may not
        take them)."""
        header = [str(name) for name in header]
        offset = 1 if index_column(header) else 0
        named = header[offset:]
        position: Dict[str, int] = {}
        duplicated = []
        for i, name in enumerate(named, start=offset):
            if name in position:
                duplicated.append(name)
            position.setdefault(name, i)
        if duplicated:
            raise DataError(f"{where}: column names appear twice: {names(sorted(set(duplicated)))}")
        check_keep(keep, position, named, where, reserved)
        missing = [name for name in self.columns if name not in position]
        ignored = set(self.columns) | set(self.left_out) | {self.target} | set(keep)
        extra = [name for name in named if name not in ignored]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing {names(missing)}")
            if extra:
                parts.append(f"not used by the model: {names(extra)} ({extra_fix})")
            raise DataError(
                f"{where}: the columns differ from the model's ({'; '.join(parts)}); it reads "
                f"{names(self.columns)} (the target `{clip(self.target, 60)}` and the columns its training left "
                "out may be there and are ignored)"
            )
        return [position[name] for name in self.columns], [position[name] for name in keep]

    # ------------------------------------------------------------------ values -> features

    def encode(
        self,
        values,
        where: str,
        rows: np.ndarray,
        *,
        unseen: Optional[str] = None,
        infinite_missing: bool = False,
    ) -> Tuple[np.ndarray, np.ndarray]:
        """``(x, complete)``: the network's features ``(n, D)`` float64 (NaN in an incomplete
        row's missing cells) and which rows have every cell.

        ``values``: the model's columns' cells, in :attr:`columns` order, as a ``(n, k)`` text
        array (a CSV's), a ``(n, k)`` float array (numbers already, NaN blank; no categorical
        column), or a list of ``k`` arrays, each text or of a numeric dtype (NaN: blank).
        ``rows``: the rows' numbers for messages. ``unseen``: the policy for a level not seen in
        training (default :attr:`unseen`). ``infinite_missing``: an infinite cell counts as
        blank (``data.missing=drop``), else it is an error naming it.
        """
        unseen = self.unseen if unseen is None else unseen
        if unseen not in UNSEEN_POLICIES:
            raise ValueError(f"`unseen` must be one of {UNSEEN_POLICIES}; got {unseen!r}")
        n = len(rows)
        k = len(self.columns)
        numeric = [j for j, c in enumerate(self.columns) if c not in self.categorical]
        blank = np.zeros((n, k), dtype=bool)
        numbers = np.full((n, len(numeric)), np.nan)
        if isinstance(values, np.ndarray) and values.ndim == 2 and values.dtype.kind == "f":
            if self.categorical:
                raise ValueError("a float matrix holds no categorical column's levels; pass a list of columns")
            columns = None
            numbers = np.array(values, dtype=np.float64)
            blank = np.isnan(numbers)
        elif isinstance(values, np.ndarray) and values.ndim == 2:
            columns = None
            text = values[:, numeric]
            blank[:, numeric] = is_missing(text)
            numbers[:] = self._parsed(text, blank[:, numeric], [self.columns[j] for j in numeric], where, rows)
        else:
            columns = list(values)
            text_at = [i for i, j in enumerate(numeric) if columns[j].dtype.kind in "OUS"]
            if text_at:
                text = np.stack([np.asarray(columns[numeric[i]]).astype(str) for i in text_at], axis=1)
                absent = is_missing(text)
                blank[:, [numeric[i] for i in text_at]] = absent
                numbers[:, text_at] = self._parsed(
                    text, absent, [self.columns[numeric[i]] for i in text_at], where, rows
                )
            typed = set(range(len(numeric))) - set(text_at)
            for i in sorted(typed):
                column = np.asarray(columns[numeric[i]], dtype=np.float64)
                blank[:, numeric[i]] = np.isnan(column)
                numbers[:, i] = column
        infinite = np.isinf(numbers)
        if infinite.any():
            if not infinite_missing:
                r, i = np.argwhere(infinite)[0]
                text = values[r, numeric[i]] if columns is None and values.dtype.kind in "US" else str(numbers[r, i])
                raise infinite_cell_error(where, self.columns[numeric[i]], int(rows[r]), text)
            numbers[infinite] = np.nan
            blank[:, numeric] |= infinite
        if not self.categorical:
            return numbers, ~blank.any(axis=1)
        widths = np.asarray([len(self.categorical.get(c, (None,))) for c in self.columns], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(widths)[:-1]])
        x = np.full((n, int(widths.sum())), np.nan)
        x[:, starts[numeric]] = numbers
        for j in sorted(set(range(k)) - set(numeric)):
            column, levels = self.columns[j], self.categorical[self.columns[j]]
            cells = values[:, j] if columns is None else np.asarray(columns[j])
            block, blank[:, j] = self._one_hot(column, levels, cells, where, rows, unseen)
            x[:, starts[j] : starts[j] + len(levels)] = block
        complete = ~blank.any(axis=1)
        return x, complete

    def _parsed(self, text, absent, column_names, where, rows) -> np.ndarray:
        values, bad = parse_numbers(text, absent)
        if bad is not None:
            r, i = np.argwhere(bad)[0]
            raise text_cell_error(where, column_names[i], int(rows[r]), text[r, i])
        return values

    def _one_hot(self, column, levels, cells, where, rows, unseen) -> Tuple[np.ndarray, np.ndarray]:
        cells = np.asarray(cells)
        if cells.dtype.kind == "f":
            absent = np.isnan(cells)
        else:
            cells = cells.astype(str)
            absent = is_missing(cells)
        canonical, _ = canonical_cells(cells.astype(str))
        lookup = {level: k for k, level in enumerate(levels)}
        distinct, inverse = np.unique(canonical.astype(str), return_inverse=True)
        index = np.asarray([lookup.get(level, -1) for level in distinct.tolist()], dtype=np.int64)[inverse.reshape(-1)]
        unknown = (index < 0) & ~absent
        if unknown.any() and unseen == "error":
            r = int(np.argmax(unknown))
            raise DataError(
                f"{where}, column `{clip(column, 60)}`, row {int(rows[r])}: level {shown(cells[r])} was not seen in "
                f"training (its levels: {names(levels, 20)}); fix the cell, or give unseen levels all-zero "
                "indicators (cfbnn predict --unseen zeros; SavedModel.predict(..., unseen='zeros'))"
            )
        out = np.zeros((len(cells), len(levels)))
        known = index >= 0
        out[np.flatnonzero(known & ~absent), index[known & ~absent]] = 1.0
        out[absent] = np.nan
        return out, absent


def check_keep(keep: Sequence[str], position, named: Sequence[str], where: str, reserved: Sequence[str]) -> None:
    """The columns to copy to the output: each in the file, each once, none with a name the output
    already has (one line naming the clash)."""
    keep = [str(k) for k in keep]
    twice = sorted(name for name, count in Counter(keep).items() if count > 1)
    if twice:
        raise DataError(f"--keep names {names(twice)} more than once; give each column once")
    clash = [name for name in keep if name in set(reserved)]
    if clash:
        raise DataError(
            f"--keep {names(clash)}: the output already has a column of that name ({names(reserved)}); rename the "
            "column in the file, or leave it out of --keep"
        )
    unknown = [name for name in keep if name not in position]
    if unknown:
        raise DataError(
            f"{where}: --keep names column(s) {names(unknown)} that the file does not have; it has {names(named)}"
        )
