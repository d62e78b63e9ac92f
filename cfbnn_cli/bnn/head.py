"""A classification head on frozen features: one maximum-likelihood layer, then a
Bayesian one-hidden-layer network with a softmax likelihood (paper "Fast Prediction").

``features (F) -> Linear (ML) -> ReLU -> [A: mean-field Normal] -> ReLU -> [B: mean-field Normal] -> logits (O)``

The Bayesian part is a :class:`~cfbnn_cli.bnn.deep.MeanFieldMLP` with one hidden
layer, so its logits' mean and variance are exact closed forms given the first
layer's activations (estimator ``analytic``, nothing sampled), and its samples come
from local reparameterization (estimator ``sampling``). Objectives
(``objective``): ``sampling`` (1-sample Monte Carlo, as the paper trained),
``analytic_approx`` (eq. softmaxapprox; an approximation, not a bound) and
``control_variate`` (the unbiased control-variate estimator).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from ..moments import get_activation
from .classification import (
    approximate_class_probabilities,
    softmax_ell_approximation,
    softmax_ell_control_variate,
    softmax_ell_monte_carlo,
)
from .deep import MeanFieldMLP
from .functional import diagonal_preactivation_moments
from .layers import augment

OBJECTIVES = ("sampling", "analytic_approx", "control_variate")


class BayesianHead(nn.Module):
    def __init__(
        self,
        feature_dim: int,
        hidden_sizes: Sequence[int],
        num_classes: int,
        activation="relu",
        prior_scale: float = 1.0,
        init_scale: float = 1e-2,
        generator: Optional[torch.Generator] = None,
    ):
        super().__init__()
        hidden_sizes = list(hidden_sizes)
        if len(hidden_sizes) != 2 or any(int(h) < 1 for h in hidden_sizes):
            raise ValueError(f"`hidden_sizes` must be two positive widths [ML layer, Bayesian hidden layer]; got {hidden_sizes}")
        if int(num_classes) < 2:
            raise ValueError(f"`num_classes` must be >= 2; got {num_classes}")
        self.activation = get_activation(activation)
        self.first = nn.Linear(feature_dim, hidden_sizes[0])
        self.bayesian = MeanFieldMLP(
            hidden_sizes[0], [hidden_sizes[1]], activation, prior_scale, init_scale,
            learn_precision=False, generator=generator, output_dim=num_classes,
        )
        self.num_classes = int(num_classes)

    def hidden(self, features):
        """The maximum-likelihood layer's activations ``(N, H1)``."""
        return self.activation(self.first(features))

    def logit_moments(self, features):
        """Exact mean and variance of the logits under q: ``(N, O)`` each (no sampling)."""
        return self.bayesian.output_moments(self.hidden(features), "analytic", ())

    def logit_mean(self, features):
        """Exact mean of the logits ``y_hat`` ``(N, O)``, without their variance (the
        deterministic prediction ``argmax y_hat`` needs nothing more)."""
        middle, last = self.bayesian.layers
        gamma, xi = diagonal_preactivation_moments(augment(self.hidden(features)), middle.loc_and_variance())
        return augment(self.activation.mean(gamma, xi)) @ last.loc.transpose(-1, -2)

    def sample_logits(self, features, num_samples: int, generator=None, hidden=None):
        """``(S, N, O)`` logits by local reparameterization, all samples in one batch."""
        hidden = self.hidden(features) if hidden is None else hidden
        noise = self.bayesian.sample_noise(hidden.shape[0], "sampling", generator, num_samples=num_samples)
        logits, _ = self.bayesian.output_moments(hidden, "sampling", noise)
        return logits

    def kl(self):
        return self.bayesian.kl()

    def expected_log_likelihood(self, features, labels, objective: str, num_samples: int = 1, generator=None):
        """Per-point estimate of ``E_q[log softmax(logits)_label]``: ``(N,)``."""
        if objective not in OBJECTIVES:
            raise ValueError(f"`objective` must be one of {OBJECTIVES}; got {objective!r}")
        hidden = self.hidden(features)
        if objective == "sampling":
            return softmax_ell_monte_carlo(self.sample_logits(features, num_samples, generator, hidden), labels)
        mean, variance = self.bayesian.output_moments(hidden, "analytic", ())
        if objective == "analytic_approx":
            return softmax_ell_approximation(mean, variance, labels)
        samples = self.sample_logits(features, num_samples, generator, hidden)
        return softmax_ell_control_variate(mean, variance, samples, labels)

    def elbo(self, features, labels, num_data: int, objective: str, num_samples: int = 1, generator=None):
        """``num_data * mean_n ELL_n - KL(q || p)`` of the Bayesian layers (the ML layer has no prior)."""
        ell = self.expected_log_likelihood(features, labels, objective, num_samples, generator)
        return num_data * ell.mean() - self.kl()

    def forward(self, features, labels, num_data: int, objective: str, num_samples: int = 1, generator=None):
        """The ELBO (:meth:`elbo`), so that ``DistributedDataParallel(head)(...)`` trains it."""
        return self.elbo(features, labels, num_data, objective, num_samples, generator)

    @torch.no_grad()
    def deterministic_probabilities(self, features):
        """The variance-corrected softmax of eq. softmaxapprox ``(N, O)``; its argmax is ``argmax y_hat``
        up to the correction (see :func:`~cfbnn_cli.bnn.classification.approximate_class_probabilities`)."""
        mean, variance = self.logit_moments(features)
        return approximate_class_probabilities(mean, variance)
