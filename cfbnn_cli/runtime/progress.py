"""Progress bars for a terminal only: every bar cfbnn draws is made by :func:`progress_bar`.

A bar redraws itself with ``\\r``; in a redirected stderr (a log file, a SLURM output, the
jobs of a joblib sweep writing to one file) that is kilobytes of half lines. So a bar is
drawn only when stderr is a terminal (or a notebook shows it as a widget).
``CFBNN_PROGRESS`` overrides that: ``1`` draws bars anyway -- in a file at most one update
every :data:`FILE_INTERVAL_S` seconds -- ``0`` never draws them, ``auto`` (or unset) is the
default; any other value is a :class:`~cfbnn_cli.runtime.errors.ConfigError`.
"""

from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm

from .errors import ConfigError

ENV = "CFBNN_PROGRESS"
FILE_INTERVAL_S = 30.0  # CFBNN_PROGRESS=1 with stderr not a terminal: one update per this many seconds

__all__ = ["ENV", "FILE_INTERVAL_S", "progress_bar", "progress_setting", "stderr_is_terminal"]
_ON = ("1", "true", "yes", "on", "always")
_OFF = ("0", "false", "no", "off", "never")


def stderr_is_terminal() -> bool:
    """Whether stderr is a terminal, or bars are notebook widgets (which write no ``\\r`` lines)."""
    if tqdm.__module__.startswith("tqdm.notebook"):
        return True
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError, OSError):  # closed or replaced by an object without isatty
        return False


def progress_setting() -> str:
    """``"on"``, ``"off"`` or ``"auto"`` from ``CFBNN_PROGRESS``; another value raises :class:`ConfigError`."""
    raw = os.environ.get(ENV, "")
    setting = raw.strip().lower()
    if setting in _ON:
        return "on"
    if setting in _OFF:
        return "off"
    if setting in ("", "auto"):
        return "auto"
    raise ConfigError(
        f"{ENV}={raw!r} is not one of 1, 0, auto: set {ENV}=1 (progress bars even when stderr is not a "
        f"terminal), {ENV}=0 (none) or unset it (bars on a terminal only)"
    )


def progress_bar(iterable=None, *, disable: bool = False, **kwargs) -> tqdm:
    """``tqdm(iterable, **kwargs)``, disabled unless stderr is a terminal (``CFBNN_PROGRESS``
    overrides: ``1`` on, rate-limited in a file; ``0`` off). ``disable=True`` (a worker that is
    not the main one, nothing to count) always wins."""
    setting = progress_setting()
    terminal = stderr_is_terminal()
    if setting == "on" and not terminal:
        kwargs.setdefault("mininterval", FILE_INTERVAL_S)
    wanted = setting == "on" or (setting == "auto" and terminal)
    return tqdm(iterable, disable=bool(disable) or not wanted, **kwargs)
