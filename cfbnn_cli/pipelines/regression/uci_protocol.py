"""The standard UCI regression protocol, cfbnn's closed form beside its peers.

Hernandez-Lobato & Adams (2015), as used by DVI (Wu et al. 2019): ``n_splits``
random 90/10 train/test splits (split ``k`` drawn from seed ``k``, so every run and
every method sees the same splits; the indices are written to ``splits.json``),
inputs and targets standardized by the training rows, one hidden layer, test
log-likelihood per point and RMSE in the target's original units, mean +- standard
error over splits.

Methods (``uci.methods``), all with the same splits, network size, minibatch
schedule (seeded per split) and number of optimizer steps (``trainer.epochs`` epochs of
``trainer.batch_size`` rows):

All cfbnn methods are the one network, :class:`~cfbnn_cli.bnn.network.BayesianNetwork`
(``model.hidden_sizes``, output bias on, as Pyro's ``nn.Linear`` peer has):

* ``closed_form_diagonal`` / ``closed_form_full`` / ``closed_form_lowrank`` -- the
  exact ELBO (nothing sampled with one hidden layer), the exact predictive mean and
  variance, evaluated as the moment-matched Normal ``N(mean, var_A + var_B + 1/beta)``;
* ``local_reparameterization`` -- the same diagonal family trained with the
  1-sample local-reparameterization ELBO; predictive by ``uci.predictive_samples``
  Monte Carlo draws (log-mean-exp);
* ``pyro`` -- :class:`~cfbnn_cli.bnn.pyro_glue.PyroMLPRegression` with an
  ``AutoNormal`` guide and ``Trace_ELBO`` (one particle, weight-space sampling),
  predicting with ``pyro.infer.Predictive`` and ``uci.predictive_samples`` samples;
* ``plain_mlp`` -- the same network with point-estimate layers and a learned Gaussian
  noise (maximum likelihood; the non-Bayesian reference).

Every Bayesian method starts from the same means (``randn / sqrt(fan_in)``) and the
same posterior standard deviation ``model.init_scale``, with ``N(0, prior_scale^2)``
priors and a learned observation noise. Progress is saved after every
(split, method), so ``resume=true`` re-runs only what is missing.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from ...bnn.likelihoods import NormalLikelihood
from ...bnn.network import BayesianNetwork, mixture_log_likelihood
from ...data.regression import RegressionData, RegressionTable, load_regression_table
from ...moments import ACTIVATIONS, validate_args
from ...report.figures import new_figure, save_figure
from ...report.tables import write_table
from ...runtime.checks import require_choice, require_int, require_positive_float
from ...runtime.device import resolve_device
from ...runtime.errors import CheckpointError, ConfigError, DataError
from ...runtime.io import atomic_write_json
from ...runtime.numerics import map_row_chunks, rows_per_chunk
from ...runtime.rundir import config_fingerprint, refuse_other_config
from ...train import TrainingLoop

log = logging.getLogger(__name__)

METHODS = {
    "closed_form_diagonal": "cfbnn closed form (diagonal)",
    "closed_form_full": "cfbnn closed form (full)",
    "closed_form_lowrank": "cfbnn closed form (low-rank)",
    "local_reparameterization": "cfbnn local reparam. (1 sample)",
    "pyro": "Pyro AutoNormal + Trace_ELBO",
    "plain_mlp": "plain MLP (ML, learned noise)",
}
MIN_ROWS = 10  # a 90/10 split needs at least one test point and a handful of training rows


# ----------------------------------------------------------------------------- config and splits


def validate(cfg: DictConfig) -> List[str]:
    """Every check that needs no data; returns the methods. Runs before any work."""
    require_int(cfg, "uci.n_splits", minimum=1)
    require_int(cfg, "uci.predictive_samples", minimum=1)
    require_int(cfg, "model.rank", minimum=1)
    require_positive_float(cfg, "model.init_scale")
    require_positive_float(cfg, "model.prior_scale")
    require_choice(cfg, "model.activation", sorted(ACTIVATIONS))
    sizes = OmegaConf.select(cfg, "model.hidden_sizes")
    if not sizes or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in sizes):
        raise ConfigError(f"model.hidden_sizes={sizes} must be a non-empty list of positive widths, e.g. [50]")
    fraction = OmegaConf.select(cfg, "data.test_fraction")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ConfigError(f"data.test_fraction={fraction!r} must be a number strictly between 0 and 1 (the protocol uses 0.1)")
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
    if len(sizes) > 1 and "pyro" in methods:
        raise ConfigError(f"uci.methods includes pyro, whose peer network has one hidden layer; model.hidden_sizes={sizes}")
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


def minibatch_schedule(num_train: int, batch_size: int, steps: int, seed: int) -> torch.Tensor:
    """``(steps, batch_size)`` row indices: consecutive epochs of fresh permutations."""
    generator = torch.Generator().manual_seed(seed)
    per_epoch = num_train // batch_size
    epochs = math.ceil(steps / per_epoch)
    rows = [torch.randperm(num_train, generator=generator)[: per_epoch * batch_size].view(per_epoch, batch_size) for _ in range(epochs)]
    return torch.cat(rows)[:steps]


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

    The predictive density is the equal mixture of ``N(mean_s, var_s)``.
    """

    predict: Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]
    noise_std: float  # the learned observation noise, standardized units


