"""How many operators a computation dispatches (every aten:: and cfbnn:: call below autograd): the
CPU's kernel count, what a route costs whatever its nodes are called."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def training_step_operators(network, x, y, bound=None, **elbo_options) -> collections.Counter:
    """The operators, by name, that one ELBO and its gradients with respect to every parameter
    dispatch (``bound``: an estimator's objective bound to ``network``, in place of its own)."""
    with _Counter() as counter:
        if bound is not None:
            value = bound.elbo(x, y)
        else:
            value = network.elbo(x, y, **elbo_options)
        torch.autograd.grad(value, list(network.parameters()))
    return counter.calls


def counts(calls: collections.Counter):
    """``(every operator, the cfbnn:: ones)``."""
    return sum(calls.values()), sum(n for name, n in calls.items() if name.startswith("cfbnn"))
