"""Models and objectives: the paper's main text on top of :mod:`cfbnn_cli.moments`.

* :mod:`.layers` -- the weight layers: :class:`GaussianMatrix` (Bayesian) and :class:`PointLinear`.
* :mod:`.network` -- the one network: :class:`BayesianNetwork` (a stack of Gaussian or point
  weight layers), :class:`ClosedFormBNN` (the paper's one-hidden-layer network) and
  :func:`bayesian_head` (Figure 1's head).
* :mod:`.estimators` -- which layers are integrated and which sampled, as objects, and where
  each one's ELBO is computed: :class:`ClosedForm` (``analytic``), :class:`IntegrateOutputLayer`,
  :class:`LocalReparameterization` (``sampling``), :class:`DeterministicPropagation`
  (``deterministic``; ``full_covariance=True``: ``deterministic_full``); :func:`make_estimator`.
* :mod:`.predictive` -- ``model(x)`` / ``model.predict(x)``: the predictive distribution as an
  object (a classifier's: a ``Categorical`` of class probabilities); the predictive as a
  mixture of Normals and its log-likelihood.
* :mod:`.model_file` -- models as files: :func:`save_model`, :func:`load_model` (what ``cfbnn
  train`` writes and ``cfbnn predict`` reads).
* :mod:`.likelihoods` -- Normal and categorical (softmax/logistic) likelihoods, passed in.
* :mod:`.functional` -- pure functions: exact ELL, predictive moments, KL.
* :mod:`.fused` -- the closed form's hot path as autograd functions with analytic backward passes.
* :mod:`.monte_carlo` -- sampling baselines (local reparameterization, weight space).
* :mod:`.classification` -- softmax/logistic approximation and unbiased estimators.
* :mod:`.gradient_variance` -- per-element gradient variances by ``vmap(grad)`` (Table 1).
* :mod:`.vae` -- the VAE with a Bayesian decoder (Table 2).
* :mod:`.pyro_glue` -- a Pyro model/guide, the ``ClosedFormELBO`` loss and Pyro's peer BNN.
"""

from .estimators import (
    ESTIMATORS,
    ClosedForm,
    DeterministicPropagation,
    Estimator,
    IntegrateOutputLayer,
    LocalReparameterization,
    make_estimator,
)
from .functional import (
    LowRankScale,
    augment,
    kl_normal_rows,
    preactivation_moments,
    predictive_moments,
    regression_ell_given_hidden,
    regression_expected_log_likelihood,
)
from .layers import GaussianMatrix, PointLinear, cached_weights
from .likelihoods import CLASSIFICATION_OBJECTIVES, CategoricalLikelihood, NormalLikelihood
from .model_file import SavedModel, load_model, save_model
from .network import BayesianNetwork, ClosedFormBNN, bayesian_head
from .predictive import Predictive, class_distribution, predictive

__all__ = [
    "CLASSIFICATION_OBJECTIVES",
    "ESTIMATORS",
    "BayesianNetwork",
    "CategoricalLikelihood",
    "ClosedForm",
    "ClosedFormBNN",
    "DeterministicPropagation",
    "Estimator",
    "GaussianMatrix",
    "IntegrateOutputLayer",
    "LocalReparameterization",
    "LowRankScale",
    "NormalLikelihood",
    "PointLinear",
    "Predictive",
    "SavedModel",
    "augment",
    "bayesian_head",
    "cached_weights",
    "class_distribution",
    "kl_normal_rows",
    "load_model",
    "make_estimator",
    "predictive",
    "predictive_moments",
    "preactivation_moments",
    "regression_ell_given_hidden",
    "regression_expected_log_likelihood",
    "save_model",
]
