"""The ReLU moments' test grid (that of test_moments_quadrature.py), its scipy-quadrature
references and the error measure in units of the tolerances: shared by the operator tests
(test_ops.py) and the Triton kernel checks (triton_check.py)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from reference import activation_reference

# (mean, std): the grid of test_moments_quadrature.py (t = mean/std from -40 to 40, std from
# 1.2e-4 to 1e3), plus std = 0 on either side of the kink and at it
T_GRID = [-40.0, -20.0, -8.0, -3.0, -1.0, -0.25, 0.0, 0.25, 1.0, 3.0, 8.0, 20.0, 40.0]
STD_GRID = [2.0**-13, 1.0, 2.0**10]
POINTS = [(float(np.float32(t * s)), s) for s in STD_GRID for t in T_GRID] + [(2.0, 0.0), (-2.0, 0.0), (0.0, 0.0)]
# the tolerances of test_moments_quadrature.py, relative to E|g| (Phi), Upsilon and Var; a value
# whose true size is below the dtype's normal range need only be tiny
TOLERANCE = {torch.float64: (1e-10, 1e-300), torch.float32: (1e-5, float(torch.finfo(torch.float32).tiny))}


def _quadrature(points, name="relu", **params):
    """``(Phi, Var, Upsilon, E|g|)`` by quadrature at each point, of ReLU or another activation."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quad's roundoff notes at the extreme points
        return [activation_reference(name, m, s, **params) for m, s in points]


def worst_error(values, references, points, dtype) -> float:
    """The largest error of ``(phi, ups, var)`` against quadrature, in units of the tolerance's
    scale (as test_moments_quadrature._check); ``inf`` for a result that should underflow but
    does not."""
    tolerance, underflow = TOLERANCE[dtype]
    worst = 0.0
    for index, ((_mean, std), (phi_ref, var_ref, ups_ref, abs_ref)) in enumerate(zip(points, references)):
        floor = underflow * max(1.0, std * std)
        checks = ((phi_ref, abs_ref), (ups_ref, ups_ref), (var_ref, var_ref))
        for value, (reference, scale) in zip(values, checks):  # (Phi alone: one value)
            got = float(value[index])
            if scale < floor:
                worst = max(worst, 0.0 if abs(got) <= 1e3 * floor else math.inf)
            else:
                worst = max(worst, abs(got - reference) / scale / tolerance)
    return worst
