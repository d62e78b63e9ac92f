"""Atomic file writes: a temporary file in the same directory, then ``os.replace``.

A reader (or a killed run) sees either the old file or the complete new one,
never a half-written file. The temporary file is named ``.<name>.cfbnn-<random>.tmp``:
the marker lets :func:`remove_stale_temporary_files` delete only what a killed cfbnn
write left behind, never a user's own ``.*.tmp`` files. ``os.replace`` swaps the
directory entry: a link at the target is replaced, never written through.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, List, TextIO

TEMPORARY_SUFFIX = ".tmp"
TEMPORARY_MARKER = ".cfbnn-"


def temporary_name_pattern(name: str = "*") -> str:
    """The glob of the temporary files :func:`atomic_write_bytes` makes for ``name``."""
    return f".{name}{TEMPORARY_MARKER}*{TEMPORARY_SUFFIX}"


def file_mode() -> int:
    """The mode ``open()`` would give a new file: 0o666 less the process umask
    (``mkstemp`` makes every file 0600, unlike the rest of the run dir)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write_bytes(path, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}{TEMPORARY_MARKER}", suffix=TEMPORARY_SUFFIX)
    try:
        os.fchmod(fd, file_mode())
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


@contextlib.contextmanager
def atomic_text_writer(path) -> Iterator[TextIO]:
    """A text handle whose contents become ``path`` only when the block ends without an
    error (a file written in parts, e.g. a prediction streamed chunk by chunk); otherwise
    ``path`` is as it was and the temporary file is gone."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}{TEMPORARY_MARKER}", suffix=TEMPORARY_SUFFIX)
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
    directly in ``folder`` (``.<name>.cfbnn-<random>.tmp``; not in its subfolders, and no other
    name); returns their names.

    Call it only while no other process writes there (e.g. holding the run-dir lock),
    and only on folders cfbnn itself writes into.
    """
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():
        return []
    removed = []
    for path in folder.glob(temporary_name_pattern()):
        if path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed
