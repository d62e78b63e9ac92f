"""The predictive distribution of a regression network, as an object.

:func:`predictive` gives ``p(y | x)`` of a :class:`~cfbnn_cli.bnn.network.BayesianNetwork`
with a one-output Normal likelihood as a :class:`Predictive`: its mean, its variance and the
parts of the variance (paper remark 2, eq. (44)):

* a network whose Gaussian layers are all integrated in closed form under the estimator
  (the paper's one hidden layer under ``analytic``; any depth under ``deterministic``):
  exact moments, no sampling; ``var_a`` is the variance from the last hidden layer's weights
  (and, propagated, from the layers before), ``var_b`` the output layer's;
* otherwise the earlier layers are sampled (``num_samples`` draws, batched) and the moments
  are those of the mixture over the draws (the law of total variance: the spread of the
  draws' means is counted in ``var_a``).

``noise`` is the likelihood's ``1/beta``. ``Predictive.distribution()`` is the moment-matched
``torch.distributions.Normal``; :meth:`Predictive.interval` a central interval of it.

:func:`predictive_components` gives the predictive density as a mixture of Normals (one-output
Normal or heteroscedastic likelihoods), which :func:`mixture_log_likelihood` scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .classification import approximate_class_probabilities, as_two_class
from .estimators import make_estimator
from .likelihoods import CategoricalLikelihood, NormalLikelihood


@dataclass
class Predictive:
    """``y | x`` with ``mean``, ``variance = var_a + var_b + noise`` (each ``(N,)``).

    ``mixture``: where the predictive is not a Normal (a heteroscedastic likelihood: a Normal of
    each noise variance, mixed over the noise's uncertainty), its components ``(means, variances,
    log_weights)``, each ``(K, N)``; :meth:`interval` then gives the mixture's own quantiles."""

    mean: torch.Tensor
    var_a: torch.Tensor
    var_b: torch.Tensor
    noise: torch.Tensor
    exact: bool  # True: closed-form moments; False: moments of the mixture over sampled layers
    mixture: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None

    @property
    def variance(self) -> torch.Tensor:
        return self.var_a + self.var_b + self.noise

    @property
    def stddev(self) -> torch.Tensor:
        return self.variance.sqrt()

    def distribution(self) -> torch.distributions.Normal:
        """The moment-matched Normal (exactly the predictive where every layer is integrated
        and the likelihood is Normal given the output's moments)."""
        return torch.distributions.Normal(self.mean, self.stddev, validate_args=False)  # NaN stays NaN: callers check

    def interval(self, coverage: float = 0.9) -> Tuple[torch.Tensor, torch.Tensor]:
        """The central ``coverage`` interval of :meth:`distribution`, or of :attr:`mixture` where
        there is one."""
        if not 0.0 < coverage < 1.0:
            raise ValueError(f"`coverage` must be in (0, 1); got {coverage!r}")
        tail = (1.0 - coverage) / 2.0
        if self.mixture is not None:
            return mixture_quantile(*self.mixture, tail), mixture_quantile(*self.mixture, 1.0 - tail)
        normal = self.distribution()
        tail = torch.tensor(tail, dtype=self.mean.dtype, device=self.mean.device)
        return normal.icdf(tail), normal.icdf(1.0 - tail)

    def unscaled(self, mean: float, std: float) -> "Predictive":
        """The same predictive for ``y_original = mean + std * y`` (a standardized target)."""
        scale = std * std
        mixture = None
        if self.mixture is not None:
            means, variances, log_weights = self.mixture
            mixture = (means * std + mean, variances * scale, log_weights)
        return Predictive(
            self.mean * std + mean, self.var_a * scale, self.var_b * scale, self.noise * scale, self.exact, mixture
        )


def mixture_quantile(means, variances, log_weights, probability: float, iterations: int = 40) -> torch.Tensor:
    """The ``probability`` quantile ``(N,)`` of the mixture ``sum_k w_k N(means_k, variances_k)``
    (each ``(K, N)``, weights ``exp(log_weights)`` summing to one over ``K``): bisection on its
    distribution function between the components' 12-s.d. bounds: 40 halvings leave 24 s.d. / 2^40,
    below float32's resolution and 10^-11 s.d. in float64 (a loop over halvings, each over every row
    and component at once)."""
    sd = variances.clamp_min(torch.finfo(variances.dtype).tiny).sqrt()
    weights = log_weights.exp()
    low = (means - 12.0 * sd).amin(0)
    high = (means + 12.0 * sd).amax(0)
    for _ in range(iterations):
        middle = 0.5 * (low + high)
        below = (weights * torch.special.ndtr((middle - means) / sd)).sum(0) < probability
        low = torch.where(below, middle, low)
        high = torch.where(below, high, middle)
    return 0.5 * (low + high)


