"""A run dir's log file (Hydra's ``<job>.log``) while the run does not yet own the dir: its handlers
found (:func:`log_handlers_in`) and held back with their records until the run holds the dir's
lock (:class:`LogsHeldBack`), so that a refused run writes nothing into another run's log."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import List


def log_handlers_in(run_dir) -> List[logging.FileHandler]:
    """The root logger's file handlers writing into ``run_dir`` (Hydra's ``<job>.log``)."""
    try:
        folder = Path(run_dir).resolve()
    except OSError:
        return []
    found = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            try:
                if Path(handler.baseFilename).resolve().parent == folder:
                    found.append(handler)
            except OSError:
                continue
    return found


class LogsHeldBack:
    """The run dir's log handlers (:func:`log_handlers_in`), detached from the root logger until
    this run holds the dir's lock: a run refused because another one writes there (or refused
    before it takes the lock) adds nothing to that run's log. Records logged meanwhile wait in
    memory and go to the log when :meth:`release` is called (the lock is held)."""

    def __init__(self, handlers):
        self.handlers = list(handlers)
        self.records: List[logging.LogRecord] = []
        self._catcher = _Catcher(self.records)
        root = logging.getLogger()
        for handler in self.handlers:
            root.removeHandler(handler)
        if self.handlers:
            root.addHandler(self._catcher)

    def release(self) -> None:
        """The lock is held: the handlers back on the root logger, the waiting records written."""
        root = logging.getLogger()
        if self._catcher not in root.handlers:
            return
        root.removeHandler(self._catcher)
        for handler in self.handlers:
            root.addHandler(handler)
            for record in self.records:
                if record.levelno >= handler.level:
                    handler.handle(record)
        self.records.clear()

    def drop(self) -> None:
        """Stop holding records back (those held are dropped; the handlers stay detached)."""
        logging.getLogger().removeHandler(self._catcher)
        self.records.clear()


class _Catcher(logging.Handler):
    def __init__(self, records: list):
        super().__init__()
        self._records = records

    def emit(self, record: logging.LogRecord) -> None:
        if len(self._records) < 10000:
            self._records.append(record)
