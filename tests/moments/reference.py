"""Independent references for Gaussian expectations: scipy quadrature.

Nothing here shares code with ``cfbnn_cli.moments``. An expectation
``E[f(z)]``, ``z = mean + std * u``, ``u ~ N(0, 1)``, is integrated numerically in
``u`` with ``scipy.integrate.quad``, split at the kinks. Far-tail pieces are
integrated with the Gaussian factor ``phi(u_a)`` taken out
(``phi(u_a + v) = phi(u_a) exp(-u_a v - v^2/2)``), so that quad sees a smooth,
well-scaled integrand even when the answer is 1e-200.

The integrands are functions of ``u`` so that a caller can evaluate ``g(z) - c``
relative to a kink (``(mean - alpha) + std * u``) instead of through ``z``, which
would round ``z - alpha`` to ``eps * |alpha|`` when ``alpha >> std``.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import integrate

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _phi(u):
    return math.exp(-0.5 * u * u) * _INV_SQRT_2PI


def _quad(f, a, b, points=None):
    return integrate.quad(f, a, b, epsabs=0.0, epsrel=1e-13, limit=500, points=points)[0]


def _piece(F, ua, ub):
    """int_{ua}^{ub} F(u) phi(u) du for ua < ub."""
    if ua >= 1.0:  # right tail: take out phi(ua); the rest decays like exp(-ua v)
        g = lambda v: F(ua + v) * math.exp(-ua * v - 0.5 * v * v)
        reach = 60.0 / ua
        if ub == math.inf:
            return _phi(ua) * (_quad(g, 0.0, reach) + _quad(g, reach, math.inf))
        upper = ub - ua
        return _phi(ua) * _quad(g, 0.0, upper, points=list(np.linspace(0, min(upper, reach), 6)[1:-1]))
    if ub <= -1.0:  # left tail: mirror
        return _piece(lambda u: F(-u), -ub, -ua)
    cuts = [ua] + [c for c in (-8.0, 0.0, 8.0) if ua < c < ub] + [ub]
    return sum(_quad(lambda u: F(u) * _phi(u), a, b) for a, b in zip(cuts[:-1], cuts[1:]))


def standard_normal_expectation(F, kinks=()):
    """int F(u) phi(u) du over the real line, split at the (standardized) ``kinks``."""
    edges = [-math.inf] + sorted(float(k) for k in kinks) + [math.inf]
    return sum(_piece(F, a, b) for a, b in zip(edges[:-1], edges[1:]) if a < b)


def gaussian_expectation(f, mean, std, kinks=()):
    """E[f(z)] for z ~ N(mean, std^2), with kinks given in z; std = 0 -> f(mean)."""
    if std == 0:
        return f(mean)
    return standard_normal_expectation(lambda u: f(mean + std * u), [(k - mean) / std for k in kinks])


def centred_moments(shifted, centre, kinks_u, absolute=None):
    """(E[g], Var[g], E[g^2], E[|g|]) from ``shifted(u) = g(mean + std u) - centre``.

    ``Var = E[(g-c)^2] - E[g-c]^2``: when g is nearly constant over the bulk (a
    saturated unit) ``g - c`` is exactly 0 there, so nothing is rounded to
    ``eps * |E g|``. ``absolute(u) = |g|`` for the scale of E[g] (defaults to
    ``|shifted + centre|``).
    """
    first_shifted = standard_normal_expectation(shifted, kinks_u)
    second_shifted = standard_normal_expectation(lambda u: shifted(u) ** 2, kinks_u)
    first = centre + first_shifted
    variance = second_shifted - first_shifted**2
    second = standard_normal_expectation(lambda u: (shifted(u) + centre) ** 2, kinks_u)
    if absolute is None:
        absolute = lambda u: abs(shifted(u) + centre)
    scale = standard_normal_expectation(absolute, kinks_u)
    return first, variance, second, scale


def activation_reference(name, mean, std, **params):
    """(Phi, Var, Upsilon, E|g|) for a named activation, by quadrature."""
    mean = float(mean)
    std = float(std)
    if name == "relu":
        g = lambda z: max(z, 0.0)
        kinks = [0.0]
    elif name == "leaky_relu":
        eps = params["negative_slope"]
        g = lambda z: z if z >= 0 else eps * z
        kinks = [0.0]
    elif name == "relu_squared":
        g = lambda z: max(z, 0.0) ** 2
        kinks = [0.0]
    elif name == "identity":
        g = lambda z: z
        kinks = []
    elif name == "hard_sigmoid":
        return _hard_sigmoid_reference(mean, std, params["alpha"])
    elif name == "piecewise":
        g = params["function"]
        kinks = params["kinks"]
    else:
        raise KeyError(name)
    centre = g(mean)
    if std == 0:
        return centre, 0.0, centre**2, abs(centre)
    kinks_u = [(k - mean) / std for k in kinks]
    return centred_moments(lambda u: g(mean + std * u) - centre, centre, kinks_u)


def _hard_sigmoid_reference(mean, std, alpha):
    a = abs(alpha)
    sign = 1.0 if alpha >= 0 else -1.0
    # distances above the kinks, each formed once (exact by Sterbenz near the kink)
    above_lower = mean + a
    above_upper = mean - a
    if mean >= a:
        centre = a
        shifted = lambda u: min(0.0, max(above_upper + std * u, -2 * a))
    elif mean <= -a:
        centre = -a
        shifted = lambda u: max(0.0, min(above_lower + std * u, 2 * a))
    else:
        centre = mean
        shifted = lambda u: min(max(std * u, -above_lower), -above_upper)
    if std == 0:
        return sign * centre, 0.0, centre**2, abs(centre)
    kinks_u = [-above_lower / std, -above_upper / std]
    absolute = lambda u: abs(shifted(u) + centre)
    first, variance, second, scale = centred_moments(shifted, centre, kinks_u, absolute)
    return sign * first, variance, second, scale
