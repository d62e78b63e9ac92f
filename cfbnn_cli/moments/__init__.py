"""Core analytic moments: Gaussian expectations of piecewise-polynomial activations.

Pure torch; no modules, no configuration. This is the paper's appendix (with the
errata's corrections); see :mod:`cfbnn_cli.moments.gaussian` for the half-line
moments and :mod:`cfbnn_cli.moments.activations` for the activations.
"""

from .activations import (
    ACTIVATIONS,
    Activation,
    HardSigmoid,
    Identity,
    LeakyReLU,
    PiecewisePolynomial,
    ReLU,
    ReLUSquared,
    get_activation,
    piecewise_polynomial,
)
from .gaussian import (
    abs_moment,
    normal_raw_moment,
    positive_part_moment,
    positive_part_moments,
    set_validate_args,
    standard_normal_cdf,
    standard_normal_pdf,
    validate_args,
    validating_args,
)

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "HardSigmoid",
    "Identity",
    "LeakyReLU",
    "PiecewisePolynomial",
    "ReLU",
    "ReLUSquared",
    "abs_moment",
    "get_activation",
    "normal_raw_moment",
    "piecewise_polynomial",
    "positive_part_moment",
    "positive_part_moments",
    "set_validate_args",
    "standard_normal_cdf",
    "standard_normal_pdf",
    "validate_args",
    "validating_args",
]
