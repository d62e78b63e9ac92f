"""The C++ CPU kernels: the torch extension ``setup.py`` built when cfbnn was installed (``_C`` beside
this file), loaded once, at the end of :mod:`cfbnn_cli.moments`' import, by ``torch.ops.load_library``.
Its static registrations (``TORCH_LIBRARY_IMPL(cfbnn, CPU, m)`` in ``csrc/moment_ops.cpp`` and
``csrc/elbo_ops.cpp``) give the ``cfbnn::`` operators their CPU kernels; nothing is compiled or cached
at run time, and the kernels are reached through the dispatcher only. Where the library is not there
(no compiler at install), or not loaded (below), every operator's reference kernel serves the CPU.

What is loaded is the package's own library, checked first: opened once without following a link, the
open file must be a regular file owned by this user or root that nobody else may write, and its build
record (``_C.build.json``, checked the same way) must hold its SHA-256 (a damaged or truncated file is
refused, not mapped) and name the installed torch, this CPU and the package's C++ sources (a library
left from an older checkout would register kernels of other signatures, which ends the process). The
library is then loaded through that open file (``/proc/self/fd``), so the file checked is the file
loaded. A hard link passes (uv and conda install files as hard links; the inode's owner and mode are
what count). Anything else: one warning naming the reason, and the reference kernels serve the CPU.
"""

from __future__ import annotations

import importlib.machinery
import os
import stat
import warnings
from pathlib import Path
from typing import Dict, Optional

import torch

from ..runtime.safefs import read_bounded
from .build_record import RECORD_LIMIT, RECORD_NAME, mismatch, sources_digest

__all__ = ["library_path", "load", "status"]

_STATUS: Dict[str, object] = {"loaded": False, "path": None, "reason": "not loaded yet"}


def library_path(folder: Optional[Path] = None) -> Optional[Path]:
    """The library ``setup.py`` built into ``folder`` (this package's), or ``None`` where there is none."""
    folder = Path(__file__).parent if folder is None else Path(folder)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = folder / f"_C{suffix}"
        if os.path.lexists(candidate):
            return candidate
    return None


class Refused(Exception):
    """Why a library is not loaded."""


def _open_checked(path: Path) -> int:
    """A read-only descriptor of ``path``, opened without following a link, after checking that the open
    file is a regular file of this user or root that nobody else may write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        if os.path.islink(path):
            raise Refused(f"{path} is a symbolic link") from None
        raise Refused(f"{path} does not open ({error.strerror})") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file"
    elif info.st_uid not in (os.geteuid(), 0):
        problem = f"is owned by uid {info.st_uid}, neither you (uid {os.geteuid()}) nor root"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = "is writable by other users"
    if problem is not None:
        os.close(fd)
        raise Refused(f"{path} {problem}")
    return fd


LIBRARY_LIMIT = 256 << 20  # bytes: a larger library is not read (nor loaded)


def _check_record(path: Path, fd: int) -> None:
    """The library open at ``fd`` against its build record (:mod:`.build_record`)."""
    record = _open_checked(path.with_name(RECORD_NAME))
    try:
        data = read_bounded(record, RECORD_LIMIT)
    finally:
        os.close(record)
    reason = mismatch(
        data, read_bounded(fd, LIBRARY_LIMIT), torch.__version__, sources_digest(Path(__file__).with_name("csrc"))
    )
    if reason:
        raise Refused(f"{path}: {reason}")


def load(path: Optional[Path] = None) -> Dict[str, object]:
    """Load the library at ``path`` (this package's by default), once per process, where it passes the
    checks of the module doc; :func:`status` says what happened."""
    if _STATUS["loaded"]:
        return status()
    path = library_path() if path is None else Path(path)
    if path is None:
        _STATUS.update(path=None, reason="not built when cfbnn was installed (no C++ compiler, or no torch then)")
        return status()
    _STATUS["path"] = str(path)
    fd = None
    try:
        fd = _open_checked(path)
        _check_record(path, fd)
    except Refused as refusal:
        if fd is not None:
            os.close(fd)
        _STATUS["reason"] = str(refusal)
        warnings.warn(
            f"cfbnn: the C++ CPU kernels are not loaded: {refusal}; the reference kernels serve the CPU "
            "(reinstall cfbnn to rebuild them)",
            RuntimeWarning,
            stacklevel=2,
        )
        return status()
    try:
        through = f"/proc/self/fd/{fd}"
        torch.ops.load_library(through if os.path.exists(through) else str(path))
    except OSError as error:
        _STATUS["reason"] = f"{path} does not load: {str(error).strip()[:300]}"
        warnings.warn(f"cfbnn: {_STATUS['reason']}; the reference kernels serve the CPU", RuntimeWarning, stacklevel=2)
        return status()
    finally:
        os.close(fd)
    _STATUS.update(loaded=True, reason="")
    return status()


def status() -> Dict[str, object]:
    """``{"loaded": whether the C++ CPU kernels are registered, "path": the library's, "reason": why not}``."""
    return dict(_STATUS)
