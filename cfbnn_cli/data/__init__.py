"""Datasets and loaders shared by the pipelines (no downloads at run time).

Nothing is imported eagerly: the ``cfbnn`` command reads a table's header (:mod:`.header_check`)
before torch loads, and :mod:`.regression` imports torch. The names below resolve on first use.
"""

import importlib

_EXPORTS = {"RegressionData": "regression", "load_regression_data": "regression"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
