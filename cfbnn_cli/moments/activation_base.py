"""The activation interface: ``g(x)``, and ``g.moments(mean, std)`` -> ``(Phi, Upsilon[, Var])``
through its ``cfbnn::`` operator (:mod:`.ops`: the ReLU
family; :mod:`.piecewise_ops`: the piecewise polynomials and the hard sigmoid), whose kernel the
dispatcher picks by device, or the reference torch ops (the identity; the reference path chosen).
The activations themselves are in :mod:`.activations` (ReLU family, identity) and
:mod:`.piecewise_polynomial` (the general engine, the hard sigmoid)."""

from __future__ import annotations

import math
from typing import Tuple

import numpy as np
import torch

from . import ops
from .gaussian import (
    check_mean_std,
)


class Activation:
    """A pointwise non-linearity with exact Gaussian moments."""

    name: str = "activation"
    # (mean, std) -> (Phi, Upsilon, Var) through this activation's ``cfbnn::`` operator, whose kernel
    # torch's dispatcher picks by device (C++ on the CPU, Triton on CUDA, the reference torch ops
    # where neither is at hand), and whether moments() takes it for a given mean (not with the
    # reference path chosen: :func:`cfbnn_cli.moments.fast_path`). None: the reference ops only
    operator = None
    operator_applies = staticmethod(ops.operator_route)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _moments(self, mean: torch.Tensor, std: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return (Phi, Var) for broadcast tensors; subclasses implement."""
        raise NotImplementedError  # pragma: no cover - abstract

    def _reference_moments(self, mean: torch.Tensor, std: torch.Tensor):
        """``(Phi, Upsilon, Var)`` of broadcast tensors through the reference torch ops."""
        phi, variance = self._moments(mean, std)
        # Rounding can leave -1 ulp; a variance is never negative.
        variance = variance.clamp_min(0.0)
        return phi, variance + phi * phi, variance

    def moments(self, mean, std, return_variance: bool = False):
        """``(E[g(z)], E[g(z)^2])`` (and ``Var[g(z)]`` if asked) for ``z ~ N(mean, std^2)``.

        Paper eq. (9) (``Phi``, ``Upsilon``). An activation with a ``cfbnn::`` operator (ReLU, leaky
        ReLU, ReLU^2; the piecewise polynomials and the hard sigmoid on the CPU only) runs it on
        float32/float64 tensors: C++ on the CPU, Triton on CUDA; the others, and any activation with
        the reference path chosen (:func:`cfbnn_cli.moments.fast_path`), the reference torch ops. All
        compute the same cancellation-free forms.
        """
        mean, std = check_mean_std(mean, std)
        mean, std = torch.broadcast_tensors(mean, std)
        if self.operator is not None and self.operator_applies(mean):
            # one operator (one kernel each way on either device) in place of the reference
            # path's ~40 small operations
            phi, upsilon, variance = self.operator(mean, std)
        else:
            phi, upsilon, variance = self._reference_moments(mean, std)
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
