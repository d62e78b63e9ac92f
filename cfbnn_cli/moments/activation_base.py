"""The activation interface: ``g(x)``, and ``g.moments(mean, std)`` -> ``(Phi, Upsilon[, Var])``
through its ``cfbnn::`` operator (:mod:`.moment_ops`: the ReLU family's, the piecewise polynomials'),
whose kernel the dispatcher picks by device. The activations themselves are in :mod:`.activations`
(ReLU family, identity) and :mod:`.piecewise_polynomial` (the general engine, the hard sigmoid)."""

from __future__ import annotations

import math

import numpy as np
import torch

from .gaussian import check_mean_std
from .operators import FLOATS


class Activation:
    """A pointwise non-linearity with exact Gaussian moments."""

    name: str = "activation"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def operator(self, mean: torch.Tensor, std: torch.Tensor):
        """``(Phi, Upsilon, Var)`` of broadcast float32/float64 tensors: its ``cfbnn::`` operator (the
        dispatcher picks the kernel by device); subclasses implement."""
        raise NotImplementedError  # pragma: no cover - abstract

    def moments(self, mean, std, return_variance: bool = False):
        """``(E[g(z)], E[g(z)^2])`` (and ``Var[g(z)]`` if asked) for ``z ~ N(mean, std^2)``.

        Paper eq. (9) (``Phi``, ``Upsilon``), through the activation's operator; tensors of another
        floating dtype (float16, bfloat16) are computed in float32 and returned in their dtype.
        """
        mean, std = check_mean_std(mean, std)
        mean, std = torch.broadcast_tensors(mean, std)
        dtype = mean.dtype
        if dtype not in FLOATS:  # the operators take float32 and float64
            mean, std = mean.float(), std.float()
        phi, upsilon, variance = (value.to(dtype) for value in self.operator(mean, std))
        if return_variance:
            return phi, upsilon, variance
        return phi, upsilon

    def variance(self, mean, std) -> torch.Tensor:
        """``Var[g(z)]`` computed directly (no ``Upsilon - Phi^2`` cancellation)."""
        return self.moments(mean, std, return_variance=True)[2]

    def mean(self, mean, std) -> torch.Tensor:
        """``E[g(z)]`` only."""
        return self.moments(mean, std)[0]

    def as_piecewise_polynomial(self):
        """The same function as a :class:`~.piecewise_polynomial.PiecewisePolynomial` (for cross-checks)."""
        raise NotImplementedError(f"{self.name} has no piecewise-polynomial form")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def check_real(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"`{name}` must be a real number; got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be finite; got {value!r}")
    return value
