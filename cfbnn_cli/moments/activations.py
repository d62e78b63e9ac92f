"""Gaussian moments of piecewise-polynomial activations.

Equation numbers refer to the paper (``closed_form_bnn.tex``, numbered equations in order
of appearance: (9) is Phi/Upsilon, (18)-(19) Omega and Psi, (20) ReLU, (22) leaky ReLU,
(26)-(27) chi and the hard sigmoid, (29) ReLU^2, (33)-(34) zeta and rho, (35) the general
piecewise polynomial); "errata N" is item N of ``ERRATA.md`` ("Wrong as printed").

For ``z = a^T x ~ N(mean, std^2)`` (``mean = gamma``, ``std = xi`` in the paper's
appendix) an activation object ``g`` returned by :func:`get_activation` or
:func:`piecewise_polynomial` provides

* ``g(x)``: the pointwise function (for sampling baselines);
* ``g.moments(mean, std)`` -> ``(Phi, Upsilon)`` with ``Phi = E[g(z)]`` and
  ``Upsilon = E[g(z)^2]`` (paper eq. (9));
* ``g.moments(mean, std, return_variance=True)`` -> ``(Phi, Upsilon, Var[g(z)])``
  and ``g.variance(mean, std)``: the variance computed directly, never as
  ``Upsilon - Phi^2`` (which loses every digit when ``|mean|/std`` is large).

All of it is elementwise with broadcasting, keeps dtype and device, is
differentiable in ``mean`` and ``std`` and works under ``torch.func``.

How the moments are computed without cancellation
-------------------------------------------------
We centre on ``c = g(mean)`` and compute ``E[g - c]`` and ``E[(g - c)^2]``; then
``Phi = c + E[g - c]``, ``Var = E[(g-c)^2] - E[g-c]^2`` (a small correction) and
``Upsilon = Var + Phi^2`` (a sum of non-negative terms). Each expectation is a sum
over the pieces of ``g``; every piece is integrated in the form that does not
subtract large numbers:

* a piece entirely above (below) the mean: difference of upper (lower) tails,
  each tail written through :func:`positive_part_moments` of the distance
  *away* from the mean (so the kernel only sees ``mean/std <= 0``);
* a wide piece containing the mean: the full-line Gaussian moment of its
  polynomial (Taylor-expanded at the mean) minus the two tails;
* a piece that is narrow on the scale of ``std`` (where both tails are nearly
  equal): 16-point Gauss-Legendre quadrature of the smooth integrand.

The named activations ``relu``, ``leaky_relu``, ``relu_squared`` and ``identity``
have their own short closed forms (paper eqs. (20), (22), (29), with errata 1, 2, 4, 6,
rewritten through one small tail); ``hard_sigmoid`` (eq. (27), errata 3) is the
piecewise-polynomial engine with the pieces ``-alpha, x, alpha``.

Three kernels compute these same forms, behind one ``cfbnn::`` operator per activation family
(:mod:`.moment_ops`: the ReLU family's, whose member is the operator's argument; the piecewise
polynomials'), chosen by torch's dispatcher: the torch formulas (the reference kernels,
:mod:`.relu_family`, :mod:`.piecewise_polynomial`), C++ on the CPU and Triton on CUDA (the piecewise
polynomials: the reference formula there).
"""

from __future__ import annotations

import torch

from . import relu_family
from .activation_base import Activation, check_real
from .gaussian import check_mean_std
from .piecewise_polynomial import HardSigmoid, PiecewisePolynomial, piecewise_polynomial

__all__ = [
    "Activation",
    "ReLU",
    "LeakyReLU",
    "ReLUSquared",
    "Identity",
    "HardSigmoid",
    "PiecewisePolynomial",
    "get_activation",
    "piecewise_polynomial",
    "ACTIVATIONS",
    "ReLUFamilyMember",
    "family_of",
]


class ReLUFamilyMember(Activation):
    """A member of the ReLU family (:mod:`.relu_family`): its moments through
    ``cfbnn::relu_family_moments`` with its number, ``family_kind``, and its slope (C++ on the CPU,
    Triton on CUDA). Only a class that sets ``family_kind`` itself takes the family's kernels
    (:func:`family_of`): a subclass may change the function."""

    family_kind = -1
    negative_slope = 0.0

    def operator(self, mean, std):
        return torch.ops.cfbnn.relu_family_moments(mean, std, self.family_kind, float(self.negative_slope), False)

    def reference_moments(self, mean, std):
        """``(Phi, Upsilon, Var)`` of broadcast tensors by the operator's reference formula in torch ops
        (:func:`.relu_family.reference_moments`): differentiable by autograd, the tests' oracle."""
        return relu_family.reference_moments(mean, std, self.family_kind, self.negative_slope)

    def __call__(self, x):
        return relu_family.pointwise(x, self.family_kind, self.negative_slope)


