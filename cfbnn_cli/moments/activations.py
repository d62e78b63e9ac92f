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

Two implementations compute these same forms: the torch ops below (the reference
path, also the CUDA path) and the fused CPU kernels of :mod:`cfbnn_cli.moments.fast`
(the default on CPU). ``Activation.moments`` picks one per call.
"""

from __future__ import annotations

import functools
import math
from typing import Dict, Sequence, Tuple

import numpy as np
import torch

from . import fast, ops
from .gaussian import (
    check_mean_std,
    positive_part_moments,
    standard_normal_pdf,
    standardize,
)
from .relu_reference import ReLUMomentsReference, blockwise, relu_mean_block, small_tail

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
]

_GL_NODES, _GL_WEIGHTS = (tuple(float(v) for v in a) for a in np.polynomial.legendre.leggauss(16))
# A piece whose standardized width w and largest |distance| lam satisfy
# w * (lam + w) <= this is integrated by Gauss-Legendre (accurate to ~1e-16 there);
# wider pieces are differences of tails that are then at least e^{-1} apart.
_GL_LIMIT = 4.0


class Activation:
    """A pointwise non-linearity with exact Gaussian moments."""

    name: str = "activation"
    # (mean, std) -> (Phi, Upsilon, Var) through this activation's torch operator
    # (:mod:`cfbnn_cli.moments.ops`), used off the CPU; None: the reference ops there
    operator = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _moments(self, mean: torch.Tensor, std: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return (Phi, Var) for broadcast tensors; subclasses implement."""
        raise NotImplementedError  # pragma: no cover - abstract

    def _kernels(self):
        """This activation's fused CPU kernels (:mod:`cfbnn_cli.moments.fast`), or None."""
        return None

    @functools.cached_property
    def cpu_kernels(self):
        """This activation's CPU kernel object (:mod:`cfbnn_cli.moments.fast`: forward and
        backward kernels, the ELBO kernels' ``tail_kind``), or ``None``; made once per activation."""
        return self._kernels()

    def _reference_moments(self, mean: torch.Tensor, std: torch.Tensor):
        """``(Phi, Upsilon, Var)`` of broadcast tensors through the reference torch ops."""
        phi, variance = self._moments(mean, std)
        # Rounding can leave -1 ulp; a variance is never negative.
        variance = variance.clamp_min(0.0)
        return phi, variance + phi * phi, variance

    def moments(self, mean, std, return_variance: bool = False):
        """``(E[g(z)], E[g(z)^2])`` (and ``Var[g(z)]`` if asked) for ``z ~ N(mean, std^2)``.

        Paper eq. (9) (``Phi``, ``Upsilon``). On CPU float32/float64 tensors this runs the
        fused kernels of :mod:`cfbnn_cli.moments.fast` (unless switched off), elsewhere
        the reference torch ops; both compute the same cancellation-free forms.
        """
        mean, std = check_mean_std(mean, std)
        mean, std = torch.broadcast_tensors(mean, std)
        op = self.cpu_kernels if fast.usable(mean) else None
        if op is not None:
            phi, upsilon, variance = fast.moments(op, mean, std, return_variance)
        elif self.operator is not None and ops.device_kernels_apply(mean):
            # off the CPU: one operator (cfbnn::<name>_moments, a Triton kernel each way) in place
            # of the reference path's ~40 small kernels
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

    def as_piecewise_polynomial(self) -> "PiecewisePolynomial":
        """The same function as a :class:`PiecewisePolynomial` (for cross-checks)."""
        raise NotImplementedError(f"{self.name} has no piecewise-polynomial form")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ReLU(Activation):
    """``max(0, x)``: paper eq. (20) (Phi = (gamma + Omega)/2, Upsilon = (xi^2 + gamma^2 + Psi)/2,
    with Omega, Psi of eqs. (18), (19); ``psi_h`` read as ``Psi_h``, errata 6).

    Computed through the small tail on the far side of 0 (the printed
    ``(gamma + Omega)/2`` cancels for gamma < 0) with an analytic backward pass:
    fused kernels on CPU (:mod:`cfbnn_cli.moments.fast`), otherwise torch ops in
    cache-sized blocks.
    """

    name = "relu"
    operator = staticmethod(ops.relu_moments_function)

    def __call__(self, x):
        return torch.relu(x)

    def _kernels(self):
        return fast.ReLUOp(self._reference_moments)

    def _moments(self, mean, std):
        # float64 results are wanted to 1e-10 out to |t| = 40, beyond the reach of the
        # block recursion: use the continued-fraction kernel for the small tail.
        tail = small_tail(mean, std, 2)
        s1, s2 = tail[..., 1], tail[..., 2]
        upper = mean >= 0
        phi = torch.where(upper, mean + s1, s1)
        var_upper = std * std - (s2 + 2.0 * mean * s1 + s1 * s1)
        var_lower = s2 - s1 * s1
        return phi, torch.where(upper, var_upper, var_lower)

    def _reference_moments(self, mean, std):
        if mean.dtype == torch.float64:
            return super()._reference_moments(mean, std)
        phi, upsilon, variance, *_ = ReLUMomentsReference.apply(mean, std)
        return phi, upsilon, variance

    def mean(self, mean, std):
        """``E[relu(z)]`` only. Without autograd (``torch.no_grad()``, ``torch.inference_mode()``:
        prediction) it skips ``Upsilon``, ``Var`` and the saved Gaussian factors; with autograd it
        goes through the analytic backward of :meth:`moments`."""
        if torch.is_grad_enabled():
            return self.moments(mean, std)[0]
        mean, std = check_mean_std(mean, std)
        if fast.usable(mean):
            return fast.relu_mean(*torch.broadcast_tensors(mean, std))
        if ops.device_kernels_apply(mean):
            return ops.relu_moments_function(mean, std)[0]
        if mean.dtype == torch.float64:
            return self._moments(*torch.broadcast_tensors(mean, std))[0]
        return blockwise(relu_mean_block, mean, std)[0]

    def as_piecewise_polynomial(self):
        return PiecewisePolynomial([0.0], [[0.0], [0.0, 1.0]], name="relu")


