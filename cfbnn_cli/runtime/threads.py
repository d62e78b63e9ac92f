"""CPU threads and the memory allocator: what a cfbnn process sets before any work.

Two cfbnn jobs on one machine, each with torch's default of one thread per core, ask
the CPU for twice the threads it has; OpenMP then spends its time waiting on threads
that are not running (seen: two small runs on 2 cores took 58 s each against 10 s
alone). :func:`configure_threads` therefore picks, for ``runtime.threads=auto``, the
cores this process may use (its CPU affinity and cgroup quota) divided by the number
of cfbnn jobs running on the machine, which register in a shared folder
(:class:`JobRegistry`, one locked file per process, gone when the process ends,
however it ends); :func:`rebalance` re-reads that count (the training loop calls it
every epoch), so a job started second makes the first one share.

:func:`tune_allocator` keeps glibc from returning freed tensor memory to the system
after every step: with its defaults each fresh buffer above 128 kB is a new mmap, and
touching its pages costs about 1 microsecond per 4 kB -- on a small closed-form step
that was half the time (3.4 ms -> 2.8 ms at D=90, H=200; the plain MLP it is compared
with gains too). It is called by the CLI, not on import.

:func:`flush_denormals` makes the CPU treat float results below the normal range
(under 1.2e-38 in float32) as 0. Closed-form moments produce such values in bulk: a
dead unit's ``Phi`` of 1e-20 squared is 1e-40, and every product, sum and matrix
product that then touches it runs in the CPU's microcode, 10-100x slower. Measured on
the deterministic D-200-200-1 step (2 threads): 14x the plain MLP with denormals,
3.6x without. No reported number moves: such a value is 1e-38 of its neighbours, and
the moments kernels already flush inside themselves. The setting is per thread and
threads inherit it when they are created, so it must come before torch starts its
OpenMP workers, i.e. before any work: the CLI sets it first (``runtime.flush_denormals``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Optional

from .safefs import UnsafePathError, cache_root, open_in_place, private_directory

log = logging.getLogger(__name__)

_REGISTRY: Optional["JobRegistry"] = None
_SETTING = "auto"
_LAST_CHECK = 0.0
_CHANGES_LOGGED = False  # this run has logged a change of the thread count (rebalance) at INFO
REBALANCE_SECONDS = 1.0  # how often rebalance() looks at the registry (a few file locks)


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        cores = min(cores, max(1, int(quota)))
    return max(1, cores)


def _cgroup_quota() -> Optional[float]:
    """CPUs granted by the cgroup (v2 ``cpu.max``, v1 ``cfs_quota_us``), ``None`` for no limit."""
    try:
        text = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if text and text[0] != "max":
            return float(text[0]) / float(text[1])
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = float(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = float(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 else None
    except (OSError, ValueError):
        return None


class JobRegistry:
    """The cfbnn jobs running on this machine: each holds an ``flock`` on its own file in
    ``<cache>/jobs``; a file whose lock can be taken belongs to a finished process and is
    removed.

    Only regular files are registry entries: a link, FIFO, socket, device or directory found
    there is neither opened for reading, counted, nor removed (a FIFO once hung every run), and
    every open is non-blocking. Nothing is read from an entry (its lock is the whole message),
    and at most :attr:`MAX_ENTRIES` names are looked at per count."""

    MAX_ENTRIES = 4096

    def __init__(self, folder: Optional[Path] = None):
        self.folder = Path(folder) if folder is not None else cache_root() / "jobs"
        self._handle = None
        self._name = None

    def register(self) -> None:
        import fcntl

        # private: another user could otherwise plant a link named after our pid
        private_directory(self.folder.parent)
        private_directory(self.folder)
        path = self.folder / f"{socket.gethostname()}-{os.getpid()}"
        # O_NONBLOCK: a FIFO at our name must not block the open (open_in_place refuses a non-file)
        descriptor = open_in_place(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, 0o600)
        os.set_blocking(descriptor, True)
        handle = os.fdopen(descriptor, "w")
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._handle = handle
        self._name = path.name

    def count(self) -> int:
        """Live jobs, this one included (stale files are removed on the way)."""
        import fcntl

        prefix = f"{socket.gethostname()}-"
        live = 0
        try:
            entries = os.scandir(self.folder)
        except OSError:
            return 1
        with entries:
            for seen, entry in enumerate(entries):
                if seen >= self.MAX_ENTRIES:
                    break
                if not entry.name.startswith(prefix):
                    continue
                if entry.name == self._name:
                    live += 1
                    continue
                try:
                    if not entry.is_file(follow_symlinks=False):  # a link, FIFO, socket, device or folder
                        continue
                    descriptor = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                except OSError:
                    continue
                try:
                    if not stat.S_ISREG(os.fstat(descriptor).st_mode):  # replaced since it was listed
                        continue
                    try:
                        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        live += 1  # its owner is alive and holds the lock
                        continue
                    except OSError:
                        continue
                    if os.path.samestat(os.fstat(descriptor), os.lstat(entry.path)):
                        os.unlink(entry.path)  # a finished or killed job's file (the one we locked)
                except OSError:
                    continue
                finally:
                    os.close(descriptor)
        return max(live, 1)


def threads_for(setting, jobs: int, cores: Optional[int] = None) -> int:
    """``setting`` (an int, or ``auto``: the available cores shared between ``jobs``)."""
    if setting != "auto":
        return int(setting)
    cores = available_cores() if cores is None else cores
    return max(1, cores // max(1, jobs))


def configure_threads(setting="auto") -> int:
    """Set torch's intra-op threads from ``runtime.threads`` (``auto`` or a positive int)
    before any work; registers this process as a cfbnn job. Returns the thread count."""
    global _REGISTRY, _SETTING, _CHANGES_LOGGED
    import torch

    _SETTING = setting
    _CHANGES_LOGGED = False  # a new run: its first change of the thread count is logged again
    jobs = 1
    if setting == "auto":
        try:
            if _REGISTRY is None:
                _REGISTRY = JobRegistry()
                _REGISTRY.register()
            jobs = _REGISTRY.count()
        except UnsafePathError as error:  # a link or someone else's folder: refused, said once
            log.warning("cfbnn job registry refused (%s); counting this job alone", error)
        except (OSError, ImportError) as error:  # no writable cache or no flock: count this job alone
            log.debug("cfbnn job registry unavailable (%s)", error)
    threads = threads_for(setting, jobs)
    torch.set_num_threads(threads)
    log.info(
        "runtime.threads=%s: %d torch threads (%d cores available, %d cfbnn job(s) on this machine)",
        setting,
        threads,
        available_cores(),
        jobs,
    )
    return threads


def rebalance() -> None:
    """Re-read how many cfbnn jobs share the machine and adjust (``auto`` only). Cheap
    enough to call every training step: it looks at the registry at most once a second."""
    global _LAST_CHECK
    if _SETTING != "auto" or _REGISTRY is None:
        return
    now = time.monotonic()
    if now - _LAST_CHECK < REBALANCE_SECONDS:
        return
    _LAST_CHECK = now
    import torch

    threads = threads_for("auto", _REGISTRY.count())
    if threads != torch.get_num_threads():
        global _CHANGES_LOGGED
        # once per run at INFO: jobs come and go, and a line per change (9 in one run) says nothing more
        level = logging.DEBUG if _CHANGES_LOGGED else logging.INFO
        log.log(level, "now %d torch threads (cfbnn jobs on this machine changed; later changes at DEBUG)", threads)
        _CHANGES_LOGGED = True
        torch.set_num_threads(threads)


def denormals_flushed() -> bool:
    """Whether this thread flushes denormals to zero now (probed: a float32 product that
    lands below the normal range comes back as exactly 0)."""
    import torch

    small = torch.tensor(1e-20, dtype=torch.float32)
    return bool((small * small) == 0)  # 1e-40: a denormal, unless flushed


def flush_denormals(enabled: bool = True) -> bool:
    """Flush denormal floats to zero (``enabled``) or keep them; returns the previous setting.

    Call it before any torch work: OpenMP worker threads created afterwards inherit it,
    those that exist already keep what they had (the module doc says why it matters).
    ``False`` where the CPU has no such mode (torch then reports it unsupported)."""
    import torch

    previous = denormals_flushed()
    if not torch.set_flush_denormal(bool(enabled)) and enabled:
        log.debug("this CPU cannot flush denormals to zero; left as it is")
    return previous


def tune_allocator() -> bool:
    """Keep freed memory in glibc's heap (no mmap per buffer, no trimming): see the module doc.
    A no-op (``False``) where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False
