"""Atomic file writes: a temporary file in the same directory, then ``os.replace``.

A reader (or a killed run) sees either the old file or the complete new one,
never a half-written file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, List


TEMPORARY_SUFFIX = ".tmp"


def _file_mode() -> int:
    """The mode ``open()`` would give a new file: 0o666 less the process umask
    (``mkstemp`` makes every file 0600, unlike the rest of the run dir)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write_bytes(path, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMPORARY_SUFFIX)
    try:
        os.fchmod(fd, _file_mode())
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def atomic_torch_save(obj: Any, path) -> Path:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return atomic_write_bytes(path, buffer.getvalue())


def _json_default(value):
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, np.ndarray):
            return value.tolist()
    except ImportError:  # pragma: no cover
        pass
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def remove_stale_temporary_files(folder) -> List[str]:
    """Delete the temporary files of :func:`atomic_write_bytes` that a killed process left
    under ``folder`` (``.<name>.<random>.tmp``); returns their paths relative to ``folder``.

    Call it only while no other process writes there (e.g. holding the run-dir lock).
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for path in folder.rglob(f".*{TEMPORARY_SUFFIX}"):
        if path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)
            removed.append(str(path.relative_to(folder)))
    return removed