class LeakyReLU(Activation):
    """``x`` for ``x >= 0`` and ``negative_slope * x`` otherwise (``torch.nn.functional.leaky_relu``).

    For ``0 <= negative_slope <= 1`` this is the paper's ``max(eps x, x) =
    ((1+eps) x + (1-eps)|x|)/2`` (eqs. (21), (22) with ``psi`` read as ``Psi``, errata 4,
    6); any real slope is supported here.
    """

    name = "leaky_relu"

    def __init__(self, negative_slope: float = 0.01):
        negative_slope = _check_real(negative_slope, "negative_slope")
        self.negative_slope = negative_slope

    def __call__(self, x):
        return torch.where(x >= 0, x, self.negative_slope * x)

    def _kernels(self):
        return fast.LeakyReLUOp(self._reference_moments, self.negative_slope)

    def _moments(self, mean, std):
        eps = self.negative_slope
        tail = small_tail(mean, std, 2)
        s1, s2 = tail[..., 1], tail[..., 2]
        upper = mean >= 0
        var = std * std
        # mean >= 0: g - mean = (z - mean) + (eps - 1) z 1{z<0}
        phi_upper = mean + (1.0 - eps) * s1
        second_upper = var + 2.0 * (eps - 1.0) * (s2 + mean * s1) + (eps - 1.0) ** 2 * s2
        # mean < 0: g - eps*mean = eps (z - mean) + (1 - eps) z 1{z>0}
        phi_lower = eps * mean + (1.0 - eps) * s1
        second_lower = eps * eps * var + 2.0 * eps * (1.0 - eps) * (s2 - mean * s1) + (1.0 - eps) ** 2 * s2
        shift_sq = (1.0 - eps) ** 2 * s1 * s1
        phi = torch.where(upper, phi_upper, phi_lower)
        variance = torch.where(upper, second_upper, second_lower) - shift_sq
        return phi, variance

    def as_piecewise_polynomial(self):
        return PiecewisePolynomial([0.0], [[0.0, self.negative_slope], [0.0, 1.0]], name="leaky_relu")

    def __repr__(self):
        return f"LeakyReLU(negative_slope={self.negative_slope})"


