"""Choosing the torch device from the ``device`` config key."""

from __future__ import annotations

import re

import torch

from .checks import MATMUL_PRECISIONS
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


def set_matmul_precision(precision: str = "highest") -> str:
    """``runtime.matmul_precision``: how float32 matrix products may run on the GPU; returns the
    previous setting (the CLI puts it back when a run ends, as a sweep or a test runs more in one
    process).

    ``highest`` (the default, the paper's tables) keeps full float32 products; ``high`` lets
    Ampere and later GPUs use TF32 (a 10-bit mantissa, about 3 decimal digits, in the products'
    inputs; float32 accumulation), ``medium`` bfloat16 where the GPU has it. The CPU's
    products are float32 whatever the setting. ``benchmarks/gpu_suite.sh`` measures the trade
    (step time and a short Table 1 run's test LL under each)."""
    if precision not in MATMUL_PRECISIONS:
        raise ConfigError(
            f"runtime.matmul_precision={precision!r} is not one of {', '.join(MATMUL_PRECISIONS)} "
            "(highest: full float32 matrix products, the default; high: TF32 on Ampere+ GPUs; medium: bfloat16)"
        )
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    return previous
