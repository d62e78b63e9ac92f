"""Files cfbnn writes or loads that another user (or a link) must not be able to redirect.

The rules, used by every writer of a run dir (lock, log, checkpoints, tables, figures,
TensorBoard, temporary files), by ``predict`` and ``report``, the job registry and the
kernel cache:

* :func:`output_folder` and :func:`output_file` check a folder or file before anything is
  written there. Below the folder a command writes under (:func:`writing_under`: the run
  dir, or the folder given with ``--out``) every folder is made or checked one by one and
  a symbolic link is refused; a link at the file itself is refused everywhere. The folder
  named by the user (``hydra.run.dir``, ``--out``) is taken as given.
* :func:`open_in_place` opens a file cfbnn writes in place (the log, the lock, a
  registry entry) without following a link (``O_NOFOLLOW``; a link is refused with
  :class:`UnsafePathError`, whose message names the path and the fix), and never writes
  through a hard link: a file with another name (``st_nlink > 1``) is first replaced by a
  copy of its own (same bytes and mode), so the other name keeps its content. Every other
  file is written whole to a temporary file and renamed over its name
  (:mod:`cfbnn_cli.runtime.io`), which replaces a hard link rather than writing through it.
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

import contextlib
import errno
import hashlib
import logging
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Iterator, List, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]

__all__ = [
    "UnsafePathError",
    "cache_root",
    "writing_under",
    "output_folder",
    "output_file",
    "open_in_place",
    "describe_file",
    "shown_path",
    "unwritable_reason",
    "unwritable_message",
    "output_error",
    "open_no_follow",
    "private_directory",
    "owned_regular_file",
    "read_private_file",
    "check_parents",
    "sealed_copy",
    "sha256_of_file",
    "NoFollowFileHandler",
    "output_over_input",
    "input_error",
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


# ----------------------------------------------------------------------------- outputs

_ROOTS: List[Path] = []  # the folders commands write under, innermost last (see writing_under)
SHOWN_PATH_LIMIT = 160  # characters of a path an error message shows


def shown_path(path: PathLike) -> str:
    """``path`` for an error message: cut to its first and last characters where it is long,
    with its length named."""
    text = os.fsdecode(path)
    if len(text) <= SHOWN_PATH_LIMIT:
        return text
    half = SHOWN_PATH_LIMIT // 2
    return f"{text[:half]}...{text[-half:]} (a path of {len(text)} characters)"


@contextlib.contextmanager
def writing_under(root: PathLike) -> Iterator[Path]:
    """Within the block, :func:`output_folder` checks every folder below ``root`` (a run dir,
    or the folder a command was told to write to): none may be a symbolic link. ``root``
    itself is the user's choice and is taken as given."""
    root = Path(os.path.abspath(root))
    _ROOTS.append(root)
    try:
        yield root
    finally:
        del _ROOTS[len(_ROOTS) - 1 - _ROOTS[::-1].index(root)]


def _root_of(folder: Path) -> Optional[Path]:
    for root in reversed(_ROOTS):
        if folder == root or root in folder.parents:
            return root
    return None


def _link_error(path: PathLike) -> UnsafePathError:
    return UnsafePathError(
        f"{shown_path(path)} is a symbolic link; cfbnn does not write through links: remove the link "
        "(or choose another directory)"
    )


def output_folder(folder: PathLike) -> Path:
    """Make ``folder`` (and its missing parents) for writing, following no link below the
    folder a command writes under (:func:`writing_under`): each folder there is made, or
    checked to be a folder and not a symbolic link (:class:`UnsafePathError` otherwise).
    Outside any such root it is ``mkdir -p``."""
    folder = Path(os.path.abspath(folder))
    root = _root_of(folder)
    if root is None:
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    root.mkdir(parents=True, exist_ok=True)
    current = root
    for part in folder.relative_to(root).parts:
        current = current / part
        try:
            os.mkdir(current)
        except FileExistsError:
            pass
        info = os.lstat(current)
        if stat.S_ISLNK(info.st_mode):
            raise _link_error(current)
        if not stat.S_ISDIR(info.st_mode):
            raise UnsafePathError(
                f"{shown_path(current)} is {describe_file(current)}, where cfbnn writes a folder: move it away "
                "(or choose another directory)"
            )
    return folder


def output_file(path: PathLike) -> Optional[os.stat_result]:
    """Check ``path`` before a file is written there: its folder as :func:`output_folder`, and
    no symbolic link at ``path`` itself (:class:`UnsafePathError`). Returns what is there now
    (its ``lstat``), ``None`` where nothing is."""
    path = Path(path)
    output_folder(path.parent)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        raise _link_error(path)
    return info


