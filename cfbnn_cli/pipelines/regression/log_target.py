"""Held-out metrics of a fit on ``log(target)`` (``data.target_transform=log``), in the target's own
units: the network's predictive of ``z = log y`` is a mixture of Normals (one component where
nothing is sampled), so ``y``'s is the same mixture of log-normals
(:mod:`cfbnn_cli.bnn.target_units`):

* log-likelihood per row: ``log p(y) = log p_z(log y) - log y`` (the density's Jacobian);
* RMSE: of the mixture's mean, ``sum_s w_s exp(m_s + v_s / 2)``, against ``y``;
* interval coverage: ``z``'s central intervals, exponentiated, cover ``y`` exactly when ``z``'s
  cover ``log y``, so the shares are ``z``'s.
"""

from __future__ import annotations

import math
from typing import Dict

import torch

from ...bnn.calibration import NOMINAL_LEVELS, coverage_curve, mixture_cdf
from ...bnn.predictive import mixture_log_likelihood
from ...data.regression import RegressionData
from ...runtime.numerics import map_row_chunks, rows_per_chunk


def held_out_metrics(predict, data: RegressionData, cfg) -> Dict[str, float]:
    """``test_ll``, ``rmse`` and ``coverage_<level>`` in the target's units (``data`` holds the
    standardized ``log(target)``); ``predict`` as :func:`~.uci_methods.test_metrics` takes it."""
    chunk = rows_per_chunk(
        cfg.uci.predictive_samples * max(list(cfg.model.hidden_sizes) + list(cfg.uci.deep_hidden_sizes))
    )
    with torch.no_grad():
        mixture = map_row_chunks(predict, data.x_test, chunk)  # (means, variances[, log_weights]), standardized
    z = data.y_test
    log_y = z.double() * data.target_std + data.target_mean
    log_likelihood = mixture_log_likelihood(z, *mixture).double() - math.log(data.target_std) - log_y
    means = mixture[0].double() * data.target_std + data.target_mean
    variances = mixture[1].double() * data.target_std**2
    weights = mixture[2].double().exp() if len(mixture) > 2 else torch.full_like(means, 1.0 / means.shape[0])
    mean = (weights * torch.exp(means + 0.5 * variances)).sum(0)
    rmse = math.sqrt(float((mean - log_y.exp()).square().mean()))
    pit = mixture_cdf(z, *mixture)
    coverage = {f"coverage_{round(100 * level)}": share for level, share in coverage_curve(pit, NOMINAL_LEVELS)}
    return {"test_ll": float(log_likelihood.mean()), "rmse": rmse, **coverage}