class ReLUSquared(Activation):
    """``max(0, x)^2``: paper eqs. (28), (29) with the corrected rho of eq. (34) (errata 1, 2)."""

    name = "relu_squared"

    def __call__(self, x):
        return torch.relu(x) ** 2

    def _kernels(self):
        return fast.ReLUSquaredOp(self._reference_moments)

    def _moments(self, mean, std):
        tail = small_tail(mean, std, 4)
        s2, s4 = tail[..., 2], tail[..., 4]
        upper = mean >= 0
        var = std * std
        mean_sq = mean * mean
        # mean >= 0: g - mean^2 = (z^2 - mean^2) - z^2 1{z<0}
        phi_upper = mean_sq + var - s2
        var_upper = 4.0 * mean_sq * var + 2.0 * var * var + 2.0 * var * s2 - s2 * s2 - s4 + 2.0 * mean_sq * s2
        # mean < 0: g = z^2 1{z>0}, all of it in the small tail
        var_lower = s4 - s2 * s2
        return torch.where(upper, phi_upper, s2), torch.where(upper, var_upper, var_lower)

    def as_piecewise_polynomial(self):
        return PiecewisePolynomial([0.0], [[0.0], [0.0, 0.0, 1.0]], name="relu_squared")


class Identity(Activation):
    """``g(x) = x``: Phi = mean, Var = std^2."""

    name = "identity"

    def __call__(self, x):
        return x

    def _kernels(self):
        return fast.IdentityOp(self._reference_moments)

    def _moments(self, mean, std):
        return mean, std * std

    def as_piecewise_polynomial(self):
        return PiecewisePolynomial([], [[0.0, 1.0]], name="identity")


def _check_real(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"`{name}` must be a real number; got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be finite; got {value!r}")
    return value


def _horner(coefficients: Sequence[float], x: torch.Tensor) -> torch.Tensor:
    """sum_k coefficients[k] x^k."""
    result = torch.full_like(x, float(coefficients[-1]))
    for c in reversed(coefficients[:-1]):
        result = result * x + float(c)
    return result


def _taylor_coefficients(coefficients: np.ndarray, point: float) -> np.ndarray:
    """Coefficients of p(point + u) in powers of u (float64, host side)."""
    degree = len(coefficients) - 1
    out = np.zeros(degree + 1)
    for j in range(degree + 1):
        out[j] = sum(math.comb(k, j) * coefficients[k] * point ** (k - j) for k in range(j, degree + 1))
    return out


def _derivative_over_factorial(coefficients: np.ndarray, order: int) -> np.ndarray:
    """Coefficients of p^{(order)}(x) / order!."""
    degree = len(coefficients) - 1
    if order > degree:
        return np.zeros(1)
    return np.array([math.comb(k, order) * coefficients[k] for k in range(order, degree + 1)])


def _square(coefficients):
    """Coefficients of (sum_j c_j u^j)^2; entries may be tensors or floats."""
    n = len(coefficients)
    out = [None] * (2 * n - 1)
    for i in range(n):
        for j in range(n):
            term = coefficients[i] * coefficients[j]
            out[i + j] = term if out[i + j] is None else out[i + j] + term
    return out


def _gaussian_central_moment(k: int) -> float:
    """E[s^k] for s ~ N(0, 1)."""
    if k % 2:
        return 0.0
    return float(np.prod(np.arange(k - 1, 0, -2))) if k else 1.0


