"""Choosing the torch device from the ``device`` config key."""

from __future__ import annotations

import re

import torch

from .errors import ConfigError

_DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def resolve_device(spec: str = "auto") -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cpu``; ``cuda`` or ``cuda:N``.

    Raises :class:`ConfigError` naming the key for an unknown value or a CUDA
    device that is not present.
    """
    spec = str(spec).strip().lower()
    if not _DEVICE_PATTERN.match(spec):
        raise ConfigError(f"device={spec!r} is not valid; use one of auto, cpu, cuda, cuda:N (e.g. device=cpu)")
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device={spec} was asked for but CUDA is not available here; use device=auto or device=cpu"
            )
        index = int(spec.split(":")[1]) if ":" in spec else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"device={spec}: only {torch.cuda.device_count()} CUDA device(s) are visible; use cuda:0..cuda:{torch.cuda.device_count() - 1}"
            )
    return torch.device(spec)


def synchronize(device) -> None:
    """Wait for ``device``'s queued work (a no-op off CUDA): before and after a timed region."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
