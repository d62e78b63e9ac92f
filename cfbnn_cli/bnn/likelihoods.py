"""Likelihoods, passed to a :class:`~cfbnn_cli.bnn.network.BayesianNetwork` (not inherited).

A likelihood turns what the network gives -- the mean and variance of its outputs
under q (closed form, or given sampled layers), and/or Monte Carlo samples of the
outputs -- into a per-data-point estimate of ``E_q[log p(y | x, W)]``:

* :class:`NormalLikelihood` -- regression, precision ``beta`` fixed or learned. Given
  output moments it is exact (paper eqs. (7)-(8)): ``-beta/2 [(y - mean)^2 + var] +
  1/2 (log beta - log 2 pi)`` per output, summed over outputs.
* :class:`CategoricalLikelihood` -- softmax (``num_classes`` logits) or logistic (one
  logit, the two-class softmax with logits ``(0, f)``), with one of
  :data:`CLASSIFICATION_OBJECTIVES` (appendix "Other likelihoods"):
  ``approximation`` (eqs. (38)-(39); an approximation, **not a bound**, errata 7),
  ``control_variate`` (unbiased; the linearized form of eq. (40), see
  :mod:`.classification`), ``analytic_numerator`` (eq. (41)) and ``sampling``
  (brute-force Monte Carlo).
* :class:`HeteroscedasticNormalLikelihood` -- regression with an input-dependent noise:
  two outputs ``(m, l)``, ``y ~ N(m, exp(l))``. Its expected log-likelihood is closed
  form under a joint Normal for ``(m, l)`` with the network's propagated mean and 2x2
  covariance -- exact in that Gaussian assumption, an approximation of the network (as
  in deterministic VI, Wu et al. 2019; its bias is measured in
  ``tests/bnn/test_heteroscedastic.py``).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
from torch import nn

from ..moments import validating_args
from .classification import (
    as_two_class,
    softmax_ell_analytic_numerator,
    softmax_ell_approximation,
    softmax_ell_control_variate,
    softmax_ell_monte_carlo,
)
from .input_checks import check_device, float_targets, rows_matching

CLASSIFICATION_OBJECTIVES = ("approximation", "control_variate", "analytic_numerator", "sampling")
_LOG_2PI = math.log(2.0 * math.pi)


class NormalLikelihood(nn.Module):
    """``y ~ N(f(x), 1/beta)`` per output; ``beta`` stored as its log, learned or fixed."""

    def __init__(self, precision: float = 1.0, learn: bool = True):
        super().__init__()
        if not (precision > 0 and math.isfinite(precision)):
            raise ValueError(f"`precision` must be finite and > 0; got {precision!r}")
        log_precision = torch.tensor(math.log(precision))
        if learn:
            self.log_precision = nn.Parameter(log_precision)
        else:
            self.register_buffer("log_precision", log_precision)

    @property
    def precision(self) -> torch.Tensor:
        return self.log_precision.exp()

    def needs_moments(self, objective: Optional[str] = None) -> bool:
        return True

    def needs_samples(self, objective: Optional[str] = None) -> bool:
        return False

    def check_targets(self, y, x, outputs: int):
        """``y`` for inputs ``x`` ``(..., N, D)``: ``(..., N)`` for one output (a ``(..., N, 1)``
        column is squeezed), ``(..., N, outputs)`` otherwise; cast to ``x``'s dtype."""
        rows = x.shape[-2]
        expected = f"(N,) or (N, 1) with N = {rows}" if outputs == 1 else f"(N, {outputs}) with N = {rows}"
        return float_targets(y, x, 0 if outputs == 1 else outputs, expected)

    def expected_log_likelihood(
        self, y, mean, variance, samples=None, objective: Optional[str] = None, multi_output: bool = False
    ) -> torch.Tensor:
        """Per data point ``(..., N)``: exact given the output moments (eqs. (7)-(8))."""
        precision = self.precision
        per_output = -0.5 * precision * ((y - mean).square() + variance) + 0.5 * (self.log_precision - _LOG_2PI)
        return per_output.sum(-1) if multi_output else per_output

    def log_predictive_density(self, y, mean, variance) -> torch.Tensor:
        """``log N(y | mean, variance + 1/beta)`` per point: the moment-matched predictive."""
        total = variance + 1.0 / self.precision
        return -0.5 * ((y - mean).square() / total + torch.log(total) + _LOG_2PI)


