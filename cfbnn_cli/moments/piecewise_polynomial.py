"""Piecewise-polynomial activations with exact Gaussian moments (paper eq. (35), the hard
sigmoid of eq. (27) with errata 3). How the moments avoid cancellation: see :mod:`.activations`."""

from __future__ import annotations

import math
from typing import Dict, Sequence, Tuple

import numpy as np
import torch

from .activation_base import Activation, check_real
from .gaussian import (
    positive_part_moments,
    standard_normal_pdf,
    standardize,
)
from .piecewise_tables import piecewise_supported, piecewise_table

_GL_NODES, _GL_WEIGHTS = (tuple(float(v) for v in a) for a in np.polynomial.legendre.leggauss(16))
# A piece whose standardized width w and largest |distance| lam satisfy
# w * (lam + w) <= this is integrated by Gauss-Legendre (accurate to ~1e-16 there);
# wider pieces are differences of tails that are then at least e^{-1} apart.
_GL_LIMIT = 4.0


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
        # decided here, once: a polynomial within the engine's tables takes cfbnn::piecewise_moments,
        # a larger one its reference formula (the same numbers, in torch ops)
        self._on_operator = piecewise_supported(breakpoints, polynomials)

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

    # -- the operator ---------------------------------------------------------------
    # cfbnn::piecewise_moments (declared in :mod:`.moment_ops`): the C++ engine on the CPU; alpha nan selects the
    # general engine (the hard sigmoid's own float32 kernels: its alpha)
    _operator_alpha = math.nan
    _operator_tables = None  # dtype -> (table, B, D), made on first use

    def _operator_arguments(self, dtype):
        if self._operator_tables is None:
            self._operator_tables = {}
        if dtype not in self._operator_tables:
            self._operator_tables[dtype] = piecewise_table(self.breakpoints, self.polynomials, dtype)
        return self._operator_tables[dtype]

    def operator(self, mean, std):
        """``(Phi, Upsilon, Var)`` through ``cfbnn::piecewise_moments`` (the reference formula for a
        polynomial beyond the engine's tables, :func:`.piecewise_tables.piecewise_supported`)."""
        if not self._on_operator:
            return self.reference_moments(mean, std)
        table, breakpoints, degree = self._operator_arguments(mean.dtype)
        return torch.ops.cfbnn.piecewise_moments(mean, std, table, breakpoints, degree, self._operator_alpha)[:3]

    def reference_moments(self, mean, std):
        """``(Phi, Upsilon, Var)`` of broadcast tensors in torch ops: the operator's reference kernel."""
        phi, variance = self._moments(mean, std)
        variance = variance.clamp_min(0.0)  # rounding can leave -1 ulp; a variance is never negative
        return phi, variance + phi * phi, variance

    # -- the engine -----------------------------------------------------------------
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
        # a NaN std fails `std > 0` like a zero one: without this it would read as a point mass
        # at the mean (g(mean)), a finite value where the input was NaN (the CUDA path's bug)
        unknown = std.isnan()
        first = torch.where(unknown, std, first)
        second = torch.where(unknown, std, second)
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
        alpha = check_real(alpha, "alpha")
        self.alpha = alpha
        a = abs(alpha)
        sign = 1.0 if alpha >= 0 else -1.0
        self._operator_alpha = alpha if a != 0.0 else math.nan  # its float32 kernels
        if a == 0.0:
            super().__init__([], [[0.0]], name="hard_sigmoid")
        else:
            super().__init__([-a, a], [[-sign * a], [0.0, sign], [sign * a]], name="hard_sigmoid")

    def __call__(self, x):
        # (|x + alpha| - |x - alpha|) / 2 rounds; the clamp it equals is exact.
        if not isinstance(x, torch.Tensor):
            x = torch.as_tensor(x, dtype=torch.get_default_dtype())
        a = abs(self.alpha)
        clamped = x.clamp(-a, a)
        return clamped if self.alpha >= 0 else -clamped

    def __repr__(self):
        return f"HardSigmoid(alpha={self.alpha})"


def piecewise_polynomial(breakpoints: Sequence[float], coefficients: Sequence[Sequence[float]]) -> PiecewisePolynomial:
    """A piecewise-polynomial activation with exact Gaussian moments (see :class:`PiecewisePolynomial`)."""
    return PiecewisePolynomial(breakpoints, coefficients)
