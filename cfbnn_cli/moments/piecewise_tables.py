"""The tables the piecewise-polynomial kernel reads: each piece's polynomial re-expanded
around its breakpoints (Taylor coefficients), and their derivatives, padded to fixed sizes."""

from __future__ import annotations

import math
from typing import Dict, Tuple

import numpy as np
import torch

MAX_BREAKPOINTS = 64
MAX_DEGREE = 16


def piecewise_supported(breakpoints, polynomials) -> bool:
    """Whether the engine kernel takes this piecewise polynomial (else the reference path runs)."""
    return len(breakpoints) <= MAX_BREAKPOINTS and max(len(p) - 1 for p in polynomials) <= MAX_DEGREE


def _taylor(coefficients: np.ndarray, point: float) -> np.ndarray:
    """Coefficients of p(point + u) in powers of u."""
    degree = len(coefficients) - 1
    return np.array(
        [
            sum(math.comb(k, j) * coefficients[k] * point ** (k - j) for k in range(j, degree + 1))
            for j in range(degree + 1)
        ]
    )


def _derivative(coefficients: np.ndarray) -> np.ndarray:
    return (
        np.array([k * coefficients[k] for k in range(1, len(coefficients))]) if len(coefficients) > 1 else np.zeros(1)
    )


def _pad(vector, length):
    out = np.zeros(length)
    vector = np.asarray(vector, dtype=np.float64)[:length]
    out[: len(vector)] = vector
    return out


def coefficient_tables(breakpoints, polynomials, dtype) -> Dict[str, object]:
    """Host-side constants of the engine kernel (layout: see ``Spec`` in the kernel source)."""
    if dtype == torch.float32:  # what float32 torch arithmetic uses
        breakpoints = [float(np.float32(b)) for b in breakpoints]
        polynomials = [np.asarray(p, dtype=np.float32).astype(np.float64) for p in polynomials]
    B = len(breakpoints)
    D = max(len(p) - 1 for p in polynomials)
    K = 2 * D
    P = B + 1
    coef = np.zeros((P, D + 1))
    deriv = np.zeros((P, D + 1, D + 1))
    for i, p in enumerate(polynomials):
        coef[i, : len(p)] = p
        for k in range(D + 1):
            for j in range(D + 1 - k):
                deriv[i, k, j] = math.comb(j + k, k) * coef[i, j + k]
    side = np.zeros((P, 2))
    tails = np.zeros((P, 2, 6, K + 1))
    for i, p in enumerate(polynomials):
        for s, j in ((0, i - 1), (1, i)):
            if not 0 <= j < B:
                continue
            alpha = _pad(_taylor(np.asarray(p, dtype=np.float64), breakpoints[j]), D + 1)
            side[i, s] = alpha[0]
            a1 = alpha.copy()
            a1[0] = 0.0
            beta = _pad(_derivative(alpha), D + 1)
            gamma = _pad(_derivative(beta[:D] if D else beta), D + 1)
            vectors = (
                a1,
                np.convolve(a1, a1),
                beta,
                np.convolve(a1, beta),
                gamma,
                np.convolve(beta, beta) + np.convolve(a1, gamma),
            )
            for v, vector in enumerate(vectors):
                tails[i, s, v] = _pad(vector, K + 1)
    jumps = np.zeros((max(B, 1), 4))
    for j, b in enumerate(breakpoints):
        left, right = polynomials[j], polynomials[j + 1]
        jumps[j] = (
            np.polynomial.polynomial.polyval(b, left),
            np.polynomial.polynomial.polyval(b, right),
            np.polynomial.polynomial.polyval(b, _derivative(np.asarray(left, dtype=np.float64))),
            np.polynomial.polynomial.polyval(b, _derivative(np.asarray(right, dtype=np.float64))),
        )
    nodes, weights = np.polynomial.legendre.leggauss(16)
    return {
        "B": B,
        "D": D,
        "bp": np.ascontiguousarray(np.array(breakpoints if B else [0.0], dtype=np.float64)),
        "coef": np.ascontiguousarray(coef),
        "deriv": np.ascontiguousarray(deriv),
        "side": np.ascontiguousarray(side),
        "tails": np.ascontiguousarray(tails),
        "jumps": np.ascontiguousarray(jumps),
        "gl": np.ascontiguousarray(np.concatenate([nodes, weights])),
        "coef32": np.ascontiguousarray(coef.astype(np.float32)),
        "bp32": np.ascontiguousarray(np.array(breakpoints if B else [0.0], dtype=np.float32)),
    }


_FIELDS = ("bp", "coef", "deriv", "side", "tails", "jumps", "gl")


def table_sizes(breakpoints: int, degree: int) -> Tuple[int, ...]:
    """The lengths of the table's fields (``bp, coef, deriv, side, tails, jumps, gl``): the layout
    ``csrc/moment_ops.cpp`` reads (``piecewise_table``)."""
    pieces, rows = breakpoints + 1, max(breakpoints, 1)
    return (
        rows,
        pieces * (degree + 1),
        pieces * (degree + 1) ** 2,
        pieces * 2,
        pieces * 2 * 6 * (2 * degree + 1),
        rows * 4,
        32,
    )


def piecewise_table(breakpoints, polynomials, dtype: torch.dtype) -> Tuple[torch.Tensor, int, int]:
    """``(table, B, D)`` of a piecewise polynomial for tensors of ``dtype``: the arrays of
    :func:`coefficient_tables` (float32 tensors: the polynomial rounded to float32
    first) flattened and concatenated in the order of :func:`table_sizes`, one float64 CPU tensor."""
    tables = coefficient_tables(breakpoints, polynomials, dtype)
    flat = np.concatenate([np.ravel(tables[key]) for key in _FIELDS])
    assert flat.size == sum(table_sizes(tables["B"], tables["D"]))
    return torch.from_numpy(flat.astype(np.float64)), int(tables["B"]), int(tables["D"])
