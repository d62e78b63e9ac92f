"""The config's values a pipeline acts on, parsed once at the command's boundary.

A command's config holds strings (``device=cuda:1``, ``estimator=analytic``,
``likelihood=heteroscedastic``). :func:`parse_run_values` turns them into the objects the
code uses -- a ``torch.device``, an :class:`~cfbnn_cli.bnn.estimators.Estimator`, a
likelihood -- or raises a :class:`~cfbnn_cli.runtime.errors.ConfigError` naming the key and
the fix. The CLI calls it once per run and hands the :class:`RunValues` to the pipeline's
``run(cfg, run_dir, values)`` and to the results file; a pipeline called from Python without
them parses the same config itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from .bnn.estimators import ESTIMATORS, Estimator, make_estimator
from .bnn.likelihoods import HeteroscedasticNormalLikelihood, NormalLikelihood
from .runtime.device import resolve_device
from .runtime.errors import ConfigError

# the regression likelihoods: one Normal noise precision, or a per-point noise variance from a
# second output (its expected log-likelihood closed form under the propagated moments)
REGRESSION_LIKELIHOODS = ("normal", "heteroscedastic")


@dataclass(frozen=True)
class RunValues:
    """What a run's config says, as objects.

    ``estimator`` and ``new_likelihood`` are ``None`` for a command whose config does not
    choose them; ``new_likelihood()`` gives a fresh likelihood object for each network (a
    learned precision is a parameter of the network it belongs to)."""

    device: torch.device
    estimator: Optional[Estimator] = None
    new_likelihood: Optional[Callable[[], torch.nn.Module]] = None
    likelihood_name: Optional[str] = None


def parse_run_values(cfg) -> RunValues:
    """:class:`RunValues` from ``device`` and, where the config has them, ``estimator`` and
    ``likelihood`` (with ``model.precision`` and ``model.learn_precision``)."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(cfg)
    device = resolve_device(OmegaConf.select(cfg, "device", default="auto"))
    estimator = None
    name = OmegaConf.select(cfg, "estimator", default=None)
    if name is not None:
        if name not in ESTIMATORS:
            raise ConfigError(f"estimator={name!r} is not one of {list(ESTIMATORS)}")
        estimator = make_estimator(name)
    likelihood = OmegaConf.select(cfg, "likelihood", default=None)
    new_likelihood = None
    if likelihood is not None:
        if likelihood not in REGRESSION_LIKELIHOODS:
            raise ConfigError(f"likelihood={likelihood!r} is not one of {list(REGRESSION_LIKELIHOODS)}")
        new_likelihood = _likelihood_factory(cfg, likelihood)
    return RunValues(device, estimator, new_likelihood, likelihood)


def _likelihood_factory(cfg, name: str):
    if name == "heteroscedastic":
        return HeteroscedasticNormalLikelihood
    precision = OmegaConf.select(cfg, "model.precision", default=1.0)
    learn = OmegaConf.select(cfg, "model.learn_precision", default=True)
    if isinstance(precision, bool) or not isinstance(precision, (int, float)) or not precision > 0:
        raise ConfigError(f"model.precision={precision!r} must be a positive, finite number")
    if not isinstance(learn, bool):
        raise ConfigError(f"model.learn_precision={learn!r} must be true or false")
    return lambda: NormalLikelihood(float(precision), learn)