def _break_hard_link(path: PathLike, fd: int, info: os.stat_result) -> None:
    """Give ``path`` a file of its own with the bytes and mode of ``fd`` (a file with several
    names): a temporary copy renamed over the name; the other names keep the old file."""
    folder = os.path.dirname(os.path.abspath(path))
    copy, temporary = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.cfbnn-", suffix=".tmp")
    try:
        os.fchmod(copy, stat.S_IMODE(info.st_mode))
        os.lseek(fd, 0, os.SEEK_SET)
        while True:
            block = os.read(fd, 1 << 20)
            if not block:
                break
            os.write(copy, block)
        os.fsync(copy)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    finally:
        os.close(copy)


def open_in_place(path: PathLike, flags: int, mode: int = 0o644) -> int:
    """:func:`open_no_follow` for a file written in place (appended to, truncated, rewritten):
    ``flags`` may hold ``O_TRUNC`` and ``O_APPEND``; the file must be a regular file. A file
    with another name (a hard link, ``st_nlink > 1``) is never written through: it is first
    replaced by a copy of its own (its bytes and mode; the other name keeps the old file;
    refused with :class:`UnsafePathError` where that cannot be done)."""
    truncate = flags & os.O_TRUNC
    flags = (flags & ~os.O_TRUNC & ~os.O_ACCMODE) | os.O_RDWR
    for _ in range(3):
        fd = open_no_follow(path, flags, mode)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise UnsafePathError(
                    f"{shown_path(path)} is {describe_file(path)}, not a regular file: cfbnn writes a file there; "
                    "move it away (or choose another directory)"
                )
            if info.st_nlink <= 1:
                if truncate:
                    os.ftruncate(fd, 0)
                return fd
            if not truncate:
                _break_hard_link(path, fd, info)
            else:  # its bytes are not kept: a new empty file under this name only
                os.unlink(path)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    raise UnsafePathError(
        f"{shown_path(path)} has another name (a hard link) that keeps coming back; cfbnn does not write through "
        "hard links: remove the other name (or choose another directory)"
    )


def describe_file(path: PathLike) -> str:
    """What is at ``path``, in words: ``"a directory"``, ``"a FIFO, not a regular file"``,
    ``"a symbolic link"``, ``"no such file"``, ...; ``"a regular file"`` for one."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "no such file"
    except NotADirectoryError:
        return "no such file (a part of its path is not a folder)"
    except OSError as error:
        return f"unreadable ({error.strerror or type(error).__name__})"
    kinds = (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO, not a regular file"),
        (stat.S_ISSOCK, "a socket, not a regular file"),
        (stat.S_ISCHR, "a character device, not a regular file"),
        (stat.S_ISBLK, "a block device, not a regular file"),
    )
    for test, words in kinds:
        if test(info.st_mode):
            return words
    if stat.S_ISLNK(info.st_mode):
        return "a symbolic link to nothing" if not os.path.exists(path) else "a symbolic link"
    return "not a regular file"


_UNWRITABLE = {
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "the file system is read-only",
    errno.ENAMETOOLONG: "a name in it is too long (most file systems allow 255 bytes per name)",
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.ENOENT: "it cannot be made there (no such file or directory)",
    errno.ENOTDIR: "a part of it is a file, not a folder",
    errno.EEXIST: "a file is in the way of a folder",
    errno.EISDIR: "it is a directory",
    errno.EINVAL: "the file system does not take it",
    errno.EXDEV: "it lies on another file system than its temporary file",
    errno.EMLINK: "too many links",
    errno.ELOOP: "too many symbolic links",
}


def unwritable_reason(error: BaseException) -> Optional[OSError]:
    """The :class:`OSError` in ``error``'s chain (itself, its cause or context) that says a path
    could not be made or written -- permission, a read-only or full file system, a name too
    long, a missing or misplaced folder -- with the path it names; ``None`` where there is none."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if (
            isinstance(error, OSError)
            and not isinstance(error, UnsafePathError)
            and error.errno in _UNWRITABLE
            and error.filename is not None
        ):
            return error
        error = error.__cause__ or error.__context__
    return None


def unwritable_message(error: OSError, fix: str) -> str:
    """One line for :func:`unwritable_reason`'s error: the path, the reason, and ``fix``."""
    return f"cannot write {shown_path(error.filename)}: {_UNWRITABLE.get(error.errno, error.strerror)}; {fix}"


