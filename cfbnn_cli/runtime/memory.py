"""Memory counted before it is spent: what this process may still allocate, and a refusal in one line.

A width of 900,000 is inside every count's bound, but its activations over 1,600 rows and its
optimizer state ask for tens of GB: allocated step by step, such a run grows until the kernel
kills it (exit 137, no message). Each command estimates what a run will hold at once from the
architecture and the rows (:mod:`cfbnn_cli.bnn.footprint`) and call :func:`require_memory`
before anything large is allocated; it compares the estimate with :func:`available_bytes`:
the smallest of the machine's available memory (``MemAvailable``), the memory cgroup's room
(a container's limit) and the process's own limits (``ulimit -v``, ``ulimit -d``).

Only the standard library is used (the CLI imports this before torch).
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Dict, Optional

from .errors import ConfigError

FLOAT32 = 4  # bytes of one number of a network's parameters and activations


def _meminfo() -> Dict[str, int]:
    """``/proc/meminfo`` in bytes (empty where there is none)."""
    values: Dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    values[name] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    except OSError:
        pass
    return values


def _status(field: str) -> Optional[int]:
    """A ``/proc/self/status`` size (``VmSize``, ``VmData``) in bytes."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_number(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_room() -> Optional[int]:
    """What the memory cgroup of this process may still take (its limit less its usage), if limited."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2
            folder = Path("/sys/fs/cgroup") / path.lstrip("/")
            limit, usage = _read_number(folder / "memory.max"), _read_number(folder / "memory.current")
        elif "memory" in controllers.split(","):  # cgroup v1
            folder = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if not folder.is_dir():
                folder = Path("/sys/fs/cgroup/memory")
            limit = _read_number(folder / "memory.limit_in_bytes")
            usage = _read_number(folder / "memory.usage_in_bytes")
        else:
            continue
        if limit is not None and limit < (1 << 60) and usage is not None:
            return max(0, limit - usage)
    return None


def _rlimit_room(which: int, used: Optional[int]) -> Optional[int]:
    try:
        soft, _ = resource.getrlimit(which)
    except (OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY or used is None:
        return None
    return max(0, soft - used)


def available_bytes() -> Optional[int]:
    """How many more bytes this process can allocate: the smallest of the machine's available
    memory, its memory cgroup's room and its own address-space and data limits; ``None`` where
    none of them can be read (then nothing is refused)."""
    rooms = [
        _meminfo().get("MemAvailable"),
        _cgroup_room(),
        _rlimit_room(resource.RLIMIT_AS, _status("VmSize")),
        _rlimit_room(resource.RLIMIT_DATA, _status("VmData")),
    ]
    known = [room for room in rooms if room is not None]
    return min(known) if known else None


def format_bytes(count: float) -> str:
    """``1.5 GB``, ``300 MB``, ``12 kB`` (powers of 1000)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{int(count)} bytes"


def require_memory(needed: float, what: str, fix: str) -> None:
    """Raise :class:`ConfigError` where ``needed`` bytes are more than :func:`available_bytes`:
    ``<what> needs about <needed> of memory; this machine has <available> available: <fix>``.
    ``what`` names the setting (``model.hidden_sizes=[900000] with 1,617 training rows``) and
    ``fix`` the way out."""
    available = available_bytes()
    if available is not None and needed > available:
        raise ConfigError(
            f"{what} needs about {format_bytes(needed)} of memory; this process has "
            f"{format_bytes(available)} available: {fix}"
        )


SAMPLE_FLOATS = 8  # numbers per draw and unit a sampled prediction holds for one row (draws, moments, mixture)


def require_sample_memory(num_samples: int, widest: int) -> None:
    """Refuse ``--num-samples`` draws that one row's prediction through a layer of ``widest`` units
    could not hold (every draw is held at once)."""
    require_memory(
        FLOAT32 * SAMPLE_FLOATS * int(num_samples) * int(widest),
        f"--num-samples {num_samples:,} (the model's widest layer has {widest:,} units; every draw is held at once)",
        "lower --num-samples",
    )