def _train(model, parameters, loss, data, schedule, cfg, device, bar, label) -> None:
    """Adam on the split's fixed minibatch schedule: the one training loop, in steps."""
    optimizer = torch.optim.Adam(parameters, lr=cfg.trainer.lr)
    TrainingLoop(model, optimizer, loss, data.num_train, cfg.trainer.batch_size, device, schedule=schedule,
                 label=label, progress=bar).run()


def _network(data, cfg, generator, covariance="diagonal", point_layers: int = 0) -> BayesianNetwork:
    """The network every cfbnn method of the protocol uses (``model.*``), with a learned noise."""
    sizes = list(cfg.model.hidden_sizes)
    if isinstance(covariance, str):
        # the output layer's covariance is diagonal or full; low rank applies to the hidden layers
        covariance = [covariance] * len(sizes) + ["full" if covariance == "full" else "diagonal"]
    return BayesianNetwork(
        data.input_dim, sizes, 1, cfg.model.activation, covariance[point_layers:], cfg.model.rank, cfg.model.prior_scale,
        cfg.model.init_scale, NormalLikelihood(cfg.model.precision, cfg.model.learn_precision), point_layers=point_layers,
        generator=generator,
    )


def _fit_closed_form(covariance, data, schedule, cfg, device, bar, generator):
    model = _network(data, cfg, generator, covariance).to(device)
    num_data = data.num_train
    x, y = data.x_train, data.y_train

    def loss(rows):
        return -model.elbo(x[rows], y[rows], num_data, "analytic")

    _train(model, model.parameters(), loss, data, schedule, cfg, device, bar, f"closed_form_{covariance}")
    sampler = torch.Generator(device=device).manual_seed(int(generator.initial_seed()) + 1)

    @torch.no_grad()
    def predict(x):
        means, variances = model.predict_mixture(x, cfg.uci.predictive_samples, sampler)
        return means, variances + 1.0 / model.precision

    return Fitted(predict, float(model.precision.detach()) ** -0.5)


def _fit_local_reparameterization(data, schedule, cfg, device, bar, generator):
    model = _network(data, cfg, generator).to(device)
    sampler = torch.Generator(device=device).manual_seed(int(generator.initial_seed()) + 1)
    num_data = data.num_train
    x, y = data.x_train, data.y_train

    def loss(rows):
        return -model.elbo(x[rows], y[rows], num_data, "sampling", generator=sampler)

    _train(model, model.parameters(), loss, data, schedule, cfg, device, bar, "local_reparameterization")

    @torch.no_grad()
    def predict(x):
        outputs = model.sample_outputs(x, cfg.uci.predictive_samples, sampler)
        return outputs, torch.full_like(outputs, 1.0 / float(model.precision))

    return Fitted(predict, float(model.precision.detach()) ** -0.5)


def _starting_means(data, cfg, generator) -> Dict[str, torch.Tensor]:
    """cfbnn's starting means (a fresh network from the same seed) as ``nn.Linear`` weights
    and biases ``fc1``/``fc2``: every method of a split starts from the same point."""
    network = _network(data, cfg, generator)
    hidden, output = network.layers
    return {"fc1.weight": hidden.loc[:, :-1].detach(), "fc1.bias": hidden.loc[:, -1].detach(),
            "fc2.weight": output.loc[:, :-1].detach(), "fc2.bias": output.loc[:, -1].detach()}