def output_error(error: BaseException, folder: PathLike, fix: str) -> Optional[str]:
    """One line for ``error`` where it says that ``folder`` (a command's output folder), a file in
    it or a folder above it could not be made or written (:func:`unwritable_reason`), or that a
    link was met there; ``None`` for any other error (e.g. an input file that cannot be read)."""
    if isinstance(error, UnsafePathError):
        return str(error)
    found = unwritable_reason(error)
    if found is None:
        return None
    folder = Path(os.path.abspath(folder))
    try:
        named = Path(os.path.abspath(os.fsdecode(found.filename)))
    except (TypeError, ValueError):
        return None
    if named == folder or folder in named.parents or named in folder.parents:
        return unwritable_message(found, fix)
    return None


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
    return _private_regular(path, os.lstat(path))


def _private_regular(path: PathLike, info: os.stat_result) -> os.stat_result:
    """``info`` (of ``path``) after checking it is a regular file of this user that nobody else may write."""
    if not stat.S_ISREG(info.st_mode):
        raise UnsafePathError(f"{path} is not a regular file")
    if info.st_uid != _this_user():
        raise UnsafePathError(f"{path} is owned by uid {info.st_uid}, not by you (uid {_this_user()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePathError(f"{path} is writable by other users")
    return info


def read_bounded(fd: int, limit: int) -> bytes:
    """What the open file ``fd`` holds, read in 1 MiB blocks, but never more than ``limit + 1``
    bytes: a result longer than ``limit`` says the file is larger than allowed (or grew)."""
    chunks, size = [], 0
    while size <= limit:
        block = os.read(fd, min(1 << 20, limit + 1 - size))
        if not block:
            break
        chunks.append(block)
        size += len(block)
    return b"".join(chunks)


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
        info = _private_regular(path, os.fstat(fd))  # the open file's, not the name's
        if info.st_size > limit:
            raise UnsafePathError(f"{path} is {info.st_size} bytes, more than the {limit} expected")
        data = read_bounded(fd, limit)
        if len(data) > limit:  # grew while being read
            raise UnsafePathError(f"{path} is more than the {limit} bytes expected")
        return data
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
    """:class:`logging.FileHandler` that opens its file with :func:`open_in_place`: a ``<job>.log``
    planted as a link is refused (:class:`UnsafePathError`), not appended through, and one with
    another name (a run dir copied with ``cp -al``) gets a copy of its own before anything is
    appended. Hydra's job logging uses it (``conf/shared/base.yaml``).

    It remembers what it found at its first open -- ``created`` (the file was not there) and
    ``found_size`` (its length then) -- so that a run refused before any work can leave its
    dir as it was (:class:`cfbnn_cli.runtime.rundir.RunDirState`)."""

    created = None
    found_size = 0
    failed = None  # the OSError that stopped the log (a full disk): said once by the command's error, not per record

    def handleError(self, record):  # noqa: N802 - logging's hook
        error = sys.exc_info()[1]
        if isinstance(error, OSError):  # ENOSPC, EIO: no traceback on stderr for every record that follows
            self.failed = self.failed or error
            return
        super().handleError(record)

    def _open(self):
        mask = os.umask(0)
        os.umask(mask)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in self.mode else os.O_TRUNC)
        existed = os.path.lexists(self.baseFilename)
        output_file(self.baseFilename)  # no link in the folders below the run dir either
        fd = open_in_place(self.baseFilename, flags, 0o666 & ~mask)
        if self.created is None:
            self.created, self.found_size = not existed, os.fstat(fd).st_size
        return os.fdopen(fd, self.mode.replace("b", ""), encoding=self.encoding, errors=self.errors)


def _identity(path: PathLike) -> Optional[tuple]:
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    return (info.st_dev, info.st_ino)


def output_over_input(out: PathLike, inputs) -> Optional[str]:
    """One line where the output ``out`` is the same file as one of ``inputs`` (``(what, path)``
    pairs: the model file, the table of new rows, a run's records), ``None`` where it is none.
    Files are compared by device and inode, so another spelling of the path, a link and a hard
    link count alike; an output that does not exist yet is no input."""
    target = _identity(out)
    if target is None:
        return None
    for what, path in inputs:
        if _identity(path) == target:
            same = "" if os.path.abspath(path) == os.path.abspath(out) else f" ({shown_path(path)}, under another name)"
            return (
                f"the output {shown_path(out)} is {what}{same}: writing it would replace an input of this "
                "command; give --out another file"
            )
    return None


def input_error(error: BaseException, path: PathLike) -> Optional[str]:
    """One line where ``error`` says that the input ``path`` could not be read (permission denied,
    an I/O error), naming it; ``None`` for any other error."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.filename is not None:
            try:
                named = os.path.abspath(os.fsdecode(error.filename))
            except (TypeError, ValueError):
                named = None
            if named == os.path.abspath(path):
                reason = _UNWRITABLE.get(error.errno, error.strerror or type(error).__name__)
                return f"cannot read {shown_path(path)}: {reason}; check its permissions, or pass another file"
        error = error.__cause__ or error.__context__
    return None
