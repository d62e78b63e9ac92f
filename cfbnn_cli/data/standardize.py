"""Column standardization that neither overflows nor underflows, and says so when it must.

``np.std`` of values near 1e200 squares them into infinity, and of values near
1e-300 into zero, so a naive standardization calls the first column "constant
... infinite" and the second "constant". Here each column is first divided by the
power of two nearest its largest magnitude -- exact in floating point, so wherever
the naive computation was fine the result is bit for bit the same -- and its mean
and standard deviation are computed on values of order one, then scaled back.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from ..runtime.errors import DataError
from .cells import names as shown_names


def _power_of_two_scale(a: np.ndarray) -> np.ndarray:
    """Per column, 2**e with 2**(e-1) <= max|a| < 2**e (1 for an all-zero column)."""
    largest = np.abs(a).max(axis=0) if a.size else np.zeros(a.shape[1:])
    _, exponent = np.frexp(largest)
    return np.where(largest > 0, np.ldexp(1.0, exponent), 1.0)


def column_statistics(a: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``(mean, std)`` of each column of ``a`` (``ddof=0``), in ``a``'s units, without
    overflow or underflow for any finite input (std is 0 only for a constant column)."""
    a = np.asarray(a, dtype=np.float64)
    scale = _power_of_two_scale(a)
    scaled = a / scale
    return scaled.mean(axis=0) * scale, scaled.std(axis=0) * scale


def standardize_columns(a: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """``(a - mean) / std`` evaluated on scaled values, so that ``a - mean`` cannot overflow."""
    a = np.asarray(a, dtype=np.float64)
    scale = _power_of_two_scale(np.stack([np.abs(np.atleast_1d(mean)), np.abs(np.atleast_1d(std))]))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return (a / scale - mean / scale) / (std / scale)


def check_finite_columns(
    array: np.ndarray, source: str, columns: Optional[Sequence[str]] = None, what: str = "column"
) -> None:
    """Raise :class:`DataError` naming the columns of ``array`` that hold NaN or infinity
    (e.g. after standardization or a float32 cast of values beyond its range)."""
    array = np.asarray(array)
    bad = ~np.isfinite(array)
    if not bad.any():
        return
    bad_columns = np.flatnonzero(bad.reshape(len(array), -1).any(axis=0)) if array.ndim > 1 else [0]
    names = [str(columns[i]) if columns is not None and i < len(columns) else f"#{i}" for i in bad_columns]
    raise DataError(
        f"{source}: {what} {shown_names(names)} overflow(s) when standardized "
        "(values too far apart for float32 after centring and scaling by the training rows); rescale or drop "
        "that column"
    )
