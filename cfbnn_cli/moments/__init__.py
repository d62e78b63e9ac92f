"""Core analytic moments: Gaussian expectations of piecewise-polynomial activations.

No modules, no configuration. This is the paper's appendix (with the errata's
corrections); see :mod:`cfbnn_cli.moments.gaussian` for the half-line moments,
:mod:`cfbnn_cli.moments.activations` for the activations. Every kernel is a ``cfbnn::``
operator whose kernel torch's dispatcher picks by device, registered once when this package is
imported: C++ on the CPU (:mod:`cfbnn_cli.moments.kernel_library`), Triton on CUDA, the reference
torch ops where neither is at hand (``CFBNN_FAST_MOMENTS=0`` in the environment for a whole
process; :func:`set_fast_path` or ``with fast_path(False)`` for the reference path in a block).
"""

# every cfbnn:: operator declared (the moments operators also via .activations) before the C++
# library registers its CPU kernels for them, once, at the end of this import
from . import elbo_ops, kernel_library, kl_ops, ops, piecewise_ops, predict_ops, relu_mean_ops, tail_ops  # noqa: F401
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

kernel_library.register_cpu_kernels()

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
