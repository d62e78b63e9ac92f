"""The keys both own-data commands share (``train regression`` with ``protocol: fit``, ``train
classification``): the held-out share, the network's widths, activation and scales, the epochs,
whether to refit on every row, and the stopping rules of full-batch L-BFGS (:mod:`.full_batch`)
and of minibatch Adam with validation stopping (:mod:`.loop`).

The recipe for two or more hidden layers (:func:`prior_scale`, :func:`input_scale`,
:func:`fit_estimator`), also the UCI protocol's: every layer integrated by moment propagation (the
``deterministic`` estimator: nothing sampled, so L-BFGS minimizes an exact function, where the
``analytic`` estimator would sample the earlier layers and hand L-BFGS a different objective at
every evaluation), and with ``model.prior_scale=auto`` the first layer's weights on the
standardized inputs under the one-layer recipe's ``N(0, 1)``, every later layer's under
``N(0, 1/(H+1))``, ``H`` the widest hidden layer: the scale at which a layer of ``H`` units feeding
the next does not multiply its variance by ``H``. Under ``N(0, 1)`` a 50-unit hidden-to-hidden
layer does (x50): a posterior that fits the data is then thousands of nats from its prior, and
L-BFGS crawled (3,000 iterations, not converged, on most splits); ``N(0, 1/(H+1))`` on the first
layer as well converged but kept the first layer near its prior on a table that needs sharp
features of its inputs (``benchmarks/own_data_recipes.py``). The network holds one prior scale,
``1/sqrt(H+1)``: the fit trains the first layer on the inputs times ``sqrt(H+1)`` (its weights'
prior is then ``N(0, 1)`` in the inputs' own units, exactly) and puts the factor into the first
layer's weights when training ends (:func:`scale_first_layer`), so the model takes the
standardized inputs as any other. One hidden layer keeps the UCI protocol's validated ``N(0, 1)``.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from omegaconf import DictConfig

from ..bnn.estimators import ClosedForm, DeterministicPropagation, Estimator
from ..bnn.layers import GaussianMatrix
from ..moments import ACTIVATIONS
from ..runtime.checks import (
    require_bool,
    require_choice,
    require_fraction,
    require_int,
    require_positive_float,
    require_widths,
)
from ..runtime.errors import ConfigError

AUTO = "auto"


def require_prior_scale(cfg: DictConfig) -> None:
    """``model.prior_scale``: ``auto`` or a positive number."""
    if cfg.model.get("prior_scale") != AUTO:
        try:
            require_positive_float(cfg, "model.prior_scale")
        except ConfigError as error:
            raise ConfigError(f"{error} or auto (N(0, 1) for one hidden layer, N(0, 1/(H+1)) for more)") from None


def prior_scale(cfg: DictConfig, hidden_sizes: Sequence[int]) -> float:
    """The priors' standard deviation of a network with ``hidden_sizes``: ``model.prior_scale``, or
    for ``auto`` 1 with one hidden layer and ``1/sqrt(H+1)`` with more (``H`` the widest; the module
    docstring says why)."""
    value = cfg.model.prior_scale
    if value != AUTO:
        return float(value)
    sizes = [int(h) for h in hidden_sizes]
    return 1.0 if len(sizes) < 2 else 1.0 / math.sqrt(max(sizes) + 1)


def input_scale(cfg: DictConfig, hidden_sizes: Sequence[int]) -> float:
    """What the fit multiplies the standardized inputs by while it trains a network of
    ``hidden_sizes``: with ``model.prior_scale=auto`` and two or more hidden layers ``sqrt(H+1)``, so
    that the first layer's weights, under the network's prior ``N(0, 1/(H+1))``, act on the inputs as
    weights of prior ``N(0, 1)`` (the module docstring); 1 otherwise."""
    if cfg.model.prior_scale != AUTO or len(hidden_sizes) < 2:
        return 1.0
    return 1.0 / prior_scale(cfg, hidden_sizes)


@torch.no_grad()
def scale_first_layer(model, factor: float) -> None:
    """Multiply the weights the first (Gaussian) layer of ``model`` puts on its inputs by ``factor``,
    in distribution: their means, and their posterior's scale (standard deviations, the rows of a
    Cholesky factor or of a low-rank factor); its bias is left as it is. The layer then computes
    from inputs ``x`` what it computed from ``factor * x`` before (:func:`input_scale`)."""
    layer = model.layers[0]
    if not isinstance(layer, GaussianMatrix):
        raise ValueError("scale_first_layer() needs a network whose first layer is Gaussian")
    inputs = layer.loc.shape[1] - int(layer.bias)
    layer.loc[:, :inputs] *= factor
    layer.log_scale[:, :inputs] += math.log(factor)
    if layer.covariance == "full":
        layer.off_diagonal[:, :inputs, :] *= factor
    elif layer.covariance == "lowrank":
        layer.factor[:, :inputs, :] *= factor


def fit_estimator(hidden_sizes: Sequence[int]) -> Estimator:
    """How a fit integrates a network of ``hidden_sizes``: ``analytic`` (exact) with one hidden layer,
    ``deterministic`` (moments propagated, nothing sampled) with more."""
    return ClosedForm() if len(hidden_sizes) < 2 else DeterministicPropagation()


def validate_fit_settings(cfg: DictConfig) -> None:
    """Check ``data.test_fraction``, ``model.hidden_sizes``, ``model.activation``, ``model.init_scale``,
    ``model.prior_scale``, ``fit.refit``, ``fit.full_batch_max_rows``, ``fit.max_iterations``,
    ``fit.evaluate_every``, ``fit.patience``, ``fit.rtol``, ``fit.validation_fraction`` and
    ``trainer.epochs``; each error names the key."""
    require_fraction(cfg, "data.test_fraction", 1.0, "the held-out share (e.g. 0.1)")
    require_widths(cfg, "model.hidden_sizes", example="[50]")
    require_choice(cfg, "model.activation", sorted(ACTIVATIONS))
    require_positive_float(cfg, "model.init_scale")
    require_prior_scale(cfg)
    require_bool(cfg, "fit.refit")
    for key in ("full_batch_max_rows", "max_iterations", "evaluate_every", "patience"):
        require_int(cfg, f"fit.{key}", minimum=1)
    require_positive_float(cfg, "fit.rtol")
    require_fraction(
        cfg,
        "fit.validation_fraction",
        0.5,
        "the share of the training rows that decides when minibatch training stops (e.g. 0.1)",
    )
    require_int(cfg, "trainer.epochs", minimum=1)
