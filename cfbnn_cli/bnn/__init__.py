"""Models and objectives: the paper's main text on top of :mod:`cfbnn_cli.moments`.

* :mod:`.network` -- the one network: :class:`BayesianNetwork` (a stack of Gaussian or
  point weight layers; the estimators of :data:`ESTIMATORS`: ``analytic``,
  ``integrate_output_layer``, ``sampling``, ``deterministic`` and ``deterministic_full``),
  :class:`ClosedFormBNN` (the paper's one-hidden-layer network) and :func:`bayesian_head`
  (Figure 1's head).
* :mod:`.predictive` -- ``model(x)`` / ``model.predict(x)``: the predictive distribution as an object.
* :mod:`.likelihoods` -- Normal and categorical (softmax/logistic) likelihoods, passed in.
* :mod:`.functional` -- pure functions: exact ELL, predictive moments, KL.
* :mod:`.monte_carlo` -- sampling baselines (local reparameterization, weight space).
* :mod:`.classification` -- softmax/logistic approximation and unbiased estimators.
* :mod:`.gradient_variance` -- per-element gradient variances by ``vmap(grad)`` (Table 1).
* :mod:`.vae` -- the VAE with a Bayesian decoder (Table 2).
* :mod:`.pyro_glue` -- a Pyro model/guide, the ``ClosedFormELBO`` loss and Pyro's peer BNN.
"""

from .functional import (
    LowRankScale,
    augment,
    kl_normal_rows,
    preactivation_moments,
    predictive_moments,
    regression_ell_given_hidden,
    regression_expected_log_likelihood,
)
from .likelihoods import CLASSIFICATION_OBJECTIVES, CategoricalLikelihood, NormalLikelihood
from .network import ESTIMATORS, BayesianNetwork, ClosedFormBNN, GaussianMatrix, PointLinear, bayesian_head
from .predictive import Predictive, predictive

__all__ = [
    "CLASSIFICATION_OBJECTIVES",
    "ESTIMATORS",
    "BayesianNetwork",
    "CategoricalLikelihood",
    "ClosedFormBNN",
    "GaussianMatrix",
    "LowRankScale",
    "NormalLikelihood",
    "PointLinear",
    "Predictive",
    "augment",
    "bayesian_head",
    "kl_normal_rows",
    "predictive",
    "predictive_moments",
    "preactivation_moments",
    "regression_ell_given_hidden",
    "regression_expected_log_likelihood",
]
