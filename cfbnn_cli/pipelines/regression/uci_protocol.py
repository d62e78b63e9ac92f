"""The standard UCI regression protocol, cfbnn's closed form beside its peers, each at its best.

Hernandez-Lobato & Adams (2015), as used by DVI (Wu et al. 2019): ``uci.n_splits``
random 90/10 train/test splits (split ``k`` drawn from seed ``k``, so every run and
every method sees the same splits; the indices are written to ``splits.json``),
inputs and targets standardized by the training rows, test log-likelihood per point
and RMSE in the target's original units, mean +- standard error over splits.

All cfbnn methods are the one network, :class:`~cfbnn_cli.bnn.network.BayesianNetwork`
(``model.hidden_sizes``, output bias on, as Pyro's ``nn.Linear`` peers have), and every
method of a split starts from the same weight means. Each trains by its own stopping
rule, not to a shared step count:

* ``closed_form_diagonal`` / ``closed_form_full`` / ``closed_form_lowrank`` -- the exact
  ELBO (nothing sampled with one hidden layer), posterior standard deviations started at
  ``model.init_scale``. Up to ``uci.full_batch_max_rows`` training rows it is optimized
  deterministically on all rows at once by L-BFGS with a strong-Wolfe line search until it
  converges (:func:`~cfbnn_cli.train.full_batch.minimize_full_batch`: relative ELBO change
  below ``uci.rtol``, a vanishing gradient, or no further progress; ``uci.max_iterations``
  caps it); with ``model.prior=empirical_bayes`` the per-layer prior variances are then
  learned too, from that optimum (from a cold start the learned prior collapses onto a
  degenerate optimum). Prediction: the exact predictive mean and variance as a Normal
  ``N(mean, var_A + var_B + 1/beta)``.
* ``local_reparameterization`` -- the same diagonal family, 1-sample local-reparameterization
  ELBO; Monte Carlo predictive (``uci.predictive_samples``, log-mean-exp);
* ``pyro`` -- :class:`~cfbnn_cli.bnn.pyro_glue.PyroMLPRegression` (``nn.Linear`` +
  ``PyroSample`` priors, learned noise) with an ``AutoNormal`` guide and ``Trace_ELBO``,
  predicting with ``pyro.infer.Predictive``;
* ``pyro_local_reparameterization`` -- :class:`~cfbnn_cli.bnn.pyro_glue.PyroLocalReparameterizationRegression`
  with ``TraceMeanField_ELBO`` (analytic KL, local-reparameterization likelihood);
* ``plain_mlp`` -- the network with point-estimate layers and a learned Gaussian noise
  (maximum likelihood; the non-Bayesian reference);
* ``deterministic_2_hidden`` -- two hidden layers (``uci.deep_hidden_sizes``) under the
  ``deterministic`` estimator: the first layer exact, the second's moments propagated,
  the output layer exact; nothing sampled, so it trains like the closed forms;
* ``heteroscedastic`` / ``heteroscedastic_2_hidden`` -- a second output, the log noise
  variance, with the heteroscedastic likelihood's closed-form ELL under the propagated
  Gaussian (an approximation, its bias measured in ``benchmarks/deterministic_bias.py``);
  prediction by Gauss-Hermite over the log-variance (``HeteroscedasticNormalLikelihood.
  predictive_mixture``).

The sampling peers start their posterior standard deviations at ``uci.sampling_init_scale``
(small: their gradient noise grows with it). The minibatch methods (and a closed form above
``full_batch_max_rows``) train with Adam (``trainer.batch_size``, ``trainer.lr``) on the
training rows less a validation part (``uci.validation_fraction``, drawn per split),
evaluate the validation log-likelihood every ``uci.evaluate_every`` epochs, keep the best,
and stop ``uci.patience`` epochs after it (``trainer.epochs`` caps them). Beside the final
numbers the table keeps an equal-wall-time view: each minibatch method's test
log-likelihood at the training time the reference closed form (the first in
``uci.methods``) took on that split -- its parameters at that moment, or its final ones if
it stopped sooner.

Timing: after an untimed warm-up of every method, training seconds (wall time of the
whole fit, its stopping rule included) are reported as the median over splits; prediction
time per 1,000 points as the median of ``uci.timing_repeats`` timed calls after a warm-up,
then the median over splits. Progress is saved after every (split, method), so
``resume=true`` re-runs only what is missing.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import matplotlib.ticker
import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from ...bnn.likelihoods import HeteroscedasticNormalLikelihood, NormalLikelihood
from ...bnn.network import PRIORS, BayesianNetwork, mixture_log_likelihood, mixture_mean
from ...data.regression import RegressionData, RegressionTable, load_regression_table, validate_data_config
from ...moments import ACTIVATIONS, validate_args
from ...report.figures import new_figure, save_figure
from ...report.numbers import format_mean_se, format_value
from ...report.tables import write_table
from ...runtime.checks import require_choice, require_int, require_positive_float, require_widths
from ...runtime.device import resolve_device
from ...runtime.errors import CheckpointError, ConfigError, DataError
from ...runtime.io import atomic_write_json
from ...runtime.numerics import map_row_chunks, rows_per_chunk
from ...runtime.rundir import config_fingerprint, refuse_other_config
from ...train import TrainingLoop
from ...train.full_batch import minimize_full_batch

log = logging.getLogger(__name__)

METHODS = {
    "closed_form_diagonal": "cfbnn closed form (diagonal)",
    "closed_form_full": "cfbnn closed form (full)",
    "closed_form_lowrank": "cfbnn closed form (low-rank)",
    "local_reparameterization": "cfbnn local reparam. (1 sample)",
    "pyro": "Pyro AutoNormal + Trace_ELBO",
    "pyro_local_reparameterization": "Pyro local reparam. (TraceMeanField_ELBO)",
    "plain_mlp": "plain MLP (ML, learned noise)",
    "deterministic_2_hidden": "cfbnn deterministic, 2 hidden layers",
    "heteroscedastic": "cfbnn closed form, heteroscedastic",
    "heteroscedastic_2_hidden": "cfbnn deterministic, heteroscedastic, 2 hidden",
}
# beyond the paper (moment propagation and an input-dependent noise): (likelihood, deep) per method;
# they train like the closed forms (full-batch L-BFGS on their deterministic ELBO)
DETERMINISTIC_METHODS = {
    "deterministic_2_hidden": ("normal", True),
    "heteroscedastic": ("heteroscedastic", False),
    "heteroscedastic_2_hidden": ("heteroscedastic", True),
}
MIN_ROWS = 10  # a 90/10 split needs at least one test point and a handful of training rows


# ----------------------------------------------------------------------------- config and splits


def validate(cfg: DictConfig) -> List[str]:
    """Every check that needs no data; returns the methods. Runs before any work."""
    require_int(cfg, "uci.n_splits", minimum=1)
    require_int(cfg, "uci.predictive_samples", minimum=1)
    require_int(cfg, "uci.validation_samples", minimum=1)
    require_int(cfg, "uci.timing_repeats", minimum=1)
    require_int(cfg, "uci.full_batch_max_rows", minimum=1)
    require_int(cfg, "uci.max_iterations", minimum=1)
    require_int(cfg, "uci.patience", minimum=1)
    require_int(cfg, "uci.evaluate_every", minimum=1)
    require_int(cfg, "trainer.epochs", minimum=1)
    require_int(cfg, "trainer.batch_size", minimum=1)
    require_positive_float(cfg, "uci.rtol")
    require_positive_float(cfg, "trainer.lr")
    require_choice(cfg, "model.prior", list(PRIORS))
    # the deterministic methods' hidden layers
    require_widths(cfg, "uci.deep_hidden_sizes", minimum_length=2, example="[50,50]")
    validation = OmegaConf.select(cfg, "uci.validation_fraction")
    if isinstance(validation, bool) or not isinstance(validation, (int, float)) or not 0 < validation < 0.5:
        raise ConfigError(
            f"uci.validation_fraction={validation!r} must be a number in (0, 0.5): the share of each "
            "split's training rows that decides when the minibatch methods stop (e.g. 0.1)"
        )
    require_int(cfg, "model.rank", minimum=1)
    require_positive_float(cfg, "model.init_scale")
    require_positive_float(cfg, "uci.sampling_init_scale")
    require_positive_float(cfg, "model.prior_scale")
    require_choice(cfg, "model.activation", sorted(ACTIVATIONS))
    sizes = require_widths(cfg, "model.hidden_sizes", example="[50]")
    validate_data_config(cfg)
    if OmegaConf.select(cfg, "data.test_fraction", default=None) is None:
        raise ConfigError("data.test_fraction is missing: the protocol needs it (the paper uses 0.1)")
    methods = OmegaConf.select(cfg, "uci.methods")
    methods = list(methods) if methods is not None else []
    unknown = [m for m in methods if m not in METHODS]
    if not methods or unknown:
        raise ConfigError(
            f"uci.methods={methods} must be a non-empty list drawn from {list(METHODS)}"
            + (f"; unknown: {unknown}" if unknown else "")
        )
    if len(set(methods)) != len(methods):
        raise ConfigError(f"uci.methods={methods} lists a method twice")
    pyro_peers = [m for m in methods if m.startswith("pyro")]
    if len(sizes) > 1 and pyro_peers:
        raise ConfigError(
            f"uci.methods includes {pyro_peers}, whose peer network has one hidden layer; "
            f"model.hidden_sizes={sizes} (drop them or use one hidden layer)"
        )
    return methods


def make_splits(num_rows: int, n_splits: int, test_fraction: float) -> List[Tuple[np.ndarray, np.ndarray]]:
    """``n_splits`` random (train, test) index arrays; split ``k`` is a permutation from seed ``k``."""
    needed = max(MIN_ROWS, n_splits)
    if num_rows < needed:
        raise DataError(
            f"the data has {num_rows} rows; the UCI protocol with uci.n_splits={n_splits} needs at least {needed} "
            f"(lower uci.n_splits or use more data)"
        )
    n_test = max(1, int(round(test_fraction * num_rows)))
    if num_rows - n_test < 2:
        raise DataError(f"data.test_fraction={test_fraction} leaves {num_rows - n_test} training rows of {num_rows}")
    splits = []
    for k in range(n_splits):
        order = np.random.default_rng(k).permutation(num_rows)
        splits.append((np.sort(order[n_test:]), np.sort(order[:n_test])))
    return splits


def original_units(log_likelihood: torch.Tensor, squared_error: torch.Tensor, target_std: float) -> Tuple[float, float]:
    """Per-point test LL and RMSE of standardized targets, in the target's original units.

    ``y = mean + target_std * z`` changes densities by the Jacobian ``1/target_std``:
    ``log p(y) = log p(z) - log target_std``; errors scale by ``target_std``.
    """
    return (
        float(log_likelihood.mean()) - math.log(target_std),
        math.sqrt(float(squared_error.mean())) * target_std,
    )


# ----------------------------------------------------------------------------- the methods


@dataclass
class Fitted:
    """A trained method: ``predict(x) -> (component means (S, N), component variances (S, N))``.

    The predictive density is the equal mixture of ``N(mean_s, var_s)``; ``iterations`` are
    L-BFGS iterations or Adam epochs; ``equal_time`` the test metrics at the default closed
    form's training time (minibatch methods only).
    """

    predict: Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]
    noise_std: float  # the learned observation noise, standardized units
    optimizer: str  # "lbfgs" (full batch, to convergence) or "adam" (minibatches, validation stopping)
    iterations: int  # L-BFGS iterations or Adam epochs
    converged: bool = False  # L-BFGS met its convergence test
    stopped_early: bool = False  # Adam stopped by the validation rule before trainer.epochs
    equal_time: Optional[Dict[str, float]] = None


@dataclass
class Split:
    """One split's data and what every method of it shares."""

    data: RegressionData
    index: int
    equal_time_seconds: Optional[float] = None  # the default closed form's training time on this split
    progress: Optional[object] = None  # the protocol's bar (one tick per fit): steps show as its postfix
    warm_up: bool = False  # the untimed warm-up fit before the first split, not a result