def default_estimator(model, estimator) -> str:
    """The estimator a saved model predicts with unless told otherwise (``cfbnn predict``,
    :meth:`~cfbnn_cli.bnn.model_file.SavedModel.predict`): the one it was trained with where that
    integrates every layer (one exact pass), else ``deterministic``: the moments propagated through
    every layer in one pass instead of Monte Carlo draws of the sampled layers (a two-hidden-layer
    model under ``analytic``: 64 draws of the first layer per row cost 60x the work; the one pass's
    predictive mean and s.d. against 4,096 draws are in docs/cli.md, ``benchmarks/bench_deep_predict.py``)."""
    chosen = make_estimator(estimator)
    return chosen.name if not chosen.noise_shapes(model, 1) else "deterministic"


def _prepared(model, x: torch.Tensor, estimator):
    """``(estimator, h, sampled)``: the estimator as an object, ``x`` through the model's point
    layers, and whether the estimator samples any layer (else one exact prediction)."""
    estimator = make_estimator(estimator)
    h = model.point_features(x)
    return estimator, h, bool(estimator.noise_shapes(model, h.shape[-2]))


@torch.no_grad()
def predictive(model, x: torch.Tensor, *, estimator="analytic", num_samples: int = 64, generator=None) -> Predictive:
    """``p(y | x)`` of ``model`` (see the module docstring); ``x`` is ``(N, D)``."""
    if getattr(model.likelihood, "needs_covariance", False):
        return _heteroscedastic(model, x, estimator, num_samples, generator)
    if not isinstance(model.likelihood, NormalLikelihood) or model.output_dim != 1:
        raise ValueError(
            "predictive() is for one-output Normal and heteroscedastic likelihoods; a categorical one predicts "
            "through class_distribution() (model.predict(x) picks)"
        )
    estimator, h, sampled = _prepared(model, x, estimator)
    noise = 1.0 / model.precision  # (a tensor, not read back as a number: torch.compile keeps one graph)
    moments = dict(estimator=estimator, after_point_layers=True, split_variance=True)
    if not sampled:
        mean, var_a, var_b = model.output_moments(h, noise=(), **moments)
        return Predictive(mean, var_a, var_b, torch.ones_like(mean).mul_(noise), exact=True)
    draws = estimator.sample_noise(model, h.shape[-2], generator=generator, num_samples=num_samples)
    means, var_a, var_b = model.output_moments(h, noise=draws, **moments)
    mean = means.mean(0)
    spread = means.var(0, unbiased=False)  # between the draws: from the sampled layers
    return Predictive(mean, var_a.mean(0) + spread, var_b.mean(0), torch.ones_like(mean).mul_(noise), exact=False)


def _heteroscedastic(model, x, estimator, num_samples: int, generator) -> Predictive:
    """:func:`predictive` of a heteroscedastic network (outputs: the mean ``m`` and the log noise
    variance ``l``): ``mean`` and ``var_a``/``var_b`` those of ``m``, ``noise`` ``E[exp(l)] = exp(mu_l
    + var_l / 2)`` (``l`` Normal under the propagated moments), so the variance is the predictive's
    own (total variance); the predictive itself, a mixture over ``l``
    (:meth:`~.likelihoods.HeteroscedasticNormalLikelihood.predictive_mixture`), gives the intervals."""
    estimator, h, sampled = _prepared(model, x, estimator)
    draws = estimator.sample_noise(model, h.shape[-2], generator=generator, num_samples=num_samples) if sampled else ()
    mean, var_a, var_b = model.output_moments(
        h, estimator=estimator, noise=draws, after_point_layers=True, split_variance=True
    )
    _, covariance = estimator.mean_and_covariance(model, h, draws)
    noise = torch.exp(mean[..., 1] + 0.5 * (var_a[..., 1] + var_b[..., 1]))
    means, variances, log_weights = model.likelihood.predictive_mixture(mean, covariance)  # (K, [S,] N)
    if not sampled:
        return Predictive(mean[..., 0], var_a[..., 0], var_b[..., 0], noise, True, (means, variances, log_weights))
    count = mean.shape[0]
    mixture = (means.flatten(0, 1), variances.flatten(0, 1), log_weights.flatten(0, 1) - math.log(count))
    spread = mean[..., 0].var(0, unbiased=False)
    return Predictive(
        mean[..., 0].mean(0), var_a[..., 0].mean(0) + spread, var_b[..., 0].mean(0), noise.mean(0), False, mixture
    )


