"""Run-time services shared by every pipeline: errors, devices, threads, seeding, atomic files,
checkpoints, the run-dir lock and fingerprint, torchrun.

Nothing is imported eagerly: the ``cfbnn`` command sets thread-related environment
variables before torch loads (:mod:`.threads`), and ``cfbnn_cli.runtime.errors`` must
not pull torch in. The names below resolve on first use.
"""

import importlib

_EXPORTS = {
    "CfbnnError": "errors",
    "ConfigError": "errors",
    "DataError": "errors",
    "atomic_torch_save": "io",
    "atomic_write_bytes": "io",
    "atomic_write_json": "io",
    "atomic_write_text": "io",
    "resolve_device": "device",
    "seed_everything": "seed",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
