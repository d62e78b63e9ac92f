"""The UCI protocol's methods: how each is fitted on one split (the closed forms by L-BFGS
to convergence, or minibatch Adam with validation stopping like the sampling peers: local
reparameterization, Pyro's ``AutoNormal`` and its local-reparameterization model, a plain MLP)
and its test metrics in the target's units. :data:`METHODS` is the registry ``uci.methods`` names
(:data:`NAMES`: each one's names in the table and short)."""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ...bnn.calibration import NOMINAL_LEVELS, coverage_curve, mixture_cdf
from ...bnn.estimators import ClosedForm, Estimator
from ...bnn.footprint import require_fit_memory
from ...bnn.likelihoods import HeteroscedasticNormalLikelihood, NormalLikelihood
from ...bnn.network import BayesianNetwork
from ...bnn.predictive import mixture_log_likelihood, mixture_mean
from ...data.regression import RegressionData
from ...runtime.numerics import map_row_chunks, rows_per_chunk
from ...train import TrainingLoop, optimizers
from ...train.fit_records import FitProgress, FitRecords, epoch_note, run_adam_phase, run_lbfgs_phase
from ...train.fit_settings import fit_estimator, input_scale, prior_scale, scale_first_layer
from ...train.full_batch import FullBatchMinimizer, minimize_with_polish
from ...train.graphs import BatchLoss

log = logging.getLogger(__name__)


class Names(NamedTuple):
    """A method's names: in the summary table, and short (the figures' labels, the paired column)."""

    table: str
    short: str


NAMES = {
    "closed_form_diagonal": Names("cfbnn closed form (diagonal)", "closed form (diag.)"),
    "closed_form_full": Names("cfbnn closed form (full)", "closed form (full)"),
    "closed_form_lowrank": Names("cfbnn closed form (low-rank)", "closed form (low-rank)"),
    "local_reparameterization": Names("cfbnn local reparam. (1 sample)", "cfbnn local reparam."),
    "pyro": Names("Pyro AutoNormal + Trace_ELBO", "Pyro AutoNormal"),
    "pyro_local_reparameterization": Names("Pyro local reparam. (TraceMeanField_ELBO)", "Pyro local reparam."),
    "plain_mlp": Names("plain MLP (ML, learned noise)", "plain MLP"),
    "deterministic_2_hidden": Names("cfbnn deterministic, 2 hidden layers", "deterministic, 2 hidden"),
    "heteroscedastic": Names("cfbnn closed form, heteroscedastic", "heteroscedastic"),
    "heteroscedastic_2_hidden": Names("cfbnn deterministic, heteroscedastic, 2 hidden", "heteroscedastic, 2 hidden"),
}
METHODS = {method: names.table for method, names in NAMES.items()}
SHORT_NAMES = {method: names.short for method, names in NAMES.items()}
# beyond the paper (moment propagation and an input-dependent noise): (likelihood, deep) per method;
# they train like the closed forms (full-batch L-BFGS on their deterministic ELBO)
DETERMINISTIC_METHODS = {
    "deterministic_2_hidden": ("normal", True),
    "heteroscedastic": ("heteroscedastic", False),
    "heteroscedastic_2_hidden": ("heteroscedastic", True),
}


def require_method_memory(
    method: str, label: str, setting: str, sizes: Sequence[int], input_dim: int, *, rows: int, optimizer: str, **counts
) -> None:
    """``method``'s network (hidden ``sizes``, read from the config key ``setting``; the message names
    it as ``label``) and ``rows`` at
    once, counted before anything is allocated (:func:`~cfbnn_cli.bnn.footprint.require_fit_memory`,
    which takes ``prediction_rows``, ``rank`` and ``fix``): a closed form's covariance in every
    Gaussian layer (the output layer's diagonal unless full), the heteroscedastic methods' second
    output (the log noise variance)."""
    likelihood, _ = DETERMINISTIC_METHODS.get(method, ("normal", False))
    kind = method.removeprefix("closed_form_") if method.startswith("closed_form_") else "diagonal"
    require_fit_memory(
        f"{setting}={list(sizes)} ({label})",
        input_dim,
        sizes,
        2 if likelihood == "heteroscedastic" else 1,
        rows=rows,
        optimizer=optimizer,
        covariance=[kind] * len(sizes) + ["full" if kind == "full" else "diagonal"],
        **counts,
    )


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
    stop: str = ""  # how L-BFGS stopped, in words (FullBatchResult.describe)
    equal_time: Optional[Dict[str, float]] = None
    model: Optional[BayesianNetwork] = None  # the trained cfbnn network (the closed forms), to save
    estimator: Estimator = field(default_factory=ClosedForm)  # how `model` predicts