def _fit_pyro(data, schedule, cfg, device, bar, generator):
    import pyro
    from pyro.infer import Predictive, Trace_ELBO
    from pyro.infer.autoguide import AutoNormal
    from pyro.infer.autoguide.initialization import init_to_value

    from ...bnn.pyro_glue import PyroMLPRegression

    pyro.clear_param_store()
    pyro.set_rng_seed(int(generator.initial_seed()))
    D, H = data.input_dim, cfg.model.hidden_sizes[0]
    model = PyroMLPRegression(D, H, cfg.model.activation, cfg.model.prior_scale, device=device)
    # the same starting means as cfbnn's (randn / sqrt(fan_in)), not Pyro's all-zero default
    start = _starting_means(data, cfg, generator)
    guide = AutoNormal(model, init_loc_fn=init_to_value(values={k: v.to(device) for k, v in start.items()}),
                       init_scale=cfg.model.init_scale)
    elbo = Trace_ELBO()
    num_data = data.num_train
    x, y = data.x_train, data.y_train
    elbo.differentiable_loss(model, guide, x[:2], y[:2], num_data)  # creates the guide's and the noise's parameters
    parameters = list({id(p): p for p in [*guide.parameters(), *model.parameters()]}.values())
    _train(guide, parameters, lambda rows: elbo.differentiable_loss(model, guide, x[rows], y[rows], num_data),
           data, schedule, cfg, device, bar, "pyro")
    predictive = Predictive(model, guide=guide, num_samples=cfg.uci.predictive_samples, return_sites=("_RETURN",))

    @torch.no_grad()
    def predict(x):
        outputs = predictive(x)["_RETURN"]
        return outputs, torch.full_like(outputs, float(model.noise_scale.detach()) ** 2)

    return Fitted(predict, float(model.noise_scale.detach()))


def _fit_plain_mlp(data, schedule, cfg, device, bar, generator):
    start = _starting_means(data, cfg, generator)
    model = _network(data, cfg, None, point_layers=len(cfg.model.hidden_sizes) + 1)
    with torch.no_grad():  # the same starting means as the Bayesian methods
        for index, name in enumerate(("fc1", "fc2")):
            model.layers[index].weight.copy_(start[f"{name}.weight"])
            model.layers[index].bias.copy_(start[f"{name}.bias"])
    model = model.to(device)
    x, y = data.x_train, data.y_train

    def loss(rows):  # maximum likelihood with a learned noise: the mean negative log-likelihood
        return -model.expected_log_likelihood(x[rows], y[rows]) / rows.numel()

    _train(model, model.parameters(), loss, data, schedule, cfg, device, bar, "plain_mlp")

    @torch.no_grad()
    def predict(x):
        mean = model.output_mean(x).unsqueeze(0)
        return mean, torch.full_like(mean, 1.0 / float(model.precision))

    return Fitted(predict, float(model.precision.detach()) ** -0.5)


def fit_method(method: str, data: RegressionData, schedule, cfg, device, bar, seed: int) -> Fitted:
    generator = torch.Generator().manual_seed(seed)
    if method.startswith("closed_form_"):
        return _fit_closed_form(method[len("closed_form_"):], data, schedule, cfg, device, bar, generator)
    fit = {"local_reparameterization": _fit_local_reparameterization, "pyro": _fit_pyro, "plain_mlp": _fit_plain_mlp}[method]
    return fit(data, schedule, cfg, device, bar, generator)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_progress(path: Path, fingerprint: str, n_splits: int, methods: List[str]) -> List[dict]:
    """The finished (split, method) records of ``uci_progress.json``, if this configuration wrote them."""
    try:
        progress = json.loads(path.read_text())
        records = progress["records"]
        if not isinstance(records, list) or not all(
            isinstance(r, dict) and isinstance(r.get("split"), int) and r.get("method") in METHODS
            and isinstance(r.get("test_ll"), (int, float)) for r in records
        ):
            raise ValueError("its records are not (split, method, test_ll, ...) entries")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"cannot read {path} ({type(error).__name__}: {str(error)[:200]}); delete it to re-run every split, "
            "or start a fresh run dir"
        ) from None
    refuse_other_config(str(path), progress.get("config_fingerprint"), fingerprint)
    return [r for r in records if r["split"] < n_splits and r["method"] in methods]


