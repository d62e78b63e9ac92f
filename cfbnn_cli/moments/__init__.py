"""Core analytic moments: Gaussian expectations of piecewise-polynomial activations.

No modules, no configuration. This is the paper's appendix (with the errata's
corrections); see :mod:`cfbnn_cli.moments.gaussian` for the half-line moments,
:mod:`cfbnn_cli.moments.activations` for the activations. Every kernel is a ``cfbnn::``
operator whose kernel torch's dispatcher picks by device: C++ on the CPU
(:mod:`cfbnn_cli.moments.kernel_library`), Triton on CUDA, the reference torch ops where
neither is at hand (``CFBNN_FAST_MOMENTS=0``, :func:`set_fast_path` or ``with
fast_path(False)`` select the reference path).
"""

# register cfbnn::relu_tail, the ELBO steps and relu_mean before anything loads the C++ library
# (the moments operators: via .activations), and the prediction's operators
from . import elbo_ops, kl_ops, predict_ops, relu_mean_ops, tail_ops  # noqa: F401
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
from .kernel_library import fast_path, fast_path_enabled, fast_path_info, set_fast_path

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
    "fast_path",
    "fast_path_enabled",
    "fast_path_info",
    "get_activation",
    "normal_raw_moment",
    "piecewise_polynomial",
    "positive_part_moment",
    "positive_part_moments",
    "set_fast_path",
    "set_validate_args",
    "standard_normal_cdf",
    "standard_normal_pdf",
    "validate_args",
    "validating_args",
]
