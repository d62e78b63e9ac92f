"""Rows handed to the library (``SavedModel.predict``): a pandas DataFrame read by column name, or
an array or tensor read by position, put through the same reader as ``cfbnn predict``'s CSV
(:class:`~.layout.InputLayout`).

A DataFrame's columns are matched by name (any order; the target and the columns the training run
left out are ignored; a column the model reads and the frame lacks, or one the model knows nothing
of, is named). A column of any numeric dtype reads as its numbers (pandas' nullable ``Int64`` and
``boolean`` included, ``<NA>`` blank), a text column as a CSV's cells would. An array may be of
any numeric dtype and any strides (a reversed slice included). Every problem is a ``ValueError``
naming the argument, the column and the row.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

from ..runtime.errors import DataError
from .cells import names
from .layout import InputLayout

FRAME_FIX = "leave them out first, e.g. frame.drop(columns=[...])"


def is_frame(x) -> bool:
    """A pandas DataFrame (checked without importing pandas where it is not loaded)."""
    import sys

    pandas = sys.modules.get("pandas")
    return pandas is not None and isinstance(x, pandas.DataFrame)


def _column(series, name: str) -> np.ndarray:
    """One column's values: float64 (NaN blank) for a numeric dtype, else the cells as objects."""
    import pandas as pd

    dtype = series.dtype
    if isinstance(dtype, pd.CategoricalDtype):
        return np.asarray(series.astype(object), dtype=object)
    if pd.api.types.is_bool_dtype(dtype) or (
        pd.api.types.is_numeric_dtype(dtype) and not pd.api.types.is_complex_dtype(dtype)
    ):
        return series.to_numpy(dtype=np.float64, na_value=np.nan)
    if pd.api.types.is_object_dtype(dtype) or pd.api.types.is_string_dtype(dtype):
        return np.asarray(series, dtype=object)
    raise ValueError(f"`x`: column `{name}` is of type {dtype}, not numbers or text; convert it first")


def _array_column(x: np.ndarray, j: int) -> np.ndarray:
    column = x[:, j]
    if column.dtype.kind in "biuf":
        return column.astype(np.float64)
    if column.dtype.kind in "OUS":
        return column.astype(object)
    raise ValueError(f"`x` is of type {x.dtype}, not numbers or text")


def _as_array(x) -> np.ndarray:
    try:
        import torch

        if isinstance(x, torch.Tensor):
            if x.is_complex():
                raise ValueError(f"`x` is a {x.dtype} tensor; give real numbers")
            return x.detach().cpu().numpy() if x.dtype != torch.bfloat16 else x.detach().float().cpu().numpy()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return np.asarray(x)


def model_features(x, layout: Optional[InputLayout], input_dim: int, *, unseen: Optional[str] = None) -> np.ndarray:
    """``x`` as the network's ``(N, input_dim)`` float64 features (before standardization).

    ``layout``: the model's columns (``None``: a model of unnamed features, read by position).
    A row with a blank cell comes out with NaN (the library's rule: NaN in, NaN out).
    """
    try:
        if is_frame(x):
            if layout is None:
                x = x.to_numpy()
            else:
                positions, _ = layout.match([str(c) for c in x.columns], "`x`", extra_fix=FRAME_FIX)
                values = [_column(x.iloc[:, p], layout.columns[j]) for j, p in enumerate(positions)]
                return layout.encode(values, "`x`", np.arange(1, len(x) + 1), unseen=unseen)[0]
        array = _as_array(x)
        width = len(layout.columns) if layout is not None else input_dim
        if array.ndim != 2 or array.shape[1] != width:
            raise ValueError(
                f"`x` must be (N, {width}) rows of the model's columns"
                + (f" ({names(layout.columns)}) in that order" if layout else "")
                + f", or a DataFrame with them by name; got shape {tuple(array.shape)}"
            )
        if array.dtype.kind == "c":
            raise ValueError(f"`x` is of type {array.dtype}; give real numbers")
        if layout is None or (not layout.categorical and array.dtype.kind in "biuf"):
            return np.array(array, dtype=np.float64)  # a copy: any strides, any numeric dtype
        values: List[np.ndarray] = [_array_column(array, j) for j in range(width)]
        return layout.encode(values, "`x`", np.arange(1, len(array) + 1), unseen=unseen)[0]
    except DataError as error:
        raise ValueError(str(error)) from None