class HeteroscedasticNormalLikelihood(nn.Module):
    """``y ~ N(m, exp(l))`` with ``(m, l)`` the network's two outputs (mean, log-variance).

    Nothing is learned here: the noise is the second output. The network passes the
    outputs' mean ``(..., N, 2)`` and covariance ``(..., N, 2, 2)`` (:attr:`needs_covariance`).
    """

    needs_covariance = True
    outputs = 2

    def needs_moments(self, objective: Optional[str] = None) -> bool:
        return True

    def check_targets(self, y, x, outputs: int):
        """``y`` ``(..., N)`` (or ``(..., N, 1)``, squeezed) for inputs ``x`` ``(..., N, D)``,
        cast to ``x``'s dtype: one target per point, whatever the two outputs."""
        return float_targets(y, x, 0, f"(N,) or (N, 1) with N = {x.shape[-2]}")

    def needs_samples(self, objective: Optional[str] = None) -> bool:
        return False

    def expected_log_likelihood(
        self, y, mean, covariance, samples=None, objective: Optional[str] = None, multi_output: bool = True
    ) -> torch.Tensor:
        """Per data point ``(..., N)``: for ``(m, l) ~ N(mu, Sigma)``,

        ``E[log N(y | m, e^l)] = -1/2 log 2 pi - 1/2 mu_l
        - 1/2 exp(-mu_l + Sigma_ll / 2) ((y - mu_m + Sigma_ml)^2 + Sigma_mm)``

        (``E[e^{-l} f(m)]`` tilts the Normal: ``m`` keeps its variance and shifts its mean by
        ``-Sigma_ml``). A sample ``(m, l)`` (zero covariance) gives ``log N(y | m, e^l)``.
        """
        mu_m, mu_l = mean[..., 0], mean[..., 1]
        s_mm, s_ll, s_ml = covariance[..., 0, 0], covariance[..., 1, 1], covariance[..., 0, 1]
        # exp(log(...) + exponent) keeps a large precision times a tiny error finite in float32
        squared = (y - mu_m + s_ml).square() + s_mm
        return -0.5 * (_LOG_2PI + mu_l + torch.exp(torch.log(squared) - mu_l + 0.5 * s_ll))

    @staticmethod
    def predictive_mixture(mean, covariance, num_nodes: int = 64):
        """The predictive ``p(y) = E[N(y | m, e^l)]`` under ``(m, l) ~ N(mean, covariance)`` as a
        weighted mixture of ``num_nodes`` Normals: ``(means, variances, log_weights)``, each
        ``(num_nodes, ..., N)``.

        ``m`` is integrated exactly given ``l`` (``y | l`` is Normal); ``l`` by Gauss-Hermite
        quadrature (probabilists' nodes ``t_k``, ``l = mu_l + sd_l t_k``), which reaches out
        to ~11 s.d. at 64 nodes, so outlying ``y`` whose density comes from the far tail of
        ``l`` are still integrated. The conditional slope ``c = Sigma_ml / sd_l`` stays
        bounded (``|c| <= sqrt(Sigma_mm)``) as ``Sigma_ll -> 0``, where the mixture becomes
        ``N(mu_m, Sigma_mm + e^{mu_l})``.
        """
        nodes, weights = np.polynomial.hermite_e.hermegauss(num_nodes)
        shape = (num_nodes,) + (1,) * (mean.dim() - 1)
        nodes = torch.as_tensor(nodes, dtype=mean.dtype, device=mean.device).reshape(shape)
        log_weights = torch.as_tensor(
            np.log(weights / math.sqrt(2.0 * math.pi)), dtype=mean.dtype, device=mean.device
        ).reshape(shape)
        mu_m, mu_l = mean[..., 0], mean[..., 1]
        s_mm, s_ll, s_ml = covariance[..., 0, 0], covariance[..., 1, 1], covariance[..., 0, 1]
        sd_l = s_ll.clamp(min=0).sqrt()
        tiny = torch.finfo(mean.dtype).tiny
        slope = torch.where(sd_l > 0, s_ml / sd_l.clamp(min=tiny), torch.zeros_like(s_ml))
        means = mu_m + slope * nodes
        variances = (s_mm - slope.square()).clamp(min=0) + torch.exp(mu_l + sd_l * nodes)
        return means, variances, log_weights.expand_as(means)


