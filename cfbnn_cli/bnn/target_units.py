"""Predictions in the target's own units: the standardization undone in float64, and a model fitted
on ``log(target)`` (``data.target_transform=log``) read back as the log-normal it implies.

If ``z = log y`` has the Normal predictive ``N(m, s²)``, then ``y`` is log-normal:

* mean ``exp(m + s²/2)``, variance ``(exp(s²) - 1) exp(2m + s²)`` (written with ``expm1``, exact
  for small ``s``), median ``exp(m)``;
* its central interval is ``exp`` of ``z``'s (the transform is monotone), so it is never negative;
* its density is ``p(y) = N(log y; m, s²) / y``: ``log p(y) = log N(log y; m, s²) - log y``.

Where the log-scale predictive is a mixture over sampled layers (a deep model under ``analytic``),
its moment-matched Normal stands in for it in the mean and s.d.; a heteroscedastic model's mixture
(over its noise's uncertainty) gives the interval and the density itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple, Union

import torch

from .predictive import Predictive


@dataclass
class LogNormalPredictive:
    """``y = exp(z)`` with ``z`` the Normal predictive ``log_scale`` (in log-target units)."""

    log_scale: Predictive

    @property
    def _m(self) -> torch.Tensor:
        return self.log_scale.mean

    @property
    def _s2(self) -> torch.Tensor:
        return self.log_scale.variance

    @property
    def mean(self) -> torch.Tensor:
        return torch.exp(self._m + 0.5 * self._s2)

    @property
    def median(self) -> torch.Tensor:
        return torch.exp(self._m)

    @property
    def variance(self) -> torch.Tensor:
        return torch.expm1(self._s2) * torch.exp(2.0 * self._m + self._s2)

    @property
    def stddev(self) -> torch.Tensor:
        # sqrt of the variance, formed in logs so that exp(2m + s²) cannot overflow on its own
        return torch.sqrt(torch.expm1(self._s2)) * torch.exp(self._m + 0.5 * self._s2)

    def interval(self, coverage: float = 0.9) -> Tuple[torch.Tensor, torch.Tensor]:
        """The central ``coverage`` interval: ``exp`` of the log scale's."""
        lower, upper = self.log_scale.interval(coverage)
        return torch.exp(lower), torch.exp(upper)

    def log_prob(self, y: torch.Tensor) -> torch.Tensor:
        """``log p(y)`` in the target's units (``-inf`` for ``y <= 0``)."""
        y = torch.as_tensor(y, dtype=self._m.dtype, device=self._m.device)
        log_y = torch.log(y)
        if self.log_scale.mixture is not None:  # a heteroscedastic model: its own mixture on the log scale
            means, variances, log_weights = self.log_scale.mixture
            component = -0.5 * ((log_y - means).square() / variances + torch.log(2 * math.pi * variances))
            on_log_scale = torch.logsumexp(log_weights + component, dim=0)
        else:
            on_log_scale = -0.5 * ((log_y - self._m).square() / self._s2 + torch.log(2 * math.pi * self._s2))
        return torch.where(y > 0, on_log_scale - log_y, torch.full_like(on_log_scale, -math.inf))

    def distribution(self) -> torch.distributions.LogNormal:
        return torch.distributions.LogNormal(self._m, self._s2.sqrt(), validate_args=False)


def in_target_units(
    prediction: Predictive, target_mean: float, target_std: float, transform: str = "none"
) -> Union[Predictive, LogNormalPredictive]:
    """A standardized network's :class:`Predictive` in the target's units, in float64 (a target of
    1e12 with an s.d. of 1 keeps its digits): ``transform="log"``, the log-normal it implies."""
    mixture = None if prediction.mixture is None else tuple(part.double() for part in prediction.mixture)
    double = Predictive(
        prediction.mean.double(),
        prediction.var_a.double(),
        prediction.var_b.double(),
        prediction.noise.double(),
        prediction.exact,
        mixture,
    ).unscaled(target_mean, target_std)
    if transform == "log":
        return LogNormalPredictive(double)
    if transform != "none":
        raise ValueError(f"`transform` must be 'none' or 'log'; got {transform!r}")
    return double


def describe_in_target_units(prediction, coverage: float) -> dict:
    """The regression columns of a predictions file (``cfbnn predict``), each ``(N,)`` float64.

    A Normal predictive: ``mean``, ``sd``, ``var_a``, ``var_b``, ``noise`` (squared target units)
    and the interval. A log-normal one: ``mean``, ``sd``, ``median`` in the target's units, the
    variance's parts on the log scale (``log_var_a``, ``log_var_b``, ``log_noise``) and the interval.
    """
    percent = f"{100 * coverage:g}"
    lower, upper = prediction.interval(coverage)
    if isinstance(prediction, LogNormalPredictive):
        parts = prediction.log_scale
        columns = {
            "mean": prediction.mean,
            "sd": prediction.stddev,
            "median": prediction.median,
            "log_var_a": parts.var_a,
            "log_var_b": parts.var_b,
            "log_noise": parts.noise,
        }
    else:
        columns = {
            "mean": prediction.mean,
            "sd": prediction.stddev,
            "var_a": prediction.var_a,
            "var_b": prediction.var_b,
            "noise": prediction.noise,
        }
    columns[f"lower_{percent}"] = lower
    columns[f"upper_{percent}"] = upper
    return columns


def regression_columns(transform: str, coverage: float) -> list:
    """The names :func:`describe_in_target_units` gives, in order."""
    percent = f"{100 * coverage:g}"
    middle = ["median", "log_var_a", "log_var_b", "log_noise"] if transform == "log" else ["var_a", "var_b", "noise"]
    return ["mean", "sd", *middle, f"lower_{percent}", f"upper_{percent}"]
