"""The ``data`` keys of a ``data=csv`` config as :func:`~.tabular.read_table`'s keywords (no torch:
the ``cfbnn`` command reads them before torch loads)."""

from __future__ import annotations

from typing import List, Optional

from omegaconf import OmegaConf

from ..runtime.errors import ConfigError


def names_option(cfg, key: str) -> Optional[List[str]]:
    """``data.<key>`` as a list of column names (``None`` where absent or null)."""
    value = OmegaConf.select(cfg, key, default=None)
    if value is None:
        return None
    if isinstance(value, str) or not OmegaConf.is_list(value) and not isinstance(value, (list, tuple)):
        raise ConfigError(f"data.{key}={value!r} must be a list of column names, e.g. data.{key}=[id,name]")
    return [str(v) for v in value]


def table_options(cfg) -> dict:
    """``data.features``, ``data.drop``, ``data.missing``, ``data.categorical``, ``data.unseen`` and
    ``data.target_transform`` of a ``data=csv`` config (absent keys: every column, refuse blank
    cells, nothing encoded or transformed)."""
    categorical = OmegaConf.select(cfg, "categorical", default=None)
    if categorical is not None and not (isinstance(categorical, str) and categorical in ("auto", "none")):
        categorical = names_option(cfg, "categorical")
    return {
        "features": names_option(cfg, "features"),
        "drop": names_option(cfg, "drop") or [],
        "missing": str(OmegaConf.select(cfg, "missing", default="error")),
        "categorical": categorical,
        "unseen": str(OmegaConf.select(cfg, "unseen", default="error")),
        "target_transform": str(OmegaConf.select(cfg, "target_transform", default="none")),
    }
