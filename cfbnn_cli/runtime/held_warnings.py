"""Library warnings held back until the command's outcome is known.

numpy, torch, scikit-learn and matplotlib warn on stderr as they go (``RuntimeWarning: overflow
encountered``, ``UserWarning: ...``), each in two lines with a source line. Before a command's
one-line error they bury it; before its results they are noise in the middle of a table. The
``cfbnn`` command holds them (:func:`holding_warnings`): each distinct warning is written at once
to the run's log (where a run has one) and, once the command has succeeded, to stderr as one
line (``cfbnn: warning: ...``). A command that fails shows its one-line error alone; its log has
the warnings.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from typing import Iterator, List

from .errors import clip

WARNING_LIMIT = 300  # characters of one warning's line


class HeldWarnings:
    """The distinct warnings of a command, each as one line."""

    def __init__(self):
        self.lines: List[str] = []
        self._seen = set()

    def hold(self, message, category, filename, lineno, file=None, line=None) -> None:
        key = (getattr(category, "__name__", str(category)), str(message))
        if key in self._seen:
            return
        self._seen.add(key)
        text = clip(f"{key[0]}: {message} ({os.path.basename(str(filename))}:{lineno})", WARNING_LIMIT)
        self.lines.append(text)
        record = logging.getLogger("py.warnings").makeRecord(
            "py.warnings", logging.WARNING, str(filename), int(lineno or 0), "%s", (text,), None
        )
        for handler in logging.getLogger().handlers:  # the run's log, not the console
            if isinstance(handler, logging.FileHandler):
                with contextlib.suppress(Exception):
                    handler.handle(record)

    def show(self, stream=None) -> None:
        """Each held warning as one line on ``stream`` (stderr)."""
        stream = stream or sys.stderr
        for text in self.lines:
            print(f"cfbnn: warning: {text}", file=stream)
        with contextlib.suppress(Exception):
            stream.flush()


@contextlib.contextmanager
def holding_warnings() -> Iterator[HeldWarnings]:
    """Within the block every warning shown goes to a :class:`HeldWarnings` (and the run's log)
    instead of stderr; the caller shows them once it knows the command succeeded."""
    held = HeldWarnings()
    previous = warnings.showwarning
    warnings.showwarning = held.hold
    try:
        yield held
    finally:
        warnings.showwarning = previous
