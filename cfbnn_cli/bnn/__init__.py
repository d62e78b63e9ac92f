"""Models and objectives: the paper's main text on top of :mod:`cfbnn_cli.moments`.

* :mod:`.functional` -- pure functions: exact ELL, predictive moments, KL.
* :mod:`.monte_carlo` -- sampling baselines (local reparameterization, weight space).
* :mod:`.classification` -- softmax/logistic approximation and unbiased estimators.
* :mod:`.layers` -- ``GaussianMatrix`` variational families and ``ClosedFormBNN``.
* :mod:`.pyro_glue` -- a Pyro model/guide and the ``ClosedFormELBO`` loss.
"""

from .functional import (
    LowRankScale,
    kl_normal_rows,
    predictive_moments,
    preactivation_moments,
    regression_ell_given_hidden,
    regression_expected_log_likelihood,
)
from .layers import ClosedFormBNN, GaussianMatrix, augment

__all__ = [
    "ClosedFormBNN",
    "GaussianMatrix",
    "LowRankScale",
    "augment",
    "kl_normal_rows",
    "predictive_moments",
    "preactivation_moments",
    "regression_ell_given_hidden",
    "regression_expected_log_likelihood",
]
