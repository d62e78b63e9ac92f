"""Softmax / logistic likelihoods (paper appendix "Other likelihoods").

The expected log-likelihood ``E_q[log softmax(y)_k]`` of the logits ``y = B g(A x)``
has no closed form. This module gives

* :func:`softmax_ell_approximation` -- the paper's eq. (38),
  ``y_hat_k - log sum_j exp(y_hat_j) (1 + var(y_j)/2)``. **An approximation, not a
  bound** (errata 7, ``docs/paper.md``): it errs in both directions (the errata
  measured it above the truth, our tests find it below for moderate variance);
  deterministic and cheap, biased.
* :func:`softmax_ell_analytic_numerator` -- eq. (41): the numerator in closed
  form (``E[y_k] = y_hat_k`` exactly), the log-normalizer sampled. Unbiased.
* :func:`softmax_ell_control_variate` -- the control-variate form of eq.
  eq. (40). As printed, the correction's inner expectation sits inside a log;
  estimated by Monte Carlo that is consistent but biased by O(1/S) (Jensen), and with
  the exact expectation it collapses to eq. (41) (errata 8). We use the unbiased variant
  obtained by linearizing that log around its known mean: with
  ``S(d) = sum_j exp(y_hat_j)(1 + d_j + d_j^2/2)``, ``d = y - y_hat`` and
  ``S_bar = E[S(d)] = sum_j exp(y_hat_j)(1 + var_j/2)``, the estimator is
  ``y_hat_k - [LSE(y) - (S(d) - S_bar)/S_bar]`` averaged over samples. The control
  term has mean exactly 0 (only E[d] = 0 and E[d^2] = var enter), and it tracks the
  fluctuations of ``LSE(y)`` to second order, so the variance drops.
* :func:`softmax_ell_monte_carlo` -- brute force ``mean_s log softmax(y_s)_k``.

Variance, measured (tests/test_classification.py): the control variate always beats
eq. (41) (same numerator, no control). Against brute force it depends on the
point: brute force samples the numerator too, which moves together with the
normalizer, so where one class dominates (``p_k ~ 1``) brute force can have 1e4x less
variance; where the labelled class is unlikely the control variate wins by up to 1e4x.

Logistic (binary, one logit f, label in {0, 1}) is the two-class softmax with logits
``(0, f)``; the ``logistic_*`` wrappers do that reduction.

Prediction: :func:`predict_classes` is ``argmax_k y_hat_k`` (paper "Fast Approximate
Prediction"); :func:`approximate_class_probabilities` is the variance-corrected
softmax ``softmax(y_hat + log(1 + var/2))`` implied by eq. (38); eq. (42) is the argmax.
"""

from __future__ import annotations

import torch

__all__ = [
    "as_two_class",
    "softmax_ell_approximation",
    "softmax_ell_analytic_numerator",
    "softmax_ell_control_variate",
    "softmax_ell_monte_carlo",
    "logistic_ell_approximation",
    "logistic_ell_analytic_numerator",
    "logistic_ell_control_variate",
    "logistic_ell_monte_carlo",
    "predict_classes",
    "approximate_class_probabilities",
]


def _check_labels(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    if labels.dtype in (torch.float16, torch.float32, torch.float64, torch.bfloat16):
        raise ValueError(f"`labels` must be an integer tensor of class indices; got dtype {labels.dtype}")
    return labels.long()


def _pick(values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """values[..., n, labels[n]] for values (..., N, O), labels (N,)."""
    index = labels.expand(values.shape[:-1]).unsqueeze(-1)
    return values.gather(-1, index).squeeze(-1)


def softmax_ell_approximation(logit_mean, logit_variance, labels):
    """Eq. (38) per data point ``(N,)``: an approximation (not a bound, errata 7)."""
    labels = _check_labels(labels, logit_mean.shape[-1])
    log_normalizer = torch.logsumexp(logit_mean + torch.log1p(0.5 * logit_variance), dim=-1)
    return _pick(logit_mean, labels) - log_normalizer


def softmax_ell_analytic_numerator(logit_mean, logit_samples, labels):
    """Eq. (41) per data point: ``y_hat_k - mean_s LSE(y_s)``; unbiased.

    ``logit_samples`` ``(S, N, O)`` drawn from q (e.g. by local reparameterization).
    """
    labels = _check_labels(labels, logit_mean.shape[-1])
    return _pick(logit_mean, labels) - torch.logsumexp(logit_samples, dim=-1).mean(0)


def _control_term(logit_mean, logit_variance, logit_samples):
    """``(S(d) - S_bar)/S_bar`` per sample, computed through normalized weights."""
    weights = torch.softmax(logit_mean + torch.log1p(0.5 * logit_variance), dim=-1)  # e^{y_hat}(1+v/2)/S_bar
    delta = logit_samples - logit_mean
    relative = (delta + 0.5 * (delta * delta - logit_variance)) / (1.0 + 0.5 * logit_variance)
    return (weights * relative).sum(-1)


def softmax_ell_control_variate(logit_mean, logit_variance, logit_samples, labels, per_sample: bool = False):
    """Unbiased control-variate estimate per data point (see module docstring).

    With ``per_sample=True`` returns the ``(S, N)`` single-sample estimates (their mean
    is the estimate; their spread measures its variance).
    """
    labels = _check_labels(labels, logit_mean.shape[-1])
    estimates = (
        _pick(logit_mean, labels)
        - torch.logsumexp(logit_samples, dim=-1)
        + _control_term(logit_mean, logit_variance, logit_samples)
    )
    return estimates if per_sample else estimates.mean(0)


def softmax_ell_monte_carlo(logit_samples, labels, per_sample: bool = False):
    """Brute force ``mean_s log softmax(y_s)_k`` per data point (or ``(S, N)`` estimates)."""
    labels = _check_labels(labels, logit_samples.shape[-1])
    estimates = _pick(torch.log_softmax(logit_samples, dim=-1), labels)
    return estimates if per_sample else estimates.mean(0)


def as_two_class(values: torch.Tensor) -> torch.Tensor:
    """Logistic -> softmax: stack a constant 0 logit (zero variance) before each value."""
    return torch.stack([torch.zeros_like(values), values], dim=-1)


def logistic_ell_approximation(logit_mean, logit_variance, labels):
    """``y f_hat - log(1 + e^{f_hat}(1 + var/2))`` (paper, logistic Bernoulli); an approximation."""
    return softmax_ell_approximation(as_two_class(logit_mean), as_two_class(logit_variance), labels)


def logistic_ell_analytic_numerator(logit_mean, logit_samples, labels):
    return softmax_ell_analytic_numerator(as_two_class(logit_mean), as_two_class(logit_samples), labels)


def logistic_ell_control_variate(logit_mean, logit_variance, logit_samples, labels, per_sample=False):
    return softmax_ell_control_variate(
        as_two_class(logit_mean), as_two_class(logit_variance), as_two_class(logit_samples), labels, per_sample
    )


def logistic_ell_monte_carlo(logit_samples, labels, per_sample=False):
    return softmax_ell_monte_carlo(as_two_class(logit_samples), labels, per_sample)


def predict_classes(logit_mean: torch.Tensor) -> torch.Tensor:
    """``argmax_k y_hat_k`` (paper "Fast Approximate Prediction")."""
    return logit_mean.argmax(-1)


def approximate_class_probabilities(logit_mean, logit_variance):
    """The variance-corrected softmax ``softmax(y_hat + log(1 + var/2))`` of eq. (38)."""
    return torch.softmax(logit_mean + torch.log1p(0.5 * logit_variance), dim=-1)
