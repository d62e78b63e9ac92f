"""Core analytic moments: Gaussian expectations of piecewise-polynomial activations.

No modules, no configuration. This is the paper's appendix (with the errata's
corrections); see :mod:`cfbnn_cli.moments.gaussian` for the half-line moments,
:mod:`cfbnn_cli.moments.activations` for the activations. Every computation is a ``cfbnn::``
operator (:mod:`.operators`: declared one way, in ``moment_ops``, ``elbo_ops`` and ``predict_ops``)
whose kernel torch's dispatcher picks by device: C++ on the CPU (the extension built at install,
loaded at the end of this import: :mod:`.extension`), Triton on CUDA, the reference torch formula
where neither is at hand.
"""

# every cfbnn:: operator declared before the C++ library registers its CPU kernels for them, once,
# at the end of this import
from . import elbo_ops, extension, moment_ops, predict_ops  # noqa: F401
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

extension.load()

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
