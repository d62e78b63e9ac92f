"""Run-time services shared by every pipeline: errors, devices, seeding, atomic files."""

from .device import resolve_device
from .errors import CfbnnError, ConfigError, DataError
from .io import atomic_write_bytes, atomic_write_json, atomic_write_text, atomic_torch_save
from .seed import seed_everything

__all__ = [
    "CfbnnError",
    "ConfigError",
    "DataError",
    "atomic_torch_save",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "resolve_device",
    "seed_everything",
]
