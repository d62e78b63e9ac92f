"""The optimizer the pipelines train with: Adam, in torch's fused implementation where it applies.

``torch.optim.Adam``'s default implementation on the CPU loops over the parameters in Python,
about ten tensor operations each; on CUDA its for-each form makes about ten launches per step.
Its fused form (``fused=True``) is one C++ loop over every parameter on the CPU and one kernel
(plus the step count's increment) on CUDA, where it is also safe inside a CUDA graph
(``capturable``, :mod:`.graphs`). Measured on this project's 2-core CPU
(``benchmarks/bench_optimizer.py``, round-robin in one process), one Adam step over a closed-form
90-200-1 network's parameters takes 0.11 ms fused against 0.24 ms by default, and 3.1 ms against
8.1 ms for 2048-1000-1; a whole training step (forward, backward, Adam) is 10-15 % faster. The
update is the same (``tests/train/test_optimizers.py``).
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["adam"]


def _tensors(parameters: list) -> list:
    """The tensors of ``parameters``: tensors, or param groups (dicts with ``"params"``)."""
    tensors = []
    for item in parameters:
        if isinstance(item, dict):
            params = item["params"]
            tensors.extend([params] if isinstance(params, torch.Tensor) else list(params))
        else:
            tensors.append(item)
    return tensors


def adam(parameters: Iterable, lr: float) -> torch.optim.Adam:
    """``torch.optim.Adam(parameters, lr=lr)``, fused where torch's fused kernel takes every
    parameter (floating-point tensors on a device it supports: the CPU, CUDA), else the default.

    ``parameters``: tensors or param groups, as ``torch.optim.Adam`` takes them."""
    parameters = list(parameters)
    tensors = _tensors(parameters)
    if tensors and all(t.is_floating_point() for t in tensors) and len({t.device for t in tensors}) == 1:
        try:
            return torch.optim.Adam(parameters, lr=lr, fused=True)
        except RuntimeError:  # a device or dtype this torch's fused kernel does not support
            pass
    return torch.optim.Adam(parameters, lr=lr)
