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


# upper bounds of every size and count key, checked before anything is allocated: a typo's
# 10000000000000 rows or a width of 1e11 is one line naming the key, not a failed allocation
MAX_COUNT = 100_000_000  # rows, samples, epochs, iterations, batch sizes: any count
MAX_WIDTH = 1_000_000  # one layer's width, a table's columns
MAX_WEIGHTS = 200_000_000  # the weights between a network's hidden layers (a few GB with their optimizer state)
MAX_VALUES = 500_000_000  # the numbers of a generated table (rows x columns: 4 GB as float64)


def require_int(cfg: DictConfig, key: str, minimum: int = None, maximum: int = None, why: str = "") -> int:
    """An integer key in ``[minimum, maximum]``; without ``maximum``, at most :data:`MAX_COUNT`."""
    value = _get(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={_short(value)} must be an integer")
    if maximum is None and value > MAX_COUNT:
        raise ConfigError(f"{key}={_short(value)} must be <= {MAX_COUNT:,} (the bound on any count cfbnn takes)")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key}={_short(value)} must be >= {minimum}{why}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{key}={_short(value)} must be <= {maximum}{why}")
    return value


def _short(value) -> str:
    """A value as the user typed it, cut to fit one line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:40] + f"... ({len(text)} characters)"


MATMUL_PRECISIONS = ("highest", "high", "medium")  # torch.set_float32_matmul_precision's values
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
    if len(widths) > 1000 or max(widths) > MAX_WIDTH:
        raise ConfigError(f"{key}={_short(value)}: at most 1,000 layers of at most {MAX_WIDTH:,} units each")
    weights = sum(a * b for a, b in zip(widths[:-1], widths[1:]))
    if weights > MAX_WEIGHTS:
        raise ConfigError(
            f"{key}={_short(value)} asks for {weights:,} weights between its layers; at most {MAX_WEIGHTS:,}"
        )
    return widths


def require_table_size(cfg: DictConfig, rows: Iterable[str], columns: str) -> None:
    """A generated table's rows (the sum of the ``rows`` keys) x its ``columns`` key: at most
    :data:`MAX_VALUES` numbers (keys that are absent or null are left out)."""
    counts = [OmegaConf.select(cfg, key, default=None) for key in rows]
    width = OmegaConf.select(cfg, columns, default=None)
    if width is None or any(not isinstance(c, int) or isinstance(c, bool) for c in [*counts, width] if c is not None):
        return
    total = sum(c for c in counts if c is not None) * width
    if total > MAX_VALUES:
        named = " + ".join(f"{key}={c}" for key, c in zip(rows, counts) if c is not None)
        raise ConfigError(f"({named}) x {columns}={width} is {total:,} numbers; at most {MAX_VALUES:,}: lower them")


def refuse_huge_integers(cfg: DictConfig) -> None:
    """Every integer of the config (not a seed) at most :data:`MAX_COUNT`: a key no check names is
    bounded too, before any work."""
    container = OmegaConf.to_container(cfg, resolve=False)  # an interpolation is checked where it is read
    stack = [("", container, False)]
    while stack:
        key, node, in_list = stack.pop()
        if isinstance(node, dict):
            stack.extend((f"{key}.{k}" if key else str(k), v, False) for k, v in node.items() if k != "hydra")
        elif isinstance(node, list):
            stack.extend((key, v, True) for v in node)
        elif isinstance(node, int) and not isinstance(node, bool) and abs(node) > MAX_COUNT:
            if not key.rsplit(".", 1)[-1].endswith("seed"):
                where = f"{key} contains {_short(node)}" if in_list else f"{key}={_short(node)}"
                raise ConfigError(f"{where}: at most {MAX_COUNT:,} (the bound on any count or size cfbnn takes)")


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


def require_fraction(cfg: DictConfig, key: str, upper: float, meaning: str) -> float:
    """A number strictly between 0 and ``upper``; the error says what the share is for (``meaning``)."""
    value = _get(cfg, key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < upper:
        raise ConfigError(f"{key}={_short(value)} must be a number in (0, {upper:g}): {meaning}")
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
    """Check ``seed``, ``resume``, ``overwrite``, ``runtime.threads``, ``runtime.flush_denormals``,
    ``runtime.matmul_precision``, ``trainer.epochs``, ``trainer.batch_size``,
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
    precision = _get(cfg, "runtime.matmul_precision")
    if precision not in MATMUL_PRECISIONS:
        raise ConfigError(
            f"runtime.matmul_precision={_short(precision)} is not one of {', '.join(MATMUL_PRECISIONS)} "
            "(highest: full float32 matrix products, the default; high: TF32 on Ampere+ GPUs; medium: bfloat16)"
        )
    refuse_huge_integers(cfg)
    if OmegaConf.select(cfg, "trainer", default=None) is not None:
        require_int(cfg, "trainer.epochs", minimum=0)
        require_int(cfg, "trainer.batch_size", minimum=1)
        require_positive_float(cfg, "trainer.lr")
        require_bool(cfg, "trainer.cuda_graphs")