@dataclass
class Split:
    """One split's data and what every method of it shares."""

    data: RegressionData
    index: int
    equal_time_seconds: Optional[float] = None  # the default closed form's training time on this split
    progress: Optional[object] = None  # the protocol's bar (one tick per fit): steps show as its postfix
    warm_up: bool = False  # the untimed warm-up fit before the first split, not a result
    # an own-data fit: its progress lines, metrics.csv and checkpoints (train/fit_records.py), as `phase`
    records: Optional[FitRecords] = None
    phase: str = "fit"


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
        prior_scale(cfg, sizes),
        cfg.model.init_scale if init_scale is None else init_scale,
        likelihood,
        point_layers=point_layers,
        generator=generator,
    )


@torch.no_grad()
def heteroscedastic_noise_std(model: BayesianNetwork, x: torch.Tensor, estimator) -> float:
    """A heteroscedastic network's noise s.d. on the rows ``x``, in one number: the median row's
    ``sqrt(exp(l))``, ``l`` the log noise variance output's mean. The median, not the root mean
    square: a few rows far out in the inputs can get a noise many orders above the rest (on
    diamonds, 8 epochs of Adam: a root mean square of 9.4e5 beside a held-out RMSE of 755), and a
    good fit then read as one whose noise is the target's whole spread."""
    mean, _ = model.output_moments(x, estimator=estimator, noise=())
    return float(mean[..., 1].median().mul(0.5).exp())


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
    loss_on_batch,
    predict,
    validation_predict,
    split: Split,
    cfg,
    device,
    noise_std: Callable[[], float],
    generators: Sequence[torch.Generator] = (),
    loss_per_row: bool = False,
) -> Fitted:
    """Adam on minibatches of the training rows less a validation part (``loss_on_batch(x, y,
    count)``: a minibatch's loss, ``count`` the number of fit rows; the loss of every fit row, as an
    ELBO's, unless ``loss_per_row``); the best validation log-likelihood kept, stop
    ``uci.patience`` epochs after it (``trainer.epochs`` caps it). The epochs' records (progress
    lines, ``metrics.csv``) hold the training objective per row and the validation log-likelihood
    per row in the target's units, as ``fit.md`` reports the held-out one.
    Leaves ``module`` at its best epoch; ``equal_time`` holds the test metrics of its
    parameters at ``split.equal_time_seconds`` of training, if it trained that long."""
    data = split.data
    fit_rows, validation_rows = _validation_split(data.num_train, cfg.uci.validation_fraction, 10_000 + split.index)
    fit_rows, validation_rows = fit_rows.to(device), validation_rows.to(device)
    x_validation, y_validation = data.x_train[validation_rows], data.y_train[validation_rows]
    # the validation LL in the target's units (a constant shift of the standardized one: the best
    # epoch is the same); a log target's density is that of y, not of log y (the Jacobian, -log y)
    units = -math.log(data.target_std)
    if cfg.data.get("target_transform", "none") == "log":
        units -= float((y_validation.double() * data.target_std + data.target_mean).mean())
    batch_size = min(cfg.trainer.batch_size, len(fit_rows))
    records = split.records
    progress = (
        _StepCount(split.progress)
        if records is None
        else FitProgress(
            split.phase,
            cfg.trainer.epochs * math.ceil(len(fit_rows) / batch_size),
            "step",
            f"Adam, {len(fit_rows)} rows in batches of {batch_size}, step {{count}} of at most {{total}}",
        )
    )
    loop = TrainingLoop(
        module,
        optimizers.adam(parameters, lr=cfg.trainer.lr),
        # the fit rows' inputs and targets, a minibatch gathered from them (outside a CUDA graph)
        BatchLoss((data.x_train[fit_rows], data.y_train[fit_rows]), lambda x, y: loss_on_batch(x, y, len(fit_rows))),
        len(fit_rows),
        batch_size,
        device,
        epochs=cfg.trainer.epochs,
        data_generator=torch.Generator().manual_seed(split.index),
        label=name if records is None else split.phase,
        evaluate=lambda epoch: {
            "validation_ll": _predictive_log_likelihood(validation_predict, x_validation, y_validation) + units
        },
        objective_scale=1.0 if loss_per_row else 1.0 / len(fit_rows),
        after_epoch=None if records is None else lambda epoch, row: progress.note(epoch_note(loop, epoch)),
        select=("validation_ll", "max"),
        patience=cfg.uci.patience,
        evaluate_every=cfg.uci.evaluate_every,
        snapshot_after_seconds=split.equal_time_seconds,
        progress=progress,
        generators={f"sampler{i}": g for i, g in enumerate(generators)},
        cuda_graphs=cfg.trainer.cuda_graphs,
        **({} if records is None else records.loop_options(split.phase)),
    )
    try:
        with quiet("cfbnn_cli.train.loop"):
            history, stopped_early = run_adam_phase(loop, records)
    finally:
        if records is not None:
            progress.close()
    equal_time = None
    if loop.snapshot is not None:
        final = copy.deepcopy(module.state_dict())
        module.load_state_dict(loop.snapshot)
        equal_time = test_metrics(predict, data, cfg)
        module.load_state_dict(final)
    loop.load_best()
    return Fitted(predict, noise_std(), "adam", len(history), stopped_early=stopped_early, equal_time=equal_time)


