"""One format for the benchmarks' targets: a machine-readable line per target, which
``gpu_suite.sh`` collects into its closing "GPU targets:" block, and a readable block at the end
of a benchmark's output.

    TARGET <name> <value> <op> <threshold> <unit> <verdict>

``name`` has no spaces (``kernels_per_step/D=90``); ``value`` and ``threshold`` are plain numbers;
``unit`` is ``x`` (a ratio), ``us``, ``kernels``, ``warnings``, ... (``-`` for none); ``verdict`` is
``met`` or ``MISSED``, or ``(cpu: not a GPU target)`` where a GPU target was measured on another
device (its number proves the code ran, nothing more).
"""

from __future__ import annotations

import operator
from typing import List, Optional, Tuple

import torch

COMPARE = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt, "==": operator.eq}
NOT_A_GPU_TARGET = "(cpu: not a GPU target)"

REPORTED: List[Tuple[str, str]] = []  # (readable line, verdict), in the order reported


def report_target(
    name: str,
    value: float,
    op: str,
    threshold: float,
    unit: str = "",
    device: Optional[object] = None,
    label: str = "",
) -> Optional[bool]:
    """Print ``TARGET ...`` for ``value op threshold`` and remember a readable line for
    :func:`print_targets`. ``device``: where a GPU target was measured -- off CUDA the verdict is
    :data:`NOT_A_GPU_TARGET` and ``None`` is returned; leave it ``None`` for a target of any device.
    Returns whether the target is met."""
    if " " in name:
        raise ValueError(f"a target's name has no spaces: {name!r}")
    met = bool(COMPARE[op](value, threshold))
    on_gpu = device is None or torch.device(device).type == "cuda"
    verdict = ("met" if met else "MISSED") if on_gpu else NOT_A_GPU_TARGET
    print(f"TARGET {name} {value:.4g} {op} {threshold:g} {unit or '-'} {verdict}", flush=True)
    REPORTED.append((f"{label or name}: {value:.4g} {unit} (target {op} {threshold:g} {unit})".strip(), verdict))
    return met if on_gpu else None


def print_targets(title: str) -> None:
    """The targets reported so far, one readable line each, under ``title``."""
    print(f"\n{title}")
    for line, verdict in REPORTED:
        print(f"  {verdict if verdict != 'met' else 'met   '}  {line}")