@torch.no_grad()
def class_distribution(
    model, x: torch.Tensor, *, estimator="analytic", num_samples: int = 64, generator=None
) -> torch.distributions.Categorical:
    """``p(class | x)`` of a categorical ``model`` as a ``torch.distributions.Categorical``
    (``.probs`` ``(N, K)``; a logistic network's two classes are ``[0, 1]``).

    The probabilities are eq. (38)'s variance-corrected softmax of the logits' moments,
    ``softmax(y_hat + log(1 + var/2))`` (:func:`~.classification.approximate_class_probabilities`,
    as ``cfbnn imagenet-predict`` uses): exact moments where every Gaussian layer is integrated
    under ``estimator``, else averaged over ``num_samples`` draws of the sampled layers. It
    approximates the predictive ``E_q[softmax(y)]``; on the digits classifier that ``cfbnn train
    classification`` fits it is closer to a 4,000-draw Monte Carlo over the weights (mean absolute
    difference 0.015) than the probit approximation ``softmax(y_hat / sqrt(1 + pi var / 8))``
    (0.023), whose test NLL there is 0.35 against 0.13 (docs/library.md).
    """
    if not isinstance(model.likelihood, CategoricalLikelihood):
        raise ValueError(
            "class_distribution() is for categorical networks; a regression network predicts with predict()"
        )
    estimator, h, sampled = _prepared(model, x, estimator)
    noise = estimator.sample_noise(model, h.shape[-2], generator=generator, num_samples=num_samples) if sampled else ()
    mean, variance = model.output_moments(h, estimator=estimator, noise=noise, after_point_layers=True)
    if model.likelihood.logistic:
        mean, variance = as_two_class(mean), as_two_class(variance)
    probabilities = approximate_class_probabilities(mean, variance)
    return torch.distributions.Categorical(probs=probabilities.mean(0) if sampled else probabilities)


@torch.no_grad()
def predictive_components(
    model, x, *, estimator="analytic", num_samples: int = 32, generator=None, chunk: int = 8, num_nodes: int = 64
):
    """The predictive density of ``y`` as a mixture of Normals, ``(means, variances,
    log_weights)`` each ``(K, N)``, for a one-output Normal or a heteroscedastic likelihood
    (:func:`mixture_log_likelihood` scores it).

    Normal: ``N(mean_s, var_s + 1/beta)``, equal weights over the draws of the sampled
    layers (one exact component when ``estimator`` samples nothing). Heteroscedastic:
    the likelihood's Gauss-Hermite mixture
    (:meth:`~.likelihoods.HeteroscedasticNormalLikelihood.predictive_mixture`) given the
    propagated (mean, log-variance) moments, for each draw of the sampled layers.
    """
    heteroscedastic = getattr(model.likelihood, "needs_covariance", False)
    if not heteroscedastic and (not isinstance(model.likelihood, NormalLikelihood) or model.output_dim != 1):
        raise ValueError(
            "predictive_components() is for one-output Normal and heteroscedastic likelihoods; a categorical "
            "model predicts through output_mean() (its argmax, eq. (42)) or sample_outputs()"
        )
    estimator, h, sampled = _prepared(model, x, estimator)
    num_draws = num_samples if sampled else 1  # each draw's components share 1 / num_draws
    draws = (
        [()]
        if not sampled
        else [
            estimator.sample_noise(model, h.shape[-2], generator=generator, num_samples=min(chunk, num_samples - start))
            for start in range(0, num_samples, chunk)
        ]
    )  # chunks bound memory; draws within one are batched
    means, variances, log_weights = [], [], []
    for noise in draws:
        if heteroscedastic:
            mean, covariance = estimator.mean_and_covariance(model, h, noise)
            mean, variance, log_weight = (
                v.flatten(0, -2) for v in model.likelihood.predictive_mixture(mean, covariance, num_nodes)
            )
        else:
            mean, variance = model.output_moments(h, estimator=estimator, noise=noise, after_point_layers=True)
            variance = variance + 1.0 / model.precision
            if not noise:
                mean, variance = mean.unsqueeze(0), variance.unsqueeze(0)
            log_weight = torch.zeros_like(mean)
        means.append(mean)
        variances.append(variance)
        log_weights.append(log_weight - math.log(num_draws))
    return torch.cat(means), torch.cat(variances), torch.cat(log_weights)


def mixture_log_likelihood(y, means, variances, log_weights=None):
    """``log sum_s w_s N(y | mean_s, var_s)`` per data point ``(N,)``; equal weights ``1/S``
    unless ``log_weights`` (``(S, N)``, summing to one over ``S``) are given."""
    log_probs = -0.5 * ((y - means).square() / variances + torch.log(2 * math.pi * variances))
    if log_weights is None:
        return torch.logsumexp(log_probs, 0) - math.log(means.shape[0])
    return torch.logsumexp(log_probs + log_weights, 0)


def mixture_mean(means, log_weights=None):
    """The mean of the mixture: the (weighted) average of its components' means."""
    return means.mean(0) if log_weights is None else (means * log_weights.exp()).sum(0)
