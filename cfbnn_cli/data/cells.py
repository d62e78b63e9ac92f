"""Cells of a table as numbers or levels, whole columns at a time.

A CSV gives text cells; a DataFrame gives typed columns. Both go through these functions, so a
value reads the same from either: a blank or NA token is missing, a number is parsed (text ``1``
and ``1.0`` are the same number, and so the same level or label), and the first cell that is not
a number is named by its column and row, its text shown as the file has it.
"""

from __future__ import annotations

import difflib
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..runtime.errors import DataError, clip

# what a blank or missing cell looks like in the files people have (pandas' to_csv writes ""; R writes NA)
MISSING_TOKENS = frozenset({"", "na", "nan", "n/a", "null", "none", "?", "<na>"})
SHOWN_NAMES = 40  # a list of column names in a message: this many, then how many in all


_STRINGS = getattr(np, "strings", np.char)  # numpy >= 2: the string ufuncs


def _spellings(token: str) -> List[str]:
    """Every upper/lower-case spelling of a short token (``na``: na, nA, Na, NA)."""
    out = [""]
    for char in token:
        out = [s + c for s in out for c in {char.lower(), char.upper()}]
    return out


# the NA tokens in every case, so that a cell is looked up without lower-casing it (numpy lower-cases
# text element by element, in Python: a table of numbers would pay for it cell by cell)
_MISSING_SPELLINGS = np.asarray(sorted({s for token in MISSING_TOKENS for s in _spellings(token)}))


def is_missing(cells: np.ndarray) -> np.ndarray:
    """Elementwise: is the (stripped) text cell blank or an NA token, in any case?"""
    if cells.dtype.kind not in "US":
        cells = cells.astype(str)
    return np.isin(_STRINGS.strip(cells), _MISSING_SPELLINGS)


def shown(text) -> str:
    """A cell's text for a message: quoted as the file has it, cut at 40 characters (never the
    repr of a numpy scalar)."""
    text = str(text)
    return repr(text[:40]) + ("..." if len(text) > 40 else "")


def names(items, limit: int = SHOWN_NAMES) -> str:
    """Column names for a message: every one up to ``limit``, then how many in all."""
    items = [str(item) for item in items]
    text = ", ".join(clip(item, 60) for item in items[:limit])
    return text + (f", ... ({len(items):,} in all)" if len(items) > limit else "")


def did_you_mean(name: str, candidates: Sequence[str]) -> str:
    """`` (did you mean species?)`` for a mistyped column name, or nothing."""
    candidates = [str(c) for c in candidates]
    lowered = {c.lower(): c for c in candidates}
    if name.lower() in lowered:
        return f" (did you mean {lowered[name.lower()]}?)"
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    if not close:
        close = [lowered[c] for c in difflib.get_close_matches(name.lower(), list(lowered), n=3, cutoff=0.6)]
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def parse_numbers(cells: np.ndarray, missing: np.ndarray) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """``(values, bad)``: text cells ``(n, k)`` as float64, NaN where ``missing``; ``bad`` is
    ``None`` where every present cell is a number, else the ``(n, k)`` mask of those that are not
    (found column by column only then)."""
    filled = np.where(missing, "nan", cells)
    try:
        return filled.astype(np.float64), None
    except ValueError:
        pass
    values = np.full(cells.shape, np.nan)
    bad = np.zeros(cells.shape, dtype=bool)
    for j in range(cells.shape[1]):  # only to tell the text columns from the numeric ones
        try:
            values[:, j] = filled[:, j].astype(np.float64)
        except ValueError:
            for i in np.flatnonzero(~missing[:, j]):
                try:
                    values[i, j] = float(filled[i, j])
                except ValueError:
                    bad[i, j] = True
    return values, bad


def text_cell_error(where: str, name: str, row: int, text, *, drop: Optional[List[str]] = None) -> DataError:
    """A text cell where a number belongs, named by column and row."""
    fix = (
        f"leave the column out with 'data.drop=[{','.join(drop)}]' (an ID or a text column), one-hot encode it "
        f"with 'data.categorical=[{name}]', or encode it as numbers"
        if drop is not None
        else "the model reads this column as numbers; check the value"
    )
    return DataError(f"{where}, column `{clip(name, 60)}`, row {row}: {shown(text)} is not a number; {fix}")


def infinite_cell_error(where: str, name: str, row: int, text) -> DataError:
    return DataError(
        f"{where}, column `{clip(name, 60)}`, row {row}: {shown(text)} is not a finite number; fix the cell, or "
        "leave such rows out with data.missing=drop (infinite cells count as blank there)"
    )


def canonical(text: str) -> str:
    """A level's or label's name: a number by its value (``1``, ``1.0`` and ``01`` are ``1``;
    ``0.50`` is ``0.5``), any other text stripped, as it is."""
    text = text.strip()
    try:
        number = float(text)
    except ValueError:
        return text
    if not math.isfinite(number) or "_" in text:
        return text
    if number == int(number) and abs(number) < 2**53:
        return str(int(number))
    return repr(number)


def canonical_cells(cells: np.ndarray) -> Tuple[np.ndarray, Dict[str, List[str]]]:
    """``(names, merged)``: each cell's :func:`canonical` name (one call per distinct text, not
    per row), and the names that more than one spelling became (``{"1": ["1", "1.0"]}``)."""
    text = np.char.strip(np.asarray(cells).astype(str))
    distinct, inverse = np.unique(text, return_inverse=True)
    mapped = [canonical(value) for value in distinct.tolist()]
    spellings: Dict[str, List[str]] = {}
    for spelling, name in zip(distinct.tolist(), mapped):
        spellings.setdefault(name, []).append(spelling)
    merged = {name: found for name, found in spellings.items() if len(found) > 1}
    return np.asarray(mapped, dtype=object)[inverse.reshape(-1)].reshape(text.shape), merged


def sorted_levels(levels) -> List[str]:
    """Distinct levels in numeric order where every one is a number, else as text."""
    levels = sorted(set(levels))
    try:
        return sorted(levels, key=float)
    except ValueError:
        return levels