class _StepCount:
    """Stands in for the loop's per-epoch bars: counts steps on the protocol's bar postfix."""

    def __init__(self, bar):
        self.bar, self.steps = bar, 0

    def update(self, steps: int) -> None:
        before, self.steps = self.steps, self.steps + steps
        if self.bar is not None and before // 200 != self.steps // 200:
            self.bar.set_postfix_str(f"{self.steps} steps", refresh=False)


@contextlib.contextmanager
def quiet(logger_name: str, level: int = logging.WARNING):
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
    sizes = list(cfg.uci.deep_hidden_sizes) if deep else list(cfg.model.hidden_sizes)
    # two or more hidden layers: moments propagated (L-BFGS needs an objective with nothing sampled)
    estimator = fit_estimator(sizes)
    model = _network(data, cfg, generator, covariance, sizes=sizes, heteroscedastic=likelihood == "heteroscedastic").to(
        device
    )
    # while it trains, the inputs are multiplied by `scale` and the first layer's weights divided by it
    # (its prior, in the inputs' units, then the one-layer recipe's: fit_settings.input_scale); the
    # factor goes into the weights when training ends, and `inputs[0]` back to 1
    scale = input_scale(cfg, sizes)
    inputs = [scale]
    if scale != 1.0:
        scale_first_layer(model, 1.0 / scale)  # the usual starting point, in the inputs' units
    sampler = torch.Generator(device=device).manual_seed(int(generator.initial_seed()) + 1)

    @torch.no_grad()
    def predict(x):  # exact when nothing is sampled (one hidden layer, or the deterministic methods)
        return model.predictive_components(
            x * inputs[0], estimator=estimator, num_samples=cfg.uci.predictive_samples, generator=sampler
        )

    def noise_std():  # the learned noise, or for a heteroscedastic net the median training row's
        if likelihood == "normal":
            return float(model.precision.detach()) ** -0.5
        return heteroscedastic_noise_std(model, data.x_train * inputs[0], estimator)

    def trained():  # the input scale into the first layer: the model takes the standardized inputs
        if inputs[0] != 1.0:
            scale_first_layer(model, inputs[0])
            inputs[0] = 1.0

    if data.num_train > cfg.uci.full_batch_max_rows:  # too many rows for one batch: minibatch Adam like the peers
        fitted = _fit_by_validation(
            name,
            model,
            model.parameters(),
            lambda x, y, count: -model.elbo(x * inputs[0], y, num_data=count, estimator=estimator),
            predict,
            predict,
            Split(data, split.index, records=split.records, phase=split.phase),
            cfg,
            device,
            noise_std,
        )
        trained()
        fitted.noise_std = noise_std()
        fitted.model, fitted.estimator = model, estimator
        return fitted
    num_data = data.num_train

    def objective_in(dtype):  # the negative ELBO per point, the rows in `dtype` (float64: the polish)
        x, y = data.x_train.to(dtype) * scale, data.y_train.to(dtype)
        return lambda: -model.elbo(x, y, num_data=num_data, estimator=estimator) / num_data

    def minimize(phase: str, label: str):
        def run_stage(minimizer, stage):
            return _minimize(minimizer, model, split, f"{phase}_{stage}" if stage else phase)

        return minimize_with_polish(
            objective_in, model, run_stage, max_iterations=cfg.uci.max_iterations, rtol=cfg.uci.rtol, label=label
        )

    result = minimize(split.phase, f"{name} ELBO")
    iterations, converged, stop = result.iterations, result.converged, result.describe()
    if cfg.model.prior == "empirical_bayes":  # learned prior variances, from the fixed-prior optimum
        model.prior = "empirical_bayes"
        result = minimize(f"{split.phase}_empirical_bayes", f"{name} ELBO (empirical Bayes prior)")
        iterations, converged = iterations + result.iterations, converged and result.converged
        stop = f"{stop}; then, prior learned: {result.describe()}"
    trained()
    return Fitted(predict, noise_std(), "lbfgs", iterations, converged, model=model, estimator=estimator, stop=stop)