def _network(
    data,
    cfg,
    generator,
    covariance="diagonal",
    point_layers: int = 0,
    init_scale: Optional[float] = None,
    sizes: Optional[List[int]] = None,
    heteroscedastic: bool = False,
) -> BayesianNetwork:
    """The network every cfbnn method of the protocol uses (``model.*``), with a learned noise
    (or, ``heteroscedastic``, a second output for the log noise variance); posterior standard
    deviations start at ``init_scale`` (default ``model.init_scale``)."""
    sizes = list(cfg.model.hidden_sizes) if sizes is None else list(sizes)
    if isinstance(covariance, str):
        # the output layer's covariance is diagonal or full; low rank applies to the hidden layers
        covariance = [covariance] * len(sizes) + ["full" if covariance == "full" else "diagonal"]
    likelihood = (
        HeteroscedasticNormalLikelihood()
        if heteroscedastic
        else NormalLikelihood(cfg.model.precision, cfg.model.learn_precision)
    )
    return BayesianNetwork(
        data.input_dim,
        sizes,
        2 if heteroscedastic else 1,
        cfg.model.activation,
        covariance[point_layers:],
        cfg.model.rank,
        cfg.model.prior_scale,
        cfg.model.init_scale if init_scale is None else init_scale,
        likelihood,
        point_layers=point_layers,
        generator=generator,
    )