class PiecewisePolynomial(Activation):
    """A user-defined piecewise polynomial with exact Gaussian moments.

    ``breakpoints`` ``b_1 < ... < b_m`` split the real line into ``m + 1`` pieces;
    ``coefficients[i]`` lists the coefficients of piece ``i`` in ascending powers of
    ``x`` (``p_i(x) = sum_k coefficients[i][k] x^k``), piece 0 on ``(-inf, b_1)``, piece
    ``i`` on ``[b_i, b_{i+1})``, the last on ``[b_m, inf)``. Pieces need not join
    continuously (a step function is fine).

    This is the paper's general recipe (eq. (35), "Piecewise Polynomial Activation
    Functions") carried out for any degree: each piece reduces to truncated Normal moments
    ``E[(z - b)^k 1{z > b}]`` (errata "All orders").
    """

    name = "piecewise_polynomial"

    def __init__(self, breakpoints: Sequence[float], coefficients: Sequence[Sequence[float]], name: str = None):
        try:
            breakpoints = [float(b) for b in breakpoints]
        except (TypeError, ValueError):
            raise ValueError(f"`breakpoints` must be a sequence of real numbers; got {breakpoints!r}") from None
        if any(not math.isfinite(b) for b in breakpoints):
            raise ValueError(f"`breakpoints` must be finite; got {breakpoints}")
        if any(b >= c for b, c in zip(breakpoints[:-1], breakpoints[1:])):
            raise ValueError(f"`breakpoints` must be strictly increasing; got {breakpoints}")
        if isinstance(coefficients, (str, bytes)) or len(coefficients) != len(breakpoints) + 1:
            raise ValueError(
                f"`coefficients` must hold one polynomial per piece, i.e. len(breakpoints) + 1 = "
                f"{len(breakpoints) + 1} lists; got {len(coefficients) if hasattr(coefficients, '__len__') else coefficients!r}"
            )
        polynomials = []
        for i, piece in enumerate(coefficients):
            try:
                array = np.atleast_1d(np.asarray(piece, dtype=np.float64))
            except (TypeError, ValueError):
                raise ValueError(f"`coefficients[{i}]` must be a list of real numbers; got {piece!r}") from None
            if array.ndim != 1 or array.size == 0 or not np.all(np.isfinite(array)):
                raise ValueError(f"`coefficients[{i}]` must be a non-empty list of finite numbers; got {piece!r}")
            nonzero = np.nonzero(array)[0]
            array = array[: (nonzero[-1] + 1) if nonzero.size else 1]
            polynomials.append(array)
        self.breakpoints = breakpoints
        self.polynomials = polynomials
        if name is not None:
            self.name = name
        self.degree = max(len(p) - 1 for p in polynomials)
        # Host-side constants: Taylor expansions of each piece at its two ends and
        # derivative polynomials for the expansion at the (tensor) mean.
        self._expansions: Dict[Tuple[int, int], np.ndarray] = {}
        for i, p in enumerate(polynomials):
            for j in (i - 1, i):
                if 0 <= j < len(breakpoints):
                    self._expansions[(i, j)] = _taylor_coefficients(p, breakpoints[j])
        self._derivatives = [[_derivative_over_factorial(p, k) for k in range(len(p))] for p in polynomials]

    def __repr__(self):
        coefficients = [p.tolist() for p in self.polynomials]
        return f"PiecewisePolynomial(breakpoints={self.breakpoints}, coefficients={coefficients})"

    def as_piecewise_polynomial(self):
        return self

    def __call__(self, x):
        return self._piecewise_value(x)

    def _piecewise_value(self, x):
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(x, dtype=torch.get_default_dtype())
        result = _horner(self.polynomials[0], x)
        for i, b in enumerate(self.breakpoints):
            result = torch.where(x >= b, _horner(self.polynomials[i + 1], x), result)
        return result

    # -- the engine -----------------------------------------------------------------
    def _kernels(self):
        if not fast.piecewise_supported(self.breakpoints, self.polynomials):
            return None
        return fast.PiecewiseOp(self._reference_moments, self.breakpoints, self.polynomials)

    def _moments(self, mean, std):
        positive = std > 0
        std_safe = torch.where(positive, std, torch.ones_like(std))
        # The centre must equal the piece polynomial exactly (a saturated unit has
        # g - c == 0 over the bulk), so evaluate the pieces, not an overridden __call__.
        centre = self._piecewise_value(mean)
        first, second = self._centred_expectations(mean, std_safe, centre)
        zero = torch.zeros_like(first)
        first = torch.where(positive, first, zero)
        second = torch.where(positive, second, zero)
        return centre + first, second - first * first

    def _centred_expectations(self, mean, std, centre):
        """(E[g - c], E[(g - c)^2]) for std > 0, summed piece by piece."""
        max_order = 2 * self.degree
        # Tail moments at every breakpoint, both directions, in the direction away
        # from the mean they are small; the other direction is only used for
        # pieces where it is not selected (kept finite for the backward pass).
        upper_tails, lower_tails, distances = [], [], []
        for b in self.breakpoints:
            upper_tails.append(positive_part_moments(max_order, mean - b, std))  # E[(z-b)^k 1{z>b}]
            lower_tails.append(positive_part_moments(max_order, b - mean, std))  # E[(b-z)^k 1{z<b}]
            distances.append(standardize(b - mean, std)[0])
        first_total = torch.zeros_like(mean)
        second_total = torch.zeros_like(mean)
        n_pieces = len(self.polynomials)
        for i in range(n_pieces):
            lo = i - 1 if i > 0 else None  # index of the breakpoint on the left
            hi = i if i < len(self.breakpoints) else None
            t_lo = distances[lo] if lo is not None else None
            t_hi = distances[hi] if hi is not None else None

            def tail(j, direction):
                """(E[h1 1{tail}], E[h2 1{tail}]) for piece i beyond breakpoint j."""
                d1 = [float(c) for c in self._expansions[(i, j)]]
                d1[0] = d1[0] - centre
                d2 = _square(d1)
                if direction > 0:
                    moments = upper_tails[j]
                    sign = 1.0
                else:
                    moments = lower_tails[j]
                    sign = -1.0
                e1 = sum(d1[k] * (sign**k) * moments[..., k] for k in range(len(d1)))
                e2 = sum(d2[k] * (sign**k) * moments[..., k] for k in range(len(d2)))
                return e1, e2

            def full():
                """(E[h1], E[h2]) over the whole line, Taylor expansion at the mean."""
                e1 = [_horner(list(c), mean) for c in self._derivatives[i]]
                e1[0] = e1[0] - centre
                e2 = _square(e1)
                first = sum(e1[k] * std.pow(k) * _gaussian_central_moment(k) for k in range(len(e1)) if k % 2 == 0)
                second = sum(e2[k] * std.pow(k) * _gaussian_central_moment(k) for k in range(len(e2)) if k % 2 == 0)
                return first, second

            if lo is None and hi is None:
                first, second = full()
            elif lo is None:  # (-inf, b_hi)
                left = tail(hi, -1)
                total = full()
                upper = tail(hi, +1)
                use_left = t_hi <= 0
                first = torch.where(use_left, left[0], total[0] - upper[0])
                second = torch.where(use_left, left[1], total[1] - upper[1])
            elif hi is None:  # [b_lo, inf)
                right = tail(lo, +1)
                total = full()
                lower = tail(lo, -1)
                use_right = t_lo >= 0
                first = torch.where(use_right, right[0], total[0] - lower[0])
                second = torch.where(use_right, right[1], total[1] - lower[1])
            else:
                upper_lo, upper_hi = tail(lo, +1), tail(hi, +1)
                lower_lo, lower_hi = tail(lo, -1), tail(hi, -1)
                total = full()
                right_of_mean = t_lo >= 0
                left_of_mean = t_hi <= 0
                first = torch.where(
                    right_of_mean,
                    upper_lo[0] - upper_hi[0],
                    torch.where(left_of_mean, lower_hi[0] - lower_lo[0], total[0] - lower_lo[0] - upper_hi[0]),
                )
                second = torch.where(
                    right_of_mean,
                    upper_lo[1] - upper_hi[1],
                    torch.where(left_of_mean, lower_hi[1] - lower_lo[1], total[1] - lower_lo[1] - upper_hi[1]),
                )
                width = t_hi - t_lo
                reach = torch.maximum(t_lo.abs(), t_hi.abs())
                narrow = width * (reach + width) <= _GL_LIMIT
                gl_first, gl_second = self._gauss_legendre(i, mean, std, centre, t_lo, t_hi)
                first = torch.where(narrow, gl_first, first)
                second = torch.where(narrow, gl_second, second)
            first_total = first_total + first
            second_total = second_total + second
        return first_total, second_total

    def _gauss_legendre(self, i, mean, std, centre, t_lo, t_hi):
        # Only selected when the piece is narrow and near the mean; t_lo, t_hi come
        # clamped by gaussian.standardize, so unselected elements stay finite.
        half = 0.5 * (t_hi - t_lo)
        mid = 0.5 * (t_hi + t_lo)
        first = torch.zeros_like(mean)
        second = torch.zeros_like(mean)
        polynomial = self.polynomials[i]
        for node, weight in zip(_GL_NODES, _GL_WEIGHTS):
            u = mid + half * node
            h = _horner(polynomial, mean + std * u) - centre
            w = weight * standard_normal_pdf(u)
            first = first + w * h
            second = second + w * h * h
        return half * first, half * second