def _minimize(minimizer: FullBatchMinimizer, model, split: Split, phase: str):
    """``minimizer.run()``: counted on the protocol's bar, or, in an own-data fit, with its progress
    lines, metrics.csv rows and checkpoint (:func:`~cfbnn_cli.train.fit_records.run_lbfgs_phase`)."""
    if split.records is None:
        return minimizer.run(_StepCount(split.progress))
    what = "L-BFGS iteration {count} of at most {total}"
    with FitProgress(phase, minimizer.max_iterations, "it", what) as progress:
        return run_lbfgs_phase(minimizer, model, split.records, phase, progress)


def _fit_local_reparameterization(split: Split, cfg, device, generator):
    data = split.data
    model = _network(data, cfg, generator, init_scale=cfg.uci.sampling_init_scale).to(device)
    sampler = torch.Generator(device=device).manual_seed(int(generator.initial_seed()) + 1)

    def predictor(samples):
        @torch.no_grad()
        def predict(x):
            outputs = model.sample_outputs(x, samples, generator=sampler)
            return outputs, torch.full_like(outputs, 1.0 / float(model.precision))

        return predict

    return _fit_by_validation(
        "local_reparameterization",
        model,
        model.parameters(),
        lambda x, y, count: -model.elbo(x, y, num_data=count, estimator="sampling", generator=sampler),
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
    from pyro.infer import Trace_ELBO
    from pyro.infer.autoguide import AutoNormal
    from pyro.infer.autoguide.initialization import init_to_value

    from ...bnn.pyro_glue import PyroMLPRegression

    data = split.data
    pyro.clear_param_store()
    pyro.set_rng_seed(int(generator.initial_seed()))
    D, H = data.input_dim, cfg.model.hidden_sizes[0]
    model = PyroMLPRegression(D, H, cfg.model.activation, prior_scale(cfg, [H]), device=device)
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
    return _fit_svi("pyro", both, model, guide, elbo, lambda: model.noise_scale, split, cfg, device)


def _fit_pyro_local_reparameterization(split: Split, cfg, device, generator):
    import pyro
    from pyro.infer import TraceMeanField_ELBO

    from ...bnn.pyro_glue import PyroLocalReparameterizationRegression

    data = split.data
    pyro.clear_param_store()
    pyro.set_rng_seed(int(generator.initial_seed()))
    model = PyroLocalReparameterizationRegression(
        data.input_dim,
        cfg.model.hidden_sizes[0],
        cfg.model.activation,
        prior_scale(cfg, cfg.model.hidden_sizes),
        cfg.uci.sampling_init_scale,
        start=_starting_means(data, cfg, generator),
        device=device,
    )
    elbo = TraceMeanField_ELBO()  # the weights' KL analytically; the likelihood by local reparameterization
    return _fit_svi(
        "pyro_local_reparameterization",
        model,
        model.model,
        model.guide,
        elbo,
        lambda: model.noise_scale,
        split,
        cfg,
        device,
    )


def _fit_svi(name, module, model, guide, elbo, noise_scale, split: Split, cfg, device):
    """A Pyro model/guide trained on ``elbo`` by :func:`_fit_by_validation` (``module`` holds every
    parameter), predicting through Pyro's ``Predictive`` with the learned noise ``noise_scale()``."""
    from pyro.infer import Predictive

    def predictor(samples):
        @torch.no_grad()
        def predict(x):
            outputs = Predictive(model, guide=guide, num_samples=samples, return_sites=("_RETURN",))(x)["_RETURN"]
            return outputs, torch.full_like(outputs, float(noise_scale().detach()) ** 2)

        return predict

    return _fit_by_validation(
        name,
        module,
        list(module.parameters()),
        lambda x, y, count: elbo.differentiable_loss(model, guide, x, y, count),
        predictor(cfg.uci.predictive_samples),
        predictor(cfg.uci.validation_samples),
        split,
        cfg,
        device,
        lambda: float(noise_scale().detach()),
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

    def loss(x, y, count):  # maximum likelihood with a learned noise: the mean negative log-likelihood
        return -model.expected_log_likelihood(x, y) / x.shape[0]

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
        loss_per_row=True,
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
    pit = mixture_cdf(data.y_test, *mixture)  # calibration: the share of targets in each central interval
    coverage = {f"coverage_{round(100 * level)}": share for level, share in coverage_curve(pit, NOMINAL_LEVELS)}
    return {"test_ll": test_ll, "rmse": rmse, **coverage}
