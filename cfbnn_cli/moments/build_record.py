"""What the C++ CPU kernels were built for, recorded beside them at install (``setup.py``) and checked
before they are loaded (:mod:`.extension`): torch's version (its C++ ABI), the CPU (the kernels are
compiled with ``-march=native``), the C++ sources (a library built from other sources registers
kernels whose signatures may not match the operators' schemas: torch would end the process) and the
library's SHA-256 (a damaged or truncated file is refused, not mapped: a truncated library would end
the process with SIGBUS). Plain Python without imports from the package, so that ``setup.py``
can run it before the package is installed."""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Dict

RECORD_NAME = "_C.build.json"  # beside the library, ``_C`` + the interpreter's extension suffix
RECORD_LIMIT = 1 << 16  # bytes: a larger record is not read


def cpu_signature() -> str:
    """What ``-march=native`` depends on: the machine and the CPU's model and feature flags, hashed
    (a library built on another CPU may hold instructions this one lacks)."""
    parts = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith(("flags", "model name", "Features", "CPU part")):
                    parts.append(line.strip())
                if len(parts) > 4:
                    break
    except OSError:  # (no /proc: the machine alone)
        parts.append(platform.processor())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def sources_digest(folder: Path) -> str:
    """The SHA-256 of the C++ sources in ``folder`` (``csrc``: every ``.cpp`` and ``.h``, by name)."""
    digest = hashlib.sha256()
    for path in sorted(Path(folder).glob("*.[ch]*")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def record(library: bytes, torch_version: str, sources: str, **details) -> bytes:
    """The record's bytes: the library's SHA-256, the torch version, CPU signature and sources
    (:func:`sources_digest`) it was built for, and ``details`` (the compiler, its flags, the build's
    seconds) for whoever reads it."""
    built = {"sha256": hashlib.sha256(library).hexdigest(), "torch": torch_version, "cpu": cpu_signature()}
    return json.dumps({**built, "sources": sources, **details}, indent=1).encode() + b"\n"


def mismatch(data: bytes, library: bytes, torch_version: str, sources: str) -> str:
    """Why the ``library`` (its bytes) whose record is ``data`` must not be loaded with ``torch_version``
    on this CPU, the package's C++ sources being ``sources``, or ``""`` where it may."""
    try:
        built: Dict[str, object] = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return "its build record is unreadable"
    if not isinstance(built, dict):
        return "its build record is unreadable"
    if built.get("sha256") != hashlib.sha256(library).hexdigest():
        return "it is not the file that was built (damaged, truncated or changed since the install)"
    if built.get("torch") != torch_version:
        return f"it was built for torch {built.get('torch')}, and torch {torch_version} is installed"
    if built.get("cpu") != cpu_signature():
        return "it was built on another CPU (-march=native)"
    if built.get("sources") != sources:
        return "it was built from other C++ sources (the package changed since the install)"
    return ""