def _predict(fitted: Fitted, x: torch.Tensor, samples: int, hidden: int):
    """``fitted.predict`` over row chunks: peak memory bounded whatever the test-set size."""
    return map_row_chunks(fitted.predict, x, rows_per_chunk(samples * hidden))


def evaluate(fitted: Fitted, data: RegressionData, device, samples: int = 1, hidden: int = 1) -> Dict[str, float]:
    """Test LL and RMSE (original units) and the prediction time per 1,000 points."""
    means, variances = _predict(fitted, data.x_test, samples, hidden)
    log_likelihood = mixture_log_likelihood(data.y_test, means, variances)
    squared_error = (means.mean(0) - data.y_test).square()
    test_ll, rmse = original_units(log_likelihood, squared_error, data.target_std)
    repeats = math.ceil(1000 / data.x_test.shape[0])
    thousand = data.x_test.repeat(repeats, 1)[:1000]
    fitted.predict(thousand[:10])  # warm-up
    _sync(device)
    started = time.perf_counter()
    fitted.predict(thousand)
    _sync(device)
    return {
        "test_ll": test_ll,
        "rmse": rmse,
        "predict_seconds_per_1000": time.perf_counter() - started,
        "noise_std": fitted.noise_std * data.target_std,
    }


# ----------------------------------------------------------------------------- outputs


def _mean_and_standard_error(values: pd.Series) -> Tuple[float, float]:
    values = values.astype(float)
    se = float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else None  # one split: no s.e.
    return float(values.mean()), se


def _pm(mean: float, se: Optional[float], digits: int = 3) -> str:
    return f"{mean:.{digits}f} ± {se:.{digits}f}" if se is not None else f"{mean:.{digits}f}"


def summary_table(records: pd.DataFrame, methods: List[str]) -> pd.DataFrame:
    rows = []
    for method in methods:
        part = records[records["method"] == method]
        ll, ll_se = _mean_and_standard_error(part["test_ll"])
        rmse, rmse_se = _mean_and_standard_error(part["rmse"])
        rows.append({
            "Method": METHODS[method],
            "Test LL": _pm(ll, ll_se),
            "RMSE": _pm(rmse, rmse_se),
            "LL s.d. over splits": f"{part['test_ll'].std(ddof=1):.3f}" if len(part) > 1 else "",
            "Train s / split": f"{part['train_seconds'].mean():.2f}",
            "Predict ms / 1000 pts": f"{1e3 * part['predict_seconds_per_1000'].mean():.2f}",
        })
    return pd.DataFrame(rows).set_index("Method")


def _plot(records: pd.DataFrame, methods: List[str], path: Path) -> str:
    fig, axes = new_figure(2, width=6.5, height=2.4)
    for offset, method in enumerate(methods):
        part = records[records["method"] == method].sort_values("split")
        shift = (offset - (len(methods) - 1) / 2) * 0.08  # keep overlapping markers apart
        axes[0].plot(part["split"] + shift, part["test_ll"], "o", ms=3, label=METHODS[method])
        axes[1].plot(part["split"] + shift, part["rmse"], "o", ms=3)
    axes[0].set_ylabel("test log-likelihood / point")
    axes[1].set_ylabel("test RMSE")
    for ax in axes:
        ax.set_xlabel("split")
    axes[0].legend(loc="best", fontsize=6)
    return save_figure(fig, path)