def family_of(activation):
    """``(activation number, negative slope)`` of a ReLU-family activation object, the arguments of
    the family's operators; ``None`` for any other, a subclass of a member included."""
    kind = type(activation).__dict__.get("family_kind")
    return None if kind is None else (kind, float(activation.negative_slope))


class ReLU(ReLUFamilyMember):
    """``max(0, x)``: paper eq. (20) (Phi = (gamma + Omega)/2, Upsilon = (xi^2 + gamma^2 + Psi)/2,
    with Omega, Psi of eqs. (18), (19); ``psi_h`` read as ``Psi_h``, errata 6).

    Computed through the small tail on the far side of 0 (the printed
    ``(gamma + Omega)/2`` cancels for gamma < 0) with an analytic backward pass:
    ``cfbnn::relu_family_moments`` (C++ on the CPU, Triton on CUDA), its reference kernel torch ops
    in cache-sized blocks.
    """

    name = "relu"
    family_kind = relu_family.RELU

    def __call__(self, x):
        return torch.relu(x)

    def mean(self, mean, std):
        """``E[relu(z)]`` only (``cfbnn::relu_mean``: one output written, the prediction's need; its
        gradient is Phi's)."""
        mean, std = check_mean_std(mean, std)
        return torch.ops.cfbnn.relu_mean(*torch.broadcast_tensors(mean, std))

    def as_piecewise_polynomial(self):
        return PiecewisePolynomial([0.0], [[0.0], [0.0, 1.0]], name="relu")


class LeakyReLU(ReLUFamilyMember):
    """``x`` for ``x >= 0`` and ``negative_slope * x`` otherwise (``torch.nn.functional.leaky_relu``).

    For ``0 <= negative_slope <= 1`` this is the paper's ``max(eps x, x) =
    ((1+eps) x + (1-eps)|x|)/2`` (eqs. (21), (22) with ``psi`` read as ``Psi``, errata 4,
    6); any real slope is supported here.
    """

    name = "leaky_relu"
    family_kind = relu_family.LEAKY_RELU

    def __init__(self, negative_slope: float = 0.01):
        negative_slope = check_real(negative_slope, "negative_slope")
        self.negative_slope = negative_slope

    def __call__(self, x):
        return torch.where(x >= 0, x, self.negative_slope * x)

    def as_piecewise_polynomial(self):
        return PiecewisePolynomial([0.0], [[0.0, self.negative_slope], [0.0, 1.0]], name="leaky_relu")

    def __repr__(self):
        return f"LeakyReLU(negative_slope={self.negative_slope})"


class ReLUSquared(ReLUFamilyMember):
    """``max(0, x)^2``: paper eqs. (28), (29) with the corrected rho of eq. (34) (errata 1, 2)."""

    name = "relu_squared"
    family_kind = relu_family.RELU_SQUARED

    def as_piecewise_polynomial(self):
        return PiecewisePolynomial([0.0], [[0.0], [0.0, 0.0, 1.0]], name="relu_squared")


class Identity(Activation):
    """``g(x) = x``: Phi = mean, Var = std^2."""

    name = "identity"

    def __call__(self, x):
        return x

    def operator(self, mean, std):
        # no kernel of its own: (mean, std^2), Upsilon = Var + Phi^2
        variance = std * std
        return mean, variance + mean * mean, variance

    reference_moments = operator

    def as_piecewise_polynomial(self):
        return PiecewisePolynomial([], [[0.0, 1.0]], name="identity")


ACTIVATIONS = {
    "relu": ReLU,
    "leaky_relu": LeakyReLU,
    "hard_sigmoid": HardSigmoid,
    "relu_squared": ReLUSquared,
    "identity": Identity,
}


def get_activation(name, **params) -> Activation:
    """An activation by name: ``relu``, ``leaky_relu`` (``negative_slope``),
    ``hard_sigmoid`` (``alpha``), ``relu_squared``, ``identity``.

    An :class:`Activation` instance is returned unchanged (so APIs can accept either).
    """
    if isinstance(name, Activation):
        if params:
            raise ValueError(f"`params` {sorted(params)} given together with an Activation instance {name!r}")
        return name
    if not isinstance(name, str) or name not in ACTIVATIONS:
        raise ValueError(f"`name` must be one of {sorted(ACTIVATIONS)}; got {name!r}")
    cls = ACTIVATIONS[name]
    try:
        return cls(**params)
    except TypeError as error:
        raise ValueError(f"bad parameters {params} for activation {name!r}: {error}") from None
