"""Atomic file writes: a temporary file in the same directory, then ``os.replace``.

A reader (or a killed run) sees either the old file or the complete new one,
never a half-written file. The temporary file is named ``.<name>.cfbnn-<random>.tmp`` and
its writer holds an ``flock`` on it: :func:`remove_stale_temporary_files` deletes only what a
killed cfbnn write left behind (the kernel released its lock), never a write still going on,
nor a user's own ``.*.tmp`` files. ``os.replace`` swaps the directory entry: a file with
another name (a hard link) is replaced, never written through; a symbolic link at the
target, or in a folder below the run dir, is refused (:func:`cfbnn_cli.runtime.safefs.output_file`).
A file that was there keeps its permission bits (a ``0600`` file stays ``0600``); a new one
gets the mode ``open()`` would give it.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, List, Optional, TextIO

from .safefs import output_file

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


def _lock(fd: int) -> None:
    """Mark a temporary file as being written (:func:`remove_stale_temporary_files` leaves it)."""
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (ImportError, OSError):  # pragma: no cover - no flock here: nothing to mark
        pass


def _temporary_for(path: Path):
    """``(fd, name)`` of a new temporary file beside ``path``, locked, with the mode ``path`` will have."""
    found = output_file(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}{TEMPORARY_MARKER}", suffix=TEMPORARY_SUFFIX)
    except OSError as error:  # named after the file being written, not its temporary name
        error.filename = str(path)
        raise
    _lock(fd)
    keep = found is not None and stat.S_ISREG(found.st_mode)
    os.fchmod(fd, stat.S_IMODE(found.st_mode) if keep else file_mode())
    return fd, tmp


# the file sets being written (file_set): each a list of (temporary, path, locked descriptor) renamed at its end
_SETS: List[list] = []


@contextlib.contextmanager
def file_set() -> Iterator[None]:
    """Within the block, the files written by :func:`atomic_write_bytes` and its kin appear together
    when the block ends without an error: each is written whole to its temporary file first, and
    all are renamed over their names at the end. Where the block fails (a full disk, Ctrl-C), every
    temporary file goes and each name keeps its old file: a set of files that belong together (a
    report's table in three forms and its figure) is never left half new and half old."""
    staged: list = []
    _SETS.append(staged)
    try:
        yield
    except BaseException:
        _SETS.remove(staged)
        for temporary, _, fd in staged:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            os.close(fd)
        raise
    _SETS.remove(staged)
    try:
        for temporary, path, _ in staged:
            os.replace(temporary, path)
    finally:
        for temporary, _, fd in staged:
            with contextlib.suppress(OSError):
                if os.path.exists(temporary):
                    os.unlink(temporary)
            os.close(fd)


@contextlib.contextmanager
def _atomic_replacement(path, **open_options) -> Iterator:
    """A handle on a locked temporary file beside ``path`` (``open_options`` as ``os.fdopen``'s)
    that becomes ``path`` by ``os.replace`` when the block ends without an error (in a
    :func:`file_set`, when the set ends); otherwise ``path`` is as it was and the temporary file is
    gone. An error writing it (a full disk) names ``path``."""
    path = Path(path)
    fd, tmp = _temporary_for(path)
    held = None  # in a file set: a second descriptor, keeping the temporary file's lock until the set is renamed
    try:
        held = os.dup(fd) if _SETS else None
        try:
            with os.fdopen(fd, **open_options) as handle:
                yield handle
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as error:
            if error.filename is None:  # write(), fsync(), close(): ENOSPC, EIO, EDQUOT
                error.filename = str(path)
            raise
        if held is not None:
            _SETS[-1].append((tmp, path, held))
        else:
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if held is not None:  # not staged: the error came before
            os.close(held)
        raise


def atomic_write_bytes(path, data: bytes) -> Path:
    with _atomic_replacement(path, mode="wb") as handle:
        handle.write(data)
    return Path(path)


STDOUT = "-"  # an output path that means the standard output


@contextlib.contextmanager
def text_output(path) -> Iterator[TextIO]:
    """Where a command writes its text output: ``-`` (:data:`STDOUT`) streams to the standard output
    (a pipe reads it as it comes; a failure ends the stream with the exit status saying so); any
    other path is written atomically (:func:`atomic_text_writer`), after the temporary files a
    killed writer left for it are removed."""
    if str(path) == STDOUT:
        yield sys.stdout
        sys.stdout.flush()
        return
    remove_stale_temporary_files(Path(path).parent, Path(path).name)
    with atomic_text_writer(path) as handle:
        yield handle


def atomic_text_writer(path) -> "contextlib.AbstractContextManager[TextIO]":
    """A text handle whose contents become ``path`` only when the block ends without an
    error (a file written in parts, e.g. a prediction streamed chunk by chunk); otherwise
    ``path`` is as it was and the temporary file is gone."""
    return _atomic_replacement(path, mode="w", encoding="utf-8", newline="")


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


def _left_by_a_killed_write(path: Path) -> bool:
    """Is ``path`` a regular file whose writer is gone (no process holds its lock)?"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a write going on
        except (ImportError, OSError):  # pragma: no cover - no flock: trust the caller's lock
            pass
        return True
    finally:
        os.close(fd)


def remove_stale_temporary_files(folder, name: Optional[str] = None) -> List[str]:
    """Delete the temporary files of :func:`atomic_write_bytes` that a killed process left
    directly in ``folder`` (``.<name>.cfbnn-<random>.tmp``, of ``name`` only where given; not in
    its subfolders, and no other name); returns their names. A temporary file whose writer is
    still running (it holds its lock) is left alone.

    Call it only on folders cfbnn itself writes into.
    """
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():
        return []
    removed = []
    for path in folder.glob(temporary_name_pattern("*" if name is None else glob_escape(name))):
        if not path.is_symlink() and _left_by_a_killed_write(path):
            try:
                path.unlink(missing_ok=True)
            except OSError:  # a folder this user cannot change: left, as anything else there
                continue
            removed.append(path.name)
    return removed


def glob_escape(name: str) -> str:
    """``name`` with the glob's special characters taken literally."""
    import glob

    return glob.escape(name)
