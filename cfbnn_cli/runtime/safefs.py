"""Files cfbnn writes or loads that another user (or a link) must not be able to redirect.

Three rules, used by the run dir (lock, log, temporary files), the job registry and
the kernel cache:

* :func:`open_no_follow` opens a file for writing without following a symbolic
  link in its last component (``O_NOFOLLOW``); a link is refused with
  :class:`UnsafePathError`, whose message names the path and the fix.
* :func:`private_directory` makes (or checks) a directory that only this user can
  write: not a link, owned by this user, mode ``0700`` (a directory of ours with a
  wider mode is narrowed; one owned by anybody else is refused).
* :func:`owned_regular_file` checks that a file in such a directory is a regular
  file of ours that nobody else can write, before it is read or loaded.

Only the standard library is used: :mod:`cfbnn_cli.moments` (the lowest floor) and
the CLI import this module before torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path
from typing import Union

PathLike = Union[str, "os.PathLike[str]"]

__all__ = [
    "UnsafePathError",
    "cache_root",
    "open_no_follow",
    "private_directory",
    "owned_regular_file",
    "sha256_of_file",
    "NoFollowFileHandler",
]


class UnsafePathError(OSError):
    """A path cfbnn would write or load through is a link, or belongs to someone else."""


def cache_root() -> Path:
    """cfbnn's per-user cache: ``$CFBNN_CACHE_DIR``, else ``$XDG_CACHE_HOME/cfbnn``, else ``~/.cache/cfbnn``."""
    explicit = os.environ.get("CFBNN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cfbnn"


def _this_user() -> int:
    return os.geteuid()


def open_no_follow(path: PathLike, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags | O_NOFOLLOW)``; a symbolic link at ``path`` raises :class:`UnsafePathError`."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError:
        if os.path.islink(path):  # ELOOP on Linux, EMLINK on the BSDs
            raise UnsafePathError(
                f"{path} is a symbolic link; cfbnn does not write through links: remove the link "
                "(or choose another directory)"
            ) from None
        raise


def private_directory(path: PathLike) -> Path:
    """Create ``path`` (and its parents) if needed and check that only this user can write it.

    The directory itself must not be a link, must be owned by this user, and ends
    with mode ``0700`` (a wider mode on a directory of ours is narrowed). Raises
    :class:`UnsafePathError` naming the owner otherwise.
    """
    path = Path(path)
    if not path.is_symlink() and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # made by a process beside us meanwhile: checked below like any other
            pass
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UnsafePathError(
            f"{path} is a symbolic link; cfbnn keeps its cache only in a directory "
            "of its own: remove the link or set CFBNN_CACHE_DIR to a directory you own"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafePathError(f"{path} is not a directory; remove it or set CFBNN_CACHE_DIR elsewhere")
    if info.st_uid != _this_user():
        raise UnsafePathError(
            f"{path} is owned by uid {info.st_uid}, not by you (uid {_this_user()}); cfbnn loads code "
            "only from a directory of your own: set CFBNN_CACHE_DIR to one"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def owned_regular_file(path: PathLike) -> os.stat_result:
    """``lstat`` of ``path`` after checking it is a regular file of this user that nobody else may write."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise UnsafePathError(f"{path} is not a regular file")
    if info.st_uid != _this_user():
        raise UnsafePathError(f"{path} is owned by uid {info.st_uid}, not by you (uid {_this_user()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePathError(f"{path} is writable by other users")
    return info


def sha256_of_file(path: PathLike, chunk: int = 1 << 20) -> str:
    """The hex SHA-256 of a file's bytes (read without following a link)."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as handle:
        for block in iter(lambda: handle.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


class NoFollowFileHandler(logging.FileHandler):
    """:class:`logging.FileHandler` that opens its file with :func:`open_no_follow`: a ``<job>.log``
    planted as a link is refused (:class:`UnsafePathError`), not appended through. Hydra's
    job logging uses it (``conf/shared/base.yaml``).

    It remembers what it found at its first open -- ``created`` (the file was not there) and
    ``found_size`` (its length then) -- so that a run refused before any work can leave its
    dir as it was (:class:`cfbnn_cli.runtime.rundir.RunDirState`)."""

    created = None
    found_size = 0

    def _open(self):
        mask = os.umask(0)
        os.umask(mask)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in self.mode else os.O_TRUNC)
        existed = os.path.lexists(self.baseFilename)
        fd = open_no_follow(self.baseFilename, flags, 0o666 & ~mask)
        if self.created is None:
            self.created, self.found_size = not existed, os.fstat(fd).st_size
        return os.fdopen(fd, self.mode.replace("b", ""), encoding=self.encoding, errors=self.errors)
