"""Validation of the configuration keys every pipeline shares.

Each check names the key, the value and the allowed values, and raises
:class:`ConfigError` before any work starts.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from omegaconf import DictConfig, ListConfig, OmegaConf

from .errors import ConfigError


def _get(cfg: DictConfig, key: str):
    value = OmegaConf.select(cfg, key, default=_MISSING)
    if value is _MISSING:
        raise ConfigError(f"config key `{key}` is missing; add `+{key}=...` or set it in the config")
    return value


_MISSING = object()


def require_int(cfg: DictConfig, key: str, minimum: int = None, maximum: int = None, why: str = "") -> int:
    value = _get(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={_short(value)} must be an integer")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key}={_short(value)} must be >= {minimum}{why}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{key}={_short(value)} must be <= {maximum}{why}")
    return value


def _short(value) -> str:
    """A value as the user typed it, cut to fit one line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:40] + f"... ({len(text)} characters)"


SEED_MAXIMUM = 2**32 - 1  # numpy's and Python's random generators take seeds in [0, 2**32)
THREADS_PER_CORE = 4  # more threads than this per core only oversubscribes (and OpenMP crashes at ~1e6)


def max_threads() -> int:
    """The largest ``runtime.threads`` accepted: the machine's cores times :data:`THREADS_PER_CORE`."""
    import os

    return (os.cpu_count() or 1) * THREADS_PER_CORE


def require_widths(cfg: DictConfig, key: str, minimum_length: int = 1, example: str = "[200,200]") -> list:
    """A list of at least ``minimum_length`` positive integers (layer widths), as a plain list."""
    value = _get(cfg, key)
    widths = list(value) if isinstance(value, (list, tuple, ListConfig)) else None
    if (
        widths is None
        or len(widths) < minimum_length
        or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in widths)
    ):
        least = "non-empty" if minimum_length == 1 else f"{minimum_length} or more long"
        raise ConfigError(f"{key}={_short(value)} must be a {least} list of positive integers, e.g. {example}")
    return widths


def require_present_bounds(
    cfg: DictConfig,
    counts: dict = None,
    fractions: Iterable[str] = (),
    seeds: Iterable[str] = (),
    nonnegative: Iterable[str] = (),
) -> None:
    """Bounds on the keys of ``cfg`` that are set (absent or null keys are left alone): ``counts``
    maps an integer key to its minimum; ``fractions`` lie strictly between 0 and 1; ``seeds`` in
    the generators' range; ``nonnegative`` are finite numbers >= 0."""
    present = lambda key: OmegaConf.select(cfg, key, default=None) is not None  # noqa: E731
    for key, minimum in (counts or {}).items():
        if present(key):
            require_int(cfg, key, minimum=minimum)
    for key in fractions:
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1):
            raise ConfigError(f"{key}={_short(value)} must be a number between 0 and 1")
    for key in seeds:
        if present(key):
            require_int(cfg, key, minimum=0, maximum=SEED_MAXIMUM, why=" (the random generators' range)")
    for key in nonnegative:
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf
        ):
            raise ConfigError(f"{key}={_short(value)} must be a finite number >= 0")


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
    """Check ``seed``, ``resume``, ``overwrite``, ``runtime.threads``, ``runtime.flush_denormals``, ``trainer.epochs``, ``trainer.batch_size``,
    ``trainer.lr``, ``trainer.cuda_graphs``."""
    require_int(cfg, "seed", minimum=0, maximum=SEED_MAXIMUM, why=" (the random generators' range)")
    require_bool(cfg, "resume")
    if OmegaConf.select(cfg, "overwrite", default=None) is not None:
        require_bool(cfg, "overwrite")
        if cfg.resume and cfg.overwrite:
            raise ConfigError(
                "resume=true and overwrite=true contradict each other: resume=true continues the run in the dir, "
                "overwrite=true replaces it; give one"
            )
    threads = _get(cfg, "runtime.threads")
    if threads != "auto" and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"runtime.threads={_short(threads)} must be auto or a positive integer")
    if threads != "auto" and threads > max_threads():
        raise ConfigError(
            f"runtime.threads={threads} is more than {THREADS_PER_CORE} per core on this machine "
            f"({max_threads()} at most); use auto or a smaller number"
        )
    require_bool(cfg, "runtime.flush_denormals")
    if OmegaConf.select(cfg, "trainer", default=None) is not None:
        require_int(cfg, "trainer.epochs", minimum=0)
        require_int(cfg, "trainer.batch_size", minimum=1)
        require_positive_float(cfg, "trainer.lr")
        require_bool(cfg, "trainer.cuda_graphs")
