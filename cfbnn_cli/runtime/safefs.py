"""Files cfbnn writes or loads that another user (or a link) must not be able to redirect.

Rules used by the run dir (lock, log, temporary files), the job registry and the
kernel cache:

* :func:`open_no_follow` opens a file for writing without following a symbolic
  link in its last component (``O_NOFOLLOW``); a link is refused with
  :class:`UnsafePathError`, whose message names the path and the fix.
* :func:`private_directory` makes (or checks) a directory that only this user can
  write: not a link, owned by this user, mode ``0700`` (a directory of ours with a
  wider mode is narrowed; one owned by anybody else is refused).
* :func:`owned_regular_file` checks that a file in such a directory is a regular
  file of ours that nobody else can write, before it is read or loaded;
  :func:`read_private_file` does the same checks on the file it opened (no link
  followed, never blocking on a FIFO) and reads at most a given size from that one
  open file.
* :func:`check_parents` checks every directory above a path: owned by root or by
  this user, and writable by nobody else (a sticky directory such as ``/tmp``
  excepted), so that no other user can rename or replace what lies below it.
* :func:`sealed_copy` puts bytes into an anonymous in-memory file that nobody,
  this user included, can change afterwards (a sealed ``memfd``): a library loaded
  from it is exactly the bytes that were checked.

Only the standard library is used: :mod:`cfbnn_cli.moments` (the lowest floor) and
the CLI import this module before torch.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import sys
from pathlib import Path
from typing import Union

PathLike = Union[str, "os.PathLike[str]"]

__all__ = [
    "UnsafePathError",
    "cache_root",
    "open_no_follow",
    "private_directory",
    "owned_regular_file",
    "read_private_file",
    "check_parents",
    "sealed_copy",
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


def read_private_file(path: PathLike, limit: int) -> bytes:
    """The bytes of ``path`` (at most ``limit``), read from one open file that was checked first.

    The file is opened once, without following a link and without blocking (a FIFO, a
    device or a socket never hangs the caller); that open file must be a regular file of
    this user that nobody else can write, no larger than ``limit``; the bytes returned
    are read from it. :class:`UnsafePathError` names what is wrong otherwise.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if os.path.islink(path):
            raise UnsafePathError(f"{path} is a symbolic link; cfbnn does not read through links") from None
        if error.errno == errno.ENXIO:  # a socket
            raise UnsafePathError(f"{path} is not a regular file") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafePathError(f"{path} is not a regular file")
        if info.st_uid != _this_user():
            raise UnsafePathError(f"{path} is owned by uid {info.st_uid}, not by you (uid {_this_user()})")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UnsafePathError(f"{path} is writable by other users")
        if info.st_size > limit:
            raise UnsafePathError(f"{path} is {info.st_size} bytes, more than the {limit} expected")
        chunks, size = [], 0
        while size <= limit:
            block = os.read(fd, min(1 << 20, limit + 1 - size))
            if not block:
                break
            chunks.append(block)
            size += len(block)
        if size > limit:  # grew while being read
            raise UnsafePathError(f"{path} is more than the {limit} bytes expected")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _ancestors(path: str):
    current = os.path.dirname(path)
    while True:
        yield current
        parent = os.path.dirname(current)
        if parent == current:
            return
        current = parent


def check_parents(path: PathLike) -> None:
    """Raise :class:`UnsafePathError` unless every directory above ``path`` is safe.

    Safe: owned by root or by this user, and not writable by group or others unless it
    has the sticky bit (``/tmp``: others may add entries but not rename or remove ours).
    Both the path as given (made absolute) and its resolved form are walked, so a link
    among the parents is judged by the directory that holds it and by where it leads.
    Whoever may write a parent could otherwise rename the directory below it and put
    another in its place between a check and a use.
    """
    given = os.path.abspath(os.fspath(path))
    resolved = os.path.realpath(given)
    seen = set()
    for directory in [*_ancestors(given), *_ancestors(resolved)]:
        if directory in seen:
            continue
        seen.add(directory)
        try:
            info = os.lstat(directory)
        except FileNotFoundError:
            continue  # not made yet: checked where it exists (the cache is made before it is checked)
        if stat.S_ISLNK(info.st_mode):
            continue  # the directory holding the link is the next one up; its target is walked as `resolved`
        if info.st_uid not in (0, _this_user()):
            raise UnsafePathError(
                f"{directory} (a parent of {given}) is owned by uid {info.st_uid}, neither root nor you "
                f"(uid {_this_user()}); its owner could replace what is below it: set CFBNN_CACHE_DIR "
                "to a directory under your home"
            )
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
            raise UnsafePathError(
                f"{directory} (a parent of {given}) is writable by other users (mode "
                f"{stat.S_IMODE(info.st_mode):o}); they could replace what is below it: set "
                "CFBNN_CACHE_DIR to a directory under your home, or remove that write permission"
            )


_MFD_EXEC = 0x0010  # memfd_create(2): an executable memfd, where vm.memfd_noexec would refuse it


def sealed_copy(data: bytes, name: str = "cfbnn") -> int:
    """A file descriptor of an anonymous in-memory file holding ``data``, sealed so that
    nobody (this user included) can write, grow or shrink it, or remove the seals.

    Loading ``/proc/self/fd/<fd>`` then maps exactly ``data``. Raises :class:`OSError`
    where the system has no sealed memfd (not Linux, or a kernel before 3.17)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        raise OSError("this system has no sealed in-memory files (memfd_create)")
    import fcntl

    base = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    try:
        fd = os.memfd_create(name, base | _MFD_EXEC)
    except OSError:  # a kernel before 6.3 does not know MFD_EXEC
        fd = os.memfd_create(name, base)
    try:
        view, written = memoryview(data), 0
        while written < len(data):
            written += os.write(fd, view[written:])
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & seals != seals:
            raise OSError("the in-memory copy could not be sealed")
    except BaseException:
        os.close(fd)
        raise
    return fd


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
