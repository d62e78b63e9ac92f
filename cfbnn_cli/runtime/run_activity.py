"""Whether a run dir's run is still going: its lock (``<run dir>/.cfbnn/lock``) held by a process.

A run holds an ``flock`` on its lock file while it writes (:class:`~.rundir.RunDirLock`), with its
pid and host in the file; the kernel releases the lock however the run ends. A dir without
``results.json`` is therefore either still training (the lock is held) or interrupted (it is not):
``cfbnn predict`` tells the user which, rather than advising ``resume=true`` for a run that is
still writing. Read only: nothing is locked or written here, so asking never disturbs a run that
starts at the same moment.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Optional

LOCK = Path(".cfbnn") / "lock"


def _held_in_proc_locks(info: os.stat_result) -> Optional[bool]:
    """Whether ``/proc/locks`` lists a lock on the file ``info`` describes (``None``: no ``/proc/locks``)."""
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    wanted = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    for line in text.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (a blocked waiter's line has "->" after the number)
        fields = [f for f in fields if f != "->"]
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].lower() == wanted:
            return True
    return False


def running_owner(run_dir) -> Optional[str]:
    """``"pid N on HOST (since ...)"`` if a process is writing to ``run_dir`` (holds its lock), else
    ``None`` (finished, interrupted, or never started). On another host, or where this machine
    cannot list its locks, a lock file naming a process counts as held when that process is alive
    here, or when its host is another (which cannot be asked)."""
    path = Path(run_dir) / LOCK
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not os.path.isfile(path) or os.path.islink(path):
        return None
    try:
        with open(path, "rb") as handle:  # (a regular file, checked above; read, never locked)
            record = json.loads(handle.read(4096).decode("utf-8", "replace") or "{}")
    except (OSError, ValueError, RecursionError):
        record = {}
    if not isinstance(record, dict):
        record = {}
    owner = f"pid {record.get('pid', '?')} on {record.get('host', '?')} (since {record.get('started', '?')})"
    held = _held_in_proc_locks(info)
    if held is not None:
        return owner if held else None
    pid, host = record.get("pid"), record.get("host")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None  # an empty lock file: released by a run that ended
    if host != socket.gethostname():
        return owner
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        return owner
    return owner