def run(cfg: DictConfig, run_dir) -> dict:
    run_dir = Path(run_dir)
    methods = validate(cfg)
    device = resolve_device(cfg.device)
    table: RegressionTable = load_regression_table(cfg.data)
    splits = make_splits(len(table.y), cfg.uci.n_splits, cfg.data.test_fraction)
    n_train = len(splits[0][0])
    batch_size = cfg.trainer.batch_size
    if batch_size > n_train:
        raise ConfigError(f"trainer.batch_size={batch_size} exceeds the {n_train} training rows of a split; lower it")
    steps = cfg.trainer.epochs * (n_train // batch_size)  # the same budget for every method and split
    if steps < 1:
        raise ConfigError(f"trainer.epochs={cfg.trainer.epochs} gives no training step; set it >= 1")
    atomic_write_json(run_dir / "splits.json", {
        "data": table.name, "rows": len(table.y), "test_fraction": cfg.data.test_fraction,
        "seeds": list(range(len(splits))),
        "splits": [{"seed": k, "train": train.tolist(), "test": test.tolist()} for k, (train, test) in enumerate(splits)],
    })
    progress_path = run_dir / "uci_progress.json"
    fingerprint = config_fingerprint(cfg, run_dir)
    records: List[dict] = []
    if cfg.resume and progress_path.exists():
        records = read_progress(progress_path, fingerprint, len(splits), methods)
        log.info("resuming: %d of %d (split, method) runs already done", len(records), len(splits) * len(methods))
    done = {(r["split"], r["method"]) for r in records}
    log.info(
        "UCI protocol on %s (%d rows, %d features): %d splits, %s, hidden layers %s, %d steps of %d, device=%s",
        table.name, len(table.y), table.x.shape[1], len(splits), ", ".join(methods), list(cfg.model.hidden_sizes),
        steps, batch_size, device,
    )
    with validate_args(False), tqdm(total=(len(splits) * len(methods) - len(done)) * steps, desc="uci", leave=False) as bar:
        for k, (train, test) in enumerate(splits):
            data = table.split(train, test)
            data.x_train, data.y_train = data.x_train.to(device), data.y_train.to(device)
            data.x_test, data.y_test = data.x_test.to(device), data.y_test.to(device)
            schedule = minibatch_schedule(data.num_train, batch_size, steps, seed=k).to(device)
            for method in methods:
                if (k, method) in done:
                    continue
                bar.set_description(f"split {k} {method}")
                _sync(device)
                started = time.perf_counter()
                fitted = fit_method(method, data, schedule, cfg, device, bar, seed=cfg.seed * 1000 + k)
                _sync(device)
                record = {"split": k, "method": method, "train_seconds": time.perf_counter() - started, "steps": steps}
                record.update(evaluate(fitted, data, device, cfg.uci.predictive_samples, max(cfg.model.hidden_sizes)))
                records.append(record)
                atomic_write_json(progress_path, {"config_fingerprint": fingerprint, "records": records})
                log.info(
                    "split %d %-26s test LL %8.4f  RMSE %8.4f  train %.2fs  predict %.2f ms/1000",
                    k, method, record["test_ll"], record["rmse"], record["train_seconds"], 1e3 * record["predict_seconds_per_1000"],
                )
    frame = pd.DataFrame(records).sort_values(["split", "method"])
    tables = write_table(frame.set_index(["split", "method"]), run_dir, "uci_splits")
    summary = summary_table(frame, methods)
    tables.update(write_table(summary, run_dir, "uci", caption=f"UCI protocol on {table.name}: {len(splits)} splits, mean ± s.e."))
    log.info("UCI protocol, %s:\n%s", table.name, summary.to_markdown())
    figures = {"uci": _plot(frame, methods, run_dir / "uci.png")}
    metrics: Dict[str, float] = {"uci/n_splits": len(splits), "uci/steps": steps}
    for method in methods:
        part = frame[frame["method"] == method]
        for column in ("test_ll", "rmse"):
            mean, se = _mean_and_standard_error(part[column])
            metrics[f"uci/{method}/{column}_mean"] = mean
            metrics[f"uci/{method}/{column}_se"] = se
        metrics[f"uci/{method}/test_ll_sd_over_splits"] = float(part["test_ll"].std(ddof=1)) if len(part) > 1 else None
        metrics[f"uci/{method}/train_seconds_per_split"] = float(part["train_seconds"].mean())
        metrics[f"uci/{method}/predict_seconds_per_1000"] = float(part["predict_seconds_per_1000"].mean())
    for closed in [m for m in methods if m.startswith("closed_form_")]:
        for peer in [m for m in methods if not m.startswith("closed_form_")]:
            key = f"uci/compare/{closed}_vs_{peer}"
            metrics[f"{key}/test_ll_difference"] = metrics[f"uci/{closed}/test_ll_mean"] - metrics[f"uci/{peer}/test_ll_mean"]
            metrics[f"{key}/train_time_ratio"] = metrics[f"uci/{closed}/train_seconds_per_split"] / metrics[f"uci/{peer}/train_seconds_per_split"]
            metrics[f"{key}/predict_speedup"] = metrics[f"uci/{peer}/predict_seconds_per_1000"] / metrics[f"uci/{closed}/predict_seconds_per_1000"]
    return {"metrics": metrics, "tables": tables, "figures": figures, "device": device}
