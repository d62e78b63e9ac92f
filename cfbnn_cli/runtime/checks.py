"""Validation of the configuration keys every pipeline shares.

Each check names the key, the value and the allowed values, and raises
:class:`ConfigError` before any work starts.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from omegaconf import DictConfig, OmegaConf

from .device import resolve_device
from .errors import ConfigError


def _get(cfg: DictConfig, key: str):
    value = OmegaConf.select(cfg, key, default=_MISSING)
    if value is _MISSING:
        raise ConfigError(f"config key `{key}` is missing; add `+{key}=...` or set it in the config")
    return value


_MISSING = object()


def require_int(cfg: DictConfig, key: str, minimum: int = None) -> int:
    value = _get(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={value!r} must be an integer")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key}={value} must be >= {minimum}")
    return value


def require_positive_float(cfg: DictConfig, key: str) -> float:
    value = _get(cfg, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{key}={value!r} must be a positive, finite number")
    return float(value)


def require_bool(cfg: DictConfig, key: str) -> bool:
    value = _get(cfg, key)
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false")
    return value


def require_choice(cfg: DictConfig, key: str, choices: Iterable[Any]):
    value = _get(cfg, key)
    choices = list(choices)
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {choices}")
    return value


def validate_common(cfg: DictConfig) -> None:
    """Check ``seed``, ``device``, ``resume``, ``runtime.threads``, ``runtime.flush_denormals``, ``trainer.epochs``, ``trainer.batch_size``,
    ``trainer.lr``."""
    require_int(cfg, "seed", minimum=0)
    resolve_device(_get(cfg, "device"))
    require_bool(cfg, "resume")
    threads = _get(cfg, "runtime.threads")
    if threads != "auto" and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"runtime.threads={threads!r} must be auto or a positive integer")
    require_bool(cfg, "runtime.flush_denormals")
    if OmegaConf.select(cfg, "trainer", default=None) is not None:
        require_int(cfg, "trainer.epochs", minimum=0)
        require_int(cfg, "trainer.batch_size", minimum=1)
        require_positive_float(cfg, "trainer.lr")