def _validation_split(num_train: int, fraction: float, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(fit rows, validation rows)`` of the training rows, drawn from ``seed``."""
    order = torch.randperm(num_train, generator=torch.Generator().manual_seed(seed))
    count = max(1, int(round(fraction * num_train)))
    return order[count:].sort().values, order[:count].sort().values


def _predictive_log_likelihood(predict, x, y) -> float:
    with torch.no_grad():
        return float(mixture_log_likelihood(y, *predict(x)).mean())


def _fit_by_validation(
    name,
    module,
    parameters,
    loss_on_rows,
    predict,
    validation_predict,
    split: Split,
    cfg,
    device,
    noise_std: Callable[[], float],
    generators: Sequence[torch.Generator] = (),
) -> Fitted:
    """Adam on minibatches of the training rows less a validation part; the best validation
    log-likelihood kept, stop ``uci.patience`` epochs after it (``trainer.epochs`` caps it).
    Leaves ``module`` at its best epoch; ``equal_time`` holds the test metrics of its
    parameters at ``split.equal_time_seconds`` of training, if it trained that long."""
    data = split.data
    fit_rows, validation_rows = _validation_split(data.num_train, cfg.uci.validation_fraction, 10_000 + split.index)
    fit_rows, validation_rows = fit_rows.to(device), validation_rows.to(device)
    x_validation, y_validation = data.x_train[validation_rows], data.y_train[validation_rows]
    loop = TrainingLoop(
        module,
        torch.optim.Adam(parameters, lr=cfg.trainer.lr),
        lambda rows: loss_on_rows(fit_rows[rows], len(fit_rows)),
        len(fit_rows),
        min(cfg.trainer.batch_size, len(fit_rows)),
        device,
        epochs=cfg.trainer.epochs,
        data_generator=torch.Generator().manual_seed(split.index),
        label=name,
        evaluate=lambda epoch: {
            "validation_ll": _predictive_log_likelihood(validation_predict, x_validation, y_validation)
        },
        select=("validation_ll", "max"),
        patience=cfg.uci.patience,
        evaluate_every=cfg.uci.evaluate_every,
        snapshot_after_seconds=split.equal_time_seconds,
        progress=_StepCount(split.progress),
        generators={f"sampler{i}": g for i, g in enumerate(generators)},
        cuda_graphs=cfg.trainer.cuda_graphs,
    )
    with _quiet("cfbnn_cli.train.loop"):
        result = loop.run()
    equal_time = None
    if loop.snapshot is not None:
        final = copy.deepcopy(module.state_dict())
        module.load_state_dict(loop.snapshot)
        equal_time = test_metrics(predict, data, cfg)
        module.load_state_dict(final)
    loop.load_best()
    return Fitted(
        predict, noise_std(), "adam", len(result.history), stopped_early=loop.stopped_early, equal_time=equal_time
    )


class _StepCount:
    """Stands in for the loop's per-epoch bars: counts steps on the protocol's bar postfix."""

    def __init__(self, bar):
        self.bar, self.steps = bar, 0

    def update(self, steps: int) -> None:
        before, self.steps = self.steps, self.steps + steps
        if self.bar is not None and before // 200 != self.steps // 200:
            self.bar.set_postfix_str(f"{self.steps} steps", refresh=False)


@contextlib.contextmanager
def _quiet(logger_name: str, level: int = logging.WARNING):
    """The training loop logs one line per epoch; the protocol's thousands of short epochs
    would drown its log, so it logs one line per (split, method) instead."""
    logger = logging.getLogger(logger_name)
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)


def _fit_closed_form(covariance, split: Split, cfg, device, generator, method: Optional[str] = None):
    """A method with nothing sampled in its ELBO: a closed form (``covariance``) or one of
    :data:`DETERMINISTIC_METHODS` (``method``)."""
    data = split.data
    name = method or f"closed_form_{covariance}"
    likelihood, deep = DETERMINISTIC_METHODS.get(method, ("normal", False))
    estimator = "deterministic" if deep else "analytic"
    model = _network(
        data,
        cfg,
        generator,
        covariance,
        sizes=list(cfg.uci.deep_hidden_sizes) if deep else None,
        heteroscedastic=likelihood == "heteroscedastic",
    ).to(device)
    sampler = torch.Generator(device=device).manual_seed(int(generator.initial_seed()) + 1)

    @torch.no_grad()
    def predict(x):  # exact when nothing is sampled (one hidden layer, or the deterministic methods)
        return model.predictive_components(x, estimator, cfg.uci.predictive_samples, sampler)

    def noise_std():  # the learned noise, or for a heteroscedastic net root mean exp(l) over the training inputs
        if likelihood == "normal":
            return float(model.precision.detach()) ** -0.5
        with torch.no_grad():
            mean, _ = model.output_moments(data.x_train, estimator, ())
        return float(mean[..., 1].exp().mean().sqrt())

    if data.num_train > cfg.uci.full_batch_max_rows:  # too many rows for one batch: minibatch Adam like the peers
        return _fit_by_validation(
            name,
            model,
            model.parameters(),
            lambda rows, count: -model.elbo(data.x_train[rows], data.y_train[rows], count, estimator),
            predict,
            predict,
            Split(data, split.index),
            cfg,
            device,
            noise_std,
        )
    num_data = data.num_train

    def negative_elbo_per_point():
        return -model.elbo(data.x_train, data.y_train, num_data, estimator) / num_data

    options = dict(
        max_iterations=cfg.uci.max_iterations,
        rtol=cfg.uci.rtol,
        label=f"{name} ELBO",
        progress=_StepCount(split.progress),
    )
    result = minimize_full_batch(negative_elbo_per_point, model.parameters(), **options)
    iterations, converged = result.iterations, result.converged
    if cfg.model.prior == "empirical_bayes":  # learned prior variances, from the fixed-prior optimum
        model.prior = "empirical_bayes"
        result = minimize_full_batch(negative_elbo_per_point, model.parameters(), **options)
        iterations, converged = iterations + result.iterations, converged and result.converged
    return Fitted(predict, noise_std(), "lbfgs", iterations, converged)


def _fit_local_reparameterization(split: Split, cfg, device, generator):
    data = split.data
    model = _network(data, cfg, generator, init_scale=cfg.uci.sampling_init_scale).to(device)
    sampler = torch.Generator(device=device).manual_seed(int(generator.initial_seed()) + 1)

    def predictor(samples):
        @torch.no_grad()
        def predict(x):
            outputs = model.sample_outputs(x, samples, sampler)
            return outputs, torch.full_like(outputs, 1.0 / float(model.precision))

        return predict

    return _fit_by_validation(
        "local_reparameterization",
        model,
        model.parameters(),
        lambda rows, count: -model.elbo(data.x_train[rows], data.y_train[rows], count, "sampling", generator=sampler),
        predictor(cfg.uci.predictive_samples),
        predictor(cfg.uci.validation_samples),
        split,
        cfg,
        device,
        lambda: float(model.precision.detach()) ** -0.5,
        generators=(sampler,),
    )


def _starting_means(data, cfg, generator) -> Dict[str, torch.Tensor]:
    """cfbnn's starting means (a fresh network from the same seed) as ``nn.Linear`` weights
    and biases ``fc1``/``fc2``: every method of a split starts from the same point."""
    network = _network(data, cfg, generator)
    hidden, output = network.layers
    return {
        "fc1.weight": hidden.loc[:, :-1].detach(),
        "fc1.bias": hidden.loc[:, -1].detach(),
        "fc2.weight": output.loc[:, :-1].detach(),
        "fc2.bias": output.loc[:, -1].detach(),
    }


def _fit_pyro(split: Split, cfg, device, generator):
    import pyro
    from pyro.infer import Predictive, Trace_ELBO
    from pyro.infer.autoguide import AutoNormal
    from pyro.infer.autoguide.initialization import init_to_value

    from ...bnn.pyro_glue import PyroMLPRegression

    data = split.data
    pyro.clear_param_store()
    pyro.set_rng_seed(int(generator.initial_seed()))
    D, H = data.input_dim, cfg.model.hidden_sizes[0]
    model = PyroMLPRegression(D, H, cfg.model.activation, cfg.model.prior_scale, device=device)
    # the same starting means as cfbnn's (randn / sqrt(fan_in)), not Pyro's all-zero default
    start = _starting_means(data, cfg, generator)
    guide = AutoNormal(
        model,
        init_loc_fn=init_to_value(values={k: v.to(device) for k, v in start.items()}),
        init_scale=cfg.uci.sampling_init_scale,
    )
    elbo = Trace_ELBO()
    elbo.differentiable_loss(model, guide, data.x_train[:2], data.y_train[:2], data.num_train)  # creates the parameters
    both = torch.nn.ModuleDict({"guide": guide, "model": model})

    def predictor(samples):
        @torch.no_grad()
        def predict(x):
            outputs = Predictive(model, guide=guide, num_samples=samples, return_sites=("_RETURN",))(x)["_RETURN"]
            return outputs, torch.full_like(outputs, float(model.noise_scale.detach()) ** 2)

        return predict

    return _fit_by_validation(
        "pyro",
        both,
        list(both.parameters()),
        lambda rows, count: elbo.differentiable_loss(model, guide, data.x_train[rows], data.y_train[rows], count),
        predictor(cfg.uci.predictive_samples),
        predictor(cfg.uci.validation_samples),
        split,
        cfg,
        device,
        lambda: float(model.noise_scale.detach()),
    )


def _fit_pyro_local_reparameterization(split: Split, cfg, device, generator):
    import pyro
    from pyro.infer import Predictive, TraceMeanField_ELBO

    from ...bnn.pyro_glue import PyroLocalReparameterizationRegression

    data = split.data
    pyro.clear_param_store()
    pyro.set_rng_seed(int(generator.initial_seed()))
    model = PyroLocalReparameterizationRegression(
        data.input_dim,
        cfg.model.hidden_sizes[0],
        cfg.model.activation,
        cfg.model.prior_scale,
        cfg.uci.sampling_init_scale,
        start=_starting_means(data, cfg, generator),
        device=device,
    )
    elbo = TraceMeanField_ELBO()  # the weights' KL analytically; the likelihood by local reparameterization

    def predictor(samples):
        @torch.no_grad()
        def predict(x):
            outputs = Predictive(model.model, guide=model.guide, num_samples=samples, return_sites=("_RETURN",))(x)
            outputs = outputs["_RETURN"]
            return outputs, torch.full_like(outputs, float(model.noise_scale.detach()) ** 2)

        return predict

    return _fit_by_validation(
        "pyro_local_reparameterization",
        model,
        list(model.parameters()),
        lambda rows, count: elbo.differentiable_loss(
            model.model, model.guide, data.x_train[rows], data.y_train[rows], count
        ),
        predictor(cfg.uci.predictive_samples),
        predictor(cfg.uci.validation_samples),
        split,
        cfg,
        device,
        lambda: float(model.noise_scale.detach()),
    )


def _fit_plain_mlp(split: Split, cfg, device, generator):
    data = split.data
    start = _starting_means(data, cfg, generator)
    model = _network(data, cfg, None, point_layers=len(cfg.model.hidden_sizes) + 1)
    with torch.no_grad():  # the same starting means as the Bayesian methods
        for index, name in enumerate(("fc1", "fc2")):
            model.layers[index].weight.copy_(start[f"{name}.weight"])
            model.layers[index].bias.copy_(start[f"{name}.bias"])
    model = model.to(device)

    @torch.no_grad()
    def predict(x):
        mean = model.output_mean(x).unsqueeze(0)
        return mean, torch.full_like(mean, 1.0 / float(model.precision))

    def loss(rows, count):  # maximum likelihood with a learned noise: the mean negative log-likelihood
        return -model.expected_log_likelihood(data.x_train[rows], data.y_train[rows]) / rows.numel()

    return _fit_by_validation(
        "plain_mlp",
        model,
        model.parameters(),
        loss,
        predict,
        predict,
        split,
        cfg,
        device,
        lambda: float(model.precision.detach()) ** -0.5,
    )


def fit_method(method: str, split: Split, cfg, device, seed: int) -> Fitted:
    generator = torch.Generator().manual_seed(seed)
    if method.startswith("closed_form_"):
        return _fit_closed_form(method[len("closed_form_") :], split, cfg, device, generator)
    if method in DETERMINISTIC_METHODS:
        return _fit_closed_form("diagonal", split, cfg, device, generator, method)
    fit = {
        "local_reparameterization": _fit_local_reparameterization,
        "pyro": _fit_pyro,
        "pyro_local_reparameterization": _fit_pyro_local_reparameterization,
        "plain_mlp": _fit_plain_mlp,
    }[method]
    return fit(split, cfg, device, generator)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# what every finished (split, method) record holds: numbers (finite or not: a diverged fit is
# a result), counts and flags; the summary averages these over splits, so none may be missing
_PROGRESS_NUMBERS = ("test_ll", "rmse", "train_seconds", "predict_seconds_per_1000", "noise_std")
_PROGRESS_FLAGS = ("converged", "stopped_early")


def _progress_record_problem(record) -> Optional[str]:
    """Why ``record`` is not a finished (split, method) record, or ``None``."""
    if not isinstance(record, dict):
        return f"a {type(record).__name__}, not an object"
    split, method = record.get("split"), record.get("method")
    if isinstance(split, bool) or not isinstance(split, int) or split < 0:
        return f"split {split!r:.40} is not a non-negative integer"
    if not isinstance(method, str) or method not in METHODS:
        return f"method {method!r:.40} is not one of the protocol's methods"
    for key in _PROGRESS_NUMBERS:
        value = record.get(key)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (isinstance(value, int) and abs(value) > 1e300)
        ):
            return f"split {split} {method}: {key} is {'missing' if value is None else repr(value)[:40]}, not a number"
    iterations = record.get("iterations")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
        return f"split {split} {method}: iterations {iterations!r:.40} is not a count"
    for key in _PROGRESS_FLAGS:
        if not isinstance(record.get(key), bool):
            return f"split {split} {method}: {key} is not true/false"
    equal = record.get("equal_time_test_ll")
    if equal is not None and (
        isinstance(equal, bool)
        or not isinstance(equal, (int, float))
        or (isinstance(equal, int) and abs(equal) > 1e300)
    ):
        return f"split {split} {method}: equal_time_test_ll is not a number"
    return None


def read_progress(path: Path, fingerprint: str, n_splits: int, methods: List[str]) -> List[dict]:
    """The finished (split, method) records of ``uci_progress.json``, if this configuration wrote them.

    Every record is checked (types, ranges, required fields, one record per (split,
    method)); anything else is a one-line :class:`CheckpointError` naming the file."""
    try:
        if not path.is_file():
            raise ValueError("not a regular file")
        progress = json.loads(path.read_text())
        if not isinstance(progress, dict):
            raise ValueError(f"a {type(progress).__name__}, not an object")
        records = progress["records"]
        if not isinstance(records, list):
            raise ValueError("its records are not a list")
        for record in records:
            problem = _progress_record_problem(record)
            if problem is not None:
                raise ValueError(f"a record is not a finished (split, method) result: {problem}")
        keys = [(r["split"], r["method"]) for r in records]
        if len(set(keys)) != len(keys):
            raise ValueError("a (split, method) appears twice")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as error:
        raise CheckpointError(
            f"cannot read {path} ({type(error).__name__}: {str(error)[:200]}); delete it to re-run every split, "
            "or start a fresh run dir"
        ) from None
    refuse_other_config(str(path), progress.get("config_fingerprint"), fingerprint)
    return [r for r in records if r["split"] < n_splits and r["method"] in methods]


def test_metrics(predict, data: RegressionData, cfg) -> Dict[str, float]:
    """Test LL and RMSE in the target's original units; ``predict`` over row chunks (peak
    memory bounded whatever the test-set size)."""
    chunk = rows_per_chunk(
        cfg.uci.predictive_samples * max(list(cfg.model.hidden_sizes) + list(cfg.uci.deep_hidden_sizes))
    )
    with torch.no_grad():
        mixture = map_row_chunks(predict, data.x_test, chunk)  # (means, variances[, log_weights])
    log_likelihood = mixture_log_likelihood(data.y_test, *mixture)
    squared_error = (mixture_mean(mixture[0], *mixture[2:]) - data.y_test).square()
    test_ll, rmse = original_units(log_likelihood, squared_error, data.target_std)
    return {"test_ll": test_ll, "rmse": rmse}


def prediction_seconds_per_1000(predict, data: RegressionData, device, repeats: int) -> float:
    """The median of ``repeats`` timed predictions of 1,000 points, after a warm-up."""
    thousand = data.x_test.repeat(math.ceil(1000 / data.x_test.shape[0]), 1)[:1000]
    predict(thousand)  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        predict(thousand)
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def evaluate(fitted: Fitted, data: RegressionData, device, cfg) -> Dict[str, float]:
    """Test metrics, the learned noise (original units) and the robust prediction time."""
    record = test_metrics(fitted.predict, data, cfg)
    record["predict_seconds_per_1000"] = prediction_seconds_per_1000(
        fitted.predict, data, device, cfg.uci.timing_repeats
    )
    record["noise_std"] = fitted.noise_std * data.target_std
    return record


# ----------------------------------------------------------------------------- outputs


def _mean_and_standard_error(values: pd.Series) -> Tuple[float, Optional[float]]:
    values = values.astype(float).dropna()
    se = float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else None  # one split: no s.e.
    return float(values.mean()), se


def _iterations(method: str, part: pd.DataFrame, cfg) -> str:
    """How the method stopped, with its median count: L-BFGS iterations or Adam epochs."""
    median = int(round(float(part["iterations"].median())))
    if part["optimizer"].iloc[0] == "lbfgs":
        converged = int(part["converged"].sum())
        return f"L-BFGS {median} it. ({converged}/{len(part)} converged)"
    stopped = int(part["stopped_early"].sum())
    return f"Adam {median} ep. ({stopped}/{len(part)} stopped by validation)"


def summary_table(records: pd.DataFrame, methods: List[str], cfg, reference: Optional[str] = None) -> pd.DataFrame:
    """One row per method: mean ± s.e. over splits of the test LL and RMSE (original
    units), the test LL minus the reference closed form's on the same split (paired, so
    the split-to-split spread cancels: the column that says whether a difference is
    real), the test LL at the reference's training time, and medians over splits of
    training seconds, iterations and prediction time. Rounded by the shared
    :func:`~cfbnn_cli.report.numbers.format_mean_se` like every cfbnn table."""
    base = records[records["method"] == reference].set_index("split")["test_ll"] if reference is not None else None
    rows = []
    for method in methods:
        part = records[records["method"] == method]
        equal = part["equal_time_test_ll"].astype(float)
        paired = "—"
        if base is not None and method != reference:
            difference = (part.set_index("split")["test_ll"] - base).dropna()
            paired = format_mean_se(*_mean_and_standard_error(difference), signed=True, scientific=False)
        rows.append(
            {
                "Method": METHODS[method],
                "Test LL": format_mean_se(*_mean_and_standard_error(part["test_ll"])),
                f"Test LL − {SHORT_NAMES.get(reference, 'closed form')} (paired)": paired,
                "RMSE": format_mean_se(*_mean_and_standard_error(part["rmse"])),
                "Test LL at closed form's time": (
                    format_mean_se(*_mean_and_standard_error(equal)) if equal.notna().all() else "—"
                ),
                "Train s (median)": format_value(part["train_seconds"].median()),
                "Stopping": _iterations(method, part, cfg),
                "Predict ms / 1000 pts (median)": format_value(1e3 * part["predict_seconds_per_1000"].median()),
            }
        )
    return pd.DataFrame(rows).set_index("Method")


SHORT_NAMES = {
    "closed_form_diagonal": "closed form (diag.)",
    "closed_form_full": "closed form (full)",
    "closed_form_lowrank": "closed form (low-rank)",
    "local_reparameterization": "cfbnn local reparam.",
    "pyro": "Pyro AutoNormal",
    "pyro_local_reparameterization": "Pyro local reparam.",
    "plain_mlp": "plain MLP",
    "deterministic_2_hidden": "deterministic, 2 hidden",
    "heteroscedastic": "heteroscedastic",
    "heteroscedastic_2_hidden": "heteroscedastic, 2 hidden",
}


def _plot(records: pd.DataFrame, methods: List[str], reference: Optional[str], title: str, path: Path) -> str:
    """Left: each method's test LL minus the reference closed form's on the same split (one
    dot per split, the mean as a bar; right of zero = better than the closed form). Right:
    mean test LL (± s.e.) against the median training time, the accuracy-for-cost view."""
    fig, axes = new_figure(2, width=7.5, height=max(2.8, 1.2 + 0.3 * len(methods)))
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    rows = list(reversed(methods))  # the first method on top
    if reference is not None:
        base = records[records["method"] == reference].set_index("split")["test_ll"]
        for row, method in enumerate(rows):
            difference = (records[records["method"] == method].set_index("split")["test_ll"] - base).dropna()
            axes[0].plot(difference, np.full(len(difference), row), "o", ms=2.5, alpha=0.6, color=colors[method])
            axes[0].plot([difference.mean()] * 2, [row - 0.3, row + 0.3], "-", lw=2, color=colors[method])
        axes[0].axvline(0.0, color="0.5", lw=0.8, ls="--")
        axes[0].set_xlabel(f"test LL − {SHORT_NAMES[reference]}\n(same split, nats/point)")
    axes[0].set_yticks(range(len(rows)), [SHORT_NAMES[m] for m in rows])
    axes[0].set_ylim(-0.6, len(rows) - 0.4)
    for method in methods:
        part = records[records["method"] == method]
        mean, se = _mean_and_standard_error(part["test_ll"])
        axes[1].errorbar(
            float(part["train_seconds"].median()),
            mean,
            yerr=se or 0.0,
            fmt="o",
            ms=4,
            color=colors[method],
            capsize=2,
            label=SHORT_NAMES[method],
        )
    axes[1].set_xscale("log")
    # plain-number ticks (1, 2, 5, 10, ...) and no minor labels: matplotlib's default minor
    # labels on a log axis spanning less than a decade print on top of each other
    axes[1].xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axes[1].xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    axes[1].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[1].set_xlabel("training time per split\n(median, s)")
    axes[1].set_ylabel("test LL (mean ± s.e.)")
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=6, frameon=False)
    fig.suptitle(title, fontsize=8)
    return save_figure(fig, path)


def _warm_up(methods: List[str], table: RegressionTable, splits, cfg, device) -> None:
    """Untimed: each method trained briefly once (compiles the fast moments, imports Pyro,
    fills the allocator), so the first timed split is not charged for one-off costs."""
    small = OmegaConf.to_container(cfg, resolve=True)
    small["trainer"]["epochs"] = 2
    small["uci"].update(max_iterations=5, predictive_samples=8, validation_samples=8, timing_repeats=1)
    small = OmegaConf.create(small)
    train, test = splits[0]
    data = _to_device(table.split(train, test), device)
    with _quiet("cfbnn_cli.train.loop"):
        for method in methods:
            evaluate(fit_method(method, Split(data, 0, warm_up=True), small, device, seed=0), data, device, small)


def _to_device(data: RegressionData, device) -> RegressionData:
    data.x_train, data.y_train = data.x_train.to(device), data.y_train.to(device)
    data.x_test, data.y_test = data.x_test.to(device), data.y_test.to(device)
    return data


def run(cfg: DictConfig, run_dir) -> dict:
    run_dir = Path(run_dir)
    methods = validate(cfg)
    device = resolve_device(cfg.device)
    table: RegressionTable = load_regression_table(cfg.data)
    splits = make_splits(len(table.y), cfg.uci.n_splits, cfg.data.test_fraction)
    n_train = len(splits[0][0])
    batch_size = cfg.trainer.batch_size
    minibatch = [m for m in methods if not m.startswith("closed_form_") and m not in DETERMINISTIC_METHODS] or (
        methods if n_train > cfg.uci.full_batch_max_rows else []
    )
    n_fit = n_train - max(1, int(round(cfg.uci.validation_fraction * n_train)))
    if minibatch and batch_size > n_fit:
        raise ConfigError(
            f"trainer.batch_size={batch_size} exceeds the {n_fit} rows a split trains {', '.join(minibatch)} on "
            f"(its training rows less uci.validation_fraction={cfg.uci.validation_fraction}); lower it"
        )
    atomic_write_json(
        run_dir / "splits.json",
        {
            "data": table.name,
            "rows": len(table.y),
            "test_fraction": cfg.data.test_fraction,
            "seeds": list(range(len(splits))),
            "splits": [
                {"seed": k, "train": train.tolist(), "test": test.tolist()} for k, (train, test) in enumerate(splits)
            ],
        },
    )
    progress_path = run_dir / "uci_progress.json"
    fingerprint = config_fingerprint(cfg, run_dir)
    records: List[dict] = []
    if cfg.resume and progress_path.exists():
        records = read_progress(progress_path, fingerprint, len(splits), methods)
        log.info("resuming: %d of %d (split, method) runs already done", len(records), len(splits) * len(methods))
    done = {(r["split"], r["method"]): r for r in records}
    # the equal-time reference trains first on every split: the others' snapshots need its time
    closed_forms = [m for m in methods if m.startswith("closed_form_")]
    reference = closed_forms[0] if closed_forms else None
    order = ([reference] if reference else []) + [m for m in methods if m != reference]
    log.info(
        "UCI protocol on %s (%d rows, %d features): %d splits, %s, hidden layers %s, device=%s",
        table.name,
        len(table.y),
        table.x.shape[1],
        len(splits),
        ", ".join(methods),
        list(cfg.model.hidden_sizes),
        device,
    )
    remaining = len(splits) * len(methods) - len(done)
    with validate_args(False):
        _warm_up(
            [m for m in methods if any((k, m) not in done for k in range(len(splits)))], table, splits, cfg, device
        )
        with tqdm(total=remaining, desc="uci", unit="fit", leave=False) as bar:
            for k, (train, test) in enumerate(splits):
                split = Split(_to_device(table.split(train, test), device), k, progress=bar)
                for method in order:
                    if (k, method) in done:
                        if method == reference:
                            split.equal_time_seconds = done[(k, method)]["train_seconds"]
                        continue
                    bar.set_description(f"split {k} {method}")
                    _sync(device)
                    started = time.perf_counter()
                    fitted = fit_method(method, split, cfg, device, seed=cfg.seed * 1000 + k)
                    _sync(device)
                    seconds = time.perf_counter() - started
                    if method == reference:
                        split.equal_time_seconds = seconds
                    record = {
                        "split": k,
                        "method": method,
                        "train_seconds": seconds,
                        "iterations": fitted.iterations,
                        "optimizer": fitted.optimizer,
                        "converged": fitted.converged,
                        "stopped_early": fitted.stopped_early,
                    }
                    record.update(evaluate(fitted, split.data, device, cfg))
                    if method == reference:
                        record["equal_time_test_ll"] = record["test_ll"]
                    elif fitted.optimizer == "adam" and reference is not None:
                        # stopped before the reference's time: its final parameters are what it has then
                        record["equal_time_test_ll"] = (fitted.equal_time or record)["test_ll"]
                    else:
                        record["equal_time_test_ll"] = None  # another full-batch closed form: its own time
                    records.append(record)
                    atomic_write_json(progress_path, {"config_fingerprint": fingerprint, "records": records})
                    bar.update(1)
                    log.info(
                        "split %d %-26s test LL %8.4f  RMSE %10.4g  train %6.2fs (%s %d)  predict %.2f ms/1000",
                        k,
                        method,
                        record["test_ll"],
                        record["rmse"],
                        seconds,
                        fitted.optimizer,
                        fitted.iterations,
                        1e3 * record["predict_seconds_per_1000"],
                    )
    frame = pd.DataFrame(records).sort_values(["split", "method"])
    tables = write_table(frame.set_index(["split", "method"]), run_dir, "uci_splits")
    summary = summary_table(frame, methods, cfg, reference)
    caption = (
        f"UCI protocol on {table.name} ({len(table.y)} rows, {table.x.shape[1]} features): {len(splits)} random 90/10 "
        f"splits, mean ± s.e. over splits; test LL per point and RMSE in the target's units; times are medians "
        f"over splits; the equal-time column is each method at the training time of {METHODS[reference] if reference else '—'}"
    )
    tables.update(write_table(summary, run_dir, "uci", caption=caption))
    log.info("UCI protocol, %s:\n%s", table.name, summary.to_markdown())
    figures = {
        "uci": _plot(
            frame,
            methods,
            reference,
            f"UCI protocol on {table.name}: {len(splits)} random 90/10 splits",
            run_dir / "uci.png",
        )
    }
    return {
        "metrics": _metrics(frame, methods, reference, len(splits)),
        "tables": tables,
        "figures": figures,
        "device": device,
    }


def _metrics(frame: pd.DataFrame, methods: List[str], reference: Optional[str], n_splits: int) -> Dict[str, float]:
    metrics: Dict[str, float] = {"uci/n_splits": n_splits}
    for method in methods:
        part = frame[frame["method"] == method]
        for column in ("test_ll", "rmse"):
            mean, se = _mean_and_standard_error(part[column])
            metrics[f"uci/{method}/{column}_mean"] = mean
            metrics[f"uci/{method}/{column}_se"] = se
        equal = part["equal_time_test_ll"].astype(float)
        metrics[f"uci/{method}/equal_time_test_ll_mean"] = float(equal.mean()) if equal.notna().all() else None
        metrics[f"uci/{method}/test_ll_sd_over_splits"] = float(part["test_ll"].std(ddof=1)) if len(part) > 1 else None
        metrics[f"uci/{method}/train_seconds_median"] = float(part["train_seconds"].median())
        metrics[f"uci/{method}/iterations_median"] = float(part["iterations"].median())
        metrics[f"uci/{method}/predict_seconds_per_1000_median"] = float(part["predict_seconds_per_1000"].median())
    for closed in [m for m in methods if m.startswith("closed_form_")]:
        for peer in [m for m in methods if not m.startswith("closed_form_")]:
            key = f"uci/compare/{closed}_vs_{peer}"
            # paired over splits: the same split's difference, so split-to-split spread cancels
            paired = (
                frame[frame["method"] == closed].set_index("split")["test_ll"]
                - frame[frame["method"] == peer].set_index("split")["test_ll"]
            ).dropna()
            mean, se = _mean_and_standard_error(paired)
            metrics[f"{key}/test_ll_difference"] = mean
            metrics[f"{key}/test_ll_difference_se"] = se
            metrics[f"{key}/train_time_ratio"] = (
                metrics[f"uci/{closed}/train_seconds_median"] / metrics[f"uci/{peer}/train_seconds_median"]
            )
            metrics[f"{key}/predict_speedup"] = (
                metrics[f"uci/{peer}/predict_seconds_per_1000_median"]
                / metrics[f"uci/{closed}/predict_seconds_per_1000_median"]
            )
    return metrics