class CategoricalLikelihood(nn.Module):
    """Softmax over ``num_classes`` logits, or logistic on one logit (``logistic=True``)."""

    def __init__(self, objective: str = "approximation", logistic: bool = False):
        super().__init__()
        check_objective(objective)
        self.objective = objective
        self.logistic = bool(logistic)

    def needs_moments(self, objective: Optional[str] = None) -> bool:
        return (objective or self.objective) != "sampling"

    def check_targets(self, labels, x, outputs: int):
        """Integer class indices ``(..., N)`` (or ``(..., N, 1)``, squeezed) for inputs ``x``
        ``(..., N, D)``, each in ``[0, num_classes)`` (two for the logistic likelihood's one
        logit). The range is read on the CPU always and on a GPU only with argument validation
        on (``cfbnn_cli.moments.set_validate_args``): there it costs a synchronization."""
        rows = x.shape[-2]
        labels = rows_matching(labels, rows, 0, "labels", f"(N,) of class indices with N = {rows}", tuple(x.shape))
        check_device(labels, x, "labels")
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise ValueError(f"`labels` must be an integer tensor of class indices; got dtype {labels.dtype}")
        classes = 2 if self.logistic else outputs
        readable = labels.device.type == "cpu" or (validating_args() and not torch.cuda.is_current_stream_capturing())
        if labels.numel() and readable and not torch._C._functorch.is_functorch_wrapped_tensor(labels):
            low, high = int(labels.min()), int(labels.max())
            if low < 0 or high >= classes:
                raise ValueError(
                    f"`labels` must be class indices in [0, {classes}) for this network's {classes} classes; "
                    f"got values from {low} to {high}"
                )
        return labels

    def needs_samples(self, objective: Optional[str] = None) -> bool:
        return (objective or self.objective) != "approximation"

    def expected_log_likelihood(
        self, labels, mean, variance, samples=None, objective: Optional[str] = None, multi_output: bool = True
    ) -> torch.Tensor:
        """Per data point ``(N,)`` under ``objective`` (default: this likelihood's)."""
        objective = check_objective(objective or self.objective)
        if self.logistic:
            mean, variance, samples = (None if v is None else as_two_class(v) for v in (mean, variance, samples))
        if objective == "approximation":
            return softmax_ell_approximation(mean, variance, labels)
        if samples is None:
            raise ValueError(f"objective {objective!r} needs Monte Carlo samples of the logits")
        if objective == "control_variate":
            return softmax_ell_control_variate(mean, variance, samples, labels)
        if objective == "analytic_numerator":
            return softmax_ell_analytic_numerator(mean, samples, labels)
        return softmax_ell_monte_carlo(samples, labels)


def check_objective(objective: str) -> str:
    if objective not in CLASSIFICATION_OBJECTIVES:
        raise ValueError(f"`objective` must be one of {CLASSIFICATION_OBJECTIVES}; got {objective!r}")
    return objective


LIKELIHOODS = ("normal", "heteroscedastic", "softmax", "logistic")


def make_likelihood(
    name: str, precision: float = 1.0, learn_precision: bool = True, objective: str = "approximation"
) -> nn.Module:
    """A likelihood object from its name (``normal``, ``heteroscedastic``, ``softmax``, ``logistic``)."""
    if name == "normal":
        return NormalLikelihood(precision, learn_precision)
    if name == "heteroscedastic":
        return HeteroscedasticNormalLikelihood()
    if name in ("softmax", "logistic"):
        return CategoricalLikelihood(objective, logistic=name == "logistic")
    raise ValueError(f"`likelihood` must be one of {LIKELIHOODS}; got {name!r}")
