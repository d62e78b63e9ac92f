"""The tests' seams the benchmarks use, from tests/ (put on ``sys.path`` here): the operators'
reference kernels registered over the device's (tests/reference_kernels.py) and the kernel counter
(tests/kernel_count.py). Nothing in the package is switched: both work through torch's dispatcher."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kernel_count import count_kernels  # noqa: E402
from reference_kernels import reference_kernels  # noqa: E402

__all__ = ["count_kernels", "reference_kernels"]