class HardSigmoid(PiecewisePolynomial):
    """``g(x) = (|x + alpha| - |x - alpha|) / 2``: ``clamp(x, -alpha, alpha)`` for ``alpha > 0``.

    Paper eqs. (23), (27); the printed chi (eq. (26)) is exact only for alpha > 0 (errata 3).
    For ``alpha < 0`` the definition gives ``-clamp(x, alpha, -alpha)``, which we
    follow; ``alpha = 0`` gives ``g = 0``. Moments come from the piecewise-polynomial
    engine, which handles the regimes the errata lists (|mean| <= alpha, beyond it,
    alpha -> infinity where g -> identity, alpha -> 0 where g -> alpha sign(x)).
    """

    def __init__(self, alpha: float = 1.0):
        alpha = _check_real(alpha, "alpha")
        self.alpha = alpha
        a = abs(alpha)
        sign = 1.0 if alpha >= 0 else -1.0
        if a == 0.0:
            super().__init__([], [[0.0]], name="hard_sigmoid")
        else:
            super().__init__([-a, a], [[-sign * a], [0.0, sign], [sign * a]], name="hard_sigmoid")

    def _kernels(self):
        if self.alpha == 0.0:
            return super()._kernels()
        return fast.HardSigmoidOp(self._reference_moments, self.alpha, self.breakpoints, self.polynomials)

    def __call__(self, x):
        # (|x + alpha| - |x - alpha|) / 2 rounds; the clamp it equals is exact.
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(x, dtype=torch.get_default_dtype())
        a = abs(self.alpha)
        clamped = x.clamp(-a, a)
        return clamped if self.alpha >= 0 else -clamped

    def __repr__(self):
        return f"HardSigmoid(alpha={self.alpha})"


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


def piecewise_polynomial(breakpoints: Sequence[float], coefficients: Sequence[Sequence[float]]) -> PiecewisePolynomial:
    """A piecewise-polynomial activation with exact Gaussian moments (see :class:`PiecewisePolynomial`)."""
    return PiecewisePolynomial(breakpoints, coefficients)
