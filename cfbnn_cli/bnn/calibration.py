"""Calibration of a regression predictive: the probability integral transform (PIT) of each test
target under the predictive, and the coverage of central intervals.

For a calibrated predictive the PIT values are uniform on [0, 1], and the central interval of
nominal level ``p`` (between the predictive's ``(1-p)/2`` and ``(1+p)/2`` quantiles) holds a
share ``p`` of the targets: a target lies in it exactly when ``|PIT - 1/2| <= p/2``.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

NOMINAL_LEVELS = (0.5, 0.8, 0.9, 0.95)  # the central intervals reported


def mixture_cdf(
    y: torch.Tensor, means: torch.Tensor, variances: torch.Tensor, log_weights: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``P(Y <= y_n)`` per data point ``(N,)`` under the mixture ``sum_s w_s N(mean_s, var_s)`` of
    ``(S, N)`` components (equal weights unless ``log_weights``): the PIT of ``y``."""
    cdf = torch.special.ndtr((y - means) / variances.sqrt())
    if log_weights is None:
        return cdf.mean(0)
    return (cdf * log_weights.exp()).sum(0)


def central_coverage(pit: torch.Tensor, level: float) -> float:
    """The share of targets inside the predictive's central interval of nominal ``level``."""
    return float(((pit - 0.5).abs() <= level / 2).double().mean())


def coverage_curve(pit: torch.Tensor, levels: Iterable[float]):
    """``[(level, coverage)]`` for each nominal level."""
    return [(float(level), central_coverage(pit, level)) for level in levels]
