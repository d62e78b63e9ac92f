"""``protocol: fit`` (``data=csv`` selects it): your own table fitted, not studied.

The UCI protocol's validated recipe (``conf/train_regression/protocol/fit.yaml``: one hidden
layer of 50 ReLUs, priors N(0, 1), posterior standard deviations started at 0.1, a learned
noise: by default each row's, a second output of the network, ``likelihood=heteroscedastic``; two
or more hidden layers: :mod:`~cfbnn_cli.train.fit_settings`) on one random train/test split (``data.test_fraction``, drawn from ``data.seed`` as the
UCI protocol's split ``k`` is drawn from ``k``):

* the exact ELBO (nothing is sampled) is minimized by full-batch L-BFGS to convergence, or,
  above ``fit.full_batch_max_rows`` training rows, by minibatch Adam (batches of at most the
  rows there are) stopped by the log-likelihood of a validation split
  (:func:`~.uci_methods.fit_method`, the method ``fit.method``);
* the held-out rows give the test RMSE, the log-likelihood per row (in the target's units) and
  the coverage of the central 50 % and 90 % predictive intervals: logged, printed as
  ``fit.md`` and written to ``results.json`` (``fit/...``), with ``fit.png``: each held-out
  row's target against its predictive mean and 90 % interval;
* ``model.pt`` (:func:`~cfbnn_cli.bnn.model_file.save_model`), refit on every row first
  (``fit.refit``, as the UCI protocol's ``uci.save_model``) or the model tested.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

from ...bnn.footprint import rows_at_once
from ...bnn.model_file import FILE_NAME
from ...bnn.network import PRIORS
from ...bnn.target_units import in_target_units
from ...data.regression import RegressionData, RegressionTable, load_regression_table, validate_data_config
from ...data.tabular import held_out_split
from ...moments import validate_args
from ...report.figures import caption, new_figure, save_figure
from ...report.metric_keys import fit_key
from ...report.numbers import format_value
from ...report.tables import write_table
from ...run_values import RunValues, parse_run_values
from ...runtime.checks import require_bool, require_choice, require_int, require_positive_float, require_widths
from ...runtime.device import synchronize
from ...runtime.errors import ConfigError
from ...runtime.numerics import map_row_chunks, rows_per_chunk
from ...runtime.rundir import config_fingerprint
from ...train.fit_checks import (
    REFERENCE_SIZES,
    FitFailedError,
    failure_message,
    reference_problems,
    regression_problems,
    suggestion,
)
from ...train.fit_records import FitRecords
from ...train.fit_settings import validate_fit_settings
from .log_target import held_out_metrics
from .model_file import save_regression_model
from .uci_methods import Fitted, Split, fit_method, quiet, require_method_memory, test_metrics

log = logging.getLogger(__name__)
METHODS = ("closed_form_diagonal", "closed_form_full", "closed_form_lowrank", "deterministic_2_hidden")
LIKELIHOODS = ("normal", "heteroscedastic")
# likelihood=heteroscedastic: the method of fit.method with a second output, the log noise variance
HETEROSCEDASTIC = {"closed_form_diagonal": "heteroscedastic", "deterministic_2_hidden": "heteroscedastic_2_hidden"}


def validate(cfg: DictConfig) -> str:
    """Every check that needs no data; returns the method (with ``likelihood=heteroscedastic``, its
    heteroscedastic counterpart, :data:`HETEROSCEDASTIC`)."""
    method = require_choice(cfg, "fit.method", list(METHODS))
    validate_fit_settings(cfg)
    require_widths(cfg, "fit.deep_hidden_sizes", minimum_length=2, example="[50,50]")
    require_choice(cfg, "model.prior", list(PRIORS))
    require_bool(cfg, "fit.reference")
    require_int(cfg, "model.rank", minimum=1)
    require_int(cfg, "trainer.batch_size", minimum=1)
    require_positive_float(cfg, "trainer.lr")
    likelihood = require_choice(cfg, "likelihood", list(LIKELIHOODS))
    if likelihood == "heteroscedastic" and method not in HETEROSCEDASTIC:
        raise ConfigError(
            f"likelihood=heteroscedastic (the fit's default) with fit.method={method}: the heteroscedastic network is "
            f"mean-field (fit.method={' or '.join(HETEROSCEDASTIC)}); add likelihood=normal for {method}"
        )
    validate_data_config(cfg)
    return HETEROSCEDASTIC[method] if likelihood == "heteroscedastic" else method


def method_config(cfg: DictConfig) -> DictConfig:
    """The config :func:`~.uci_methods.fit_method` reads (``uci.*`` there), from ``fit.*``."""
    values = OmegaConf.to_container(cfg, resolve=True)
    fit = values["fit"]
    values["uci"] = {
        "full_batch_max_rows": fit["full_batch_max_rows"],
        "max_iterations": fit["max_iterations"],
        "rtol": fit["rtol"],
        "validation_fraction": fit["validation_fraction"],
        "evaluate_every": fit["evaluate_every"],
        "patience": fit["patience"],
        "deep_hidden_sizes": fit["deep_hidden_sizes"],
        # the fit's methods integrate every layer: nothing is sampled, so one draw is exact
        "predictive_samples": 1,
        "validation_samples": 1,
        "sampling_init_scale": values["model"]["init_scale"],
    }
    return OmegaConf.create(values)


def _to_device(data: RegressionData, device) -> RegressionData:
    data.x_train, data.y_train = data.x_train.to(device), data.y_train.to(device)
    data.x_test, data.y_test = data.x_test.to(device), data.y_test.to(device)
    return data


def _require_memory(cfg, method: str, table: RegressionTable, train_rows: int, test_rows: int) -> None:
    """The method's network and the rows a fit holds at once, counted before anything is allocated."""
    deep = method.endswith("_2_hidden")
    rows, optimizer = rows_at_once(
        train_rows, cfg.fit.full_batch_max_rows, cfg.trainer.batch_size, len(table.y) if cfg.fit.refit else 0
    )
    require_method_memory(
        method,
        f"fit.method={method}",
        "fit.deep_hidden_sizes" if deep else "model.hidden_sizes",
        list(cfg.fit.deep_hidden_sizes if deep else cfg.model.hidden_sizes),
        table.x.shape[1],
        rows=rows,
        optimizer=optimizer,
        prediction_rows=test_rows,
        rank=int(cfg.model.rank),
        fix="lower the widths or choose fit.method=closed_form_diagonal (or lower fit.full_batch_max_rows, to "
        "train on minibatches)",
    )


def _fit(method: str, data: RegressionData, cfg, device, seed: int, records: FitRecords, phase: str) -> Fitted:
    """``method`` fitted to ``data``'s training rows as the fit's ``phase`` (``fit`` or ``refit``): its
    progress shown, its rows in metrics.csv, its checkpoint kept (:mod:`~cfbnn_cli.train.fit_records`)."""
    with quiet("cfbnn_cli.train.loop"):
        return fit_method(method, Split(data, 0, records=records, phase=phase), cfg, device, seed=seed)


def run(cfg: DictConfig, run_dir, values: Optional[RunValues] = None) -> dict:
    run_dir = Path(run_dir)
    method = validate(cfg)
    device = (values or parse_run_values(cfg)).device
    table: RegressionTable = load_regression_table(cfg.data, transform=True)
    train, test = held_out_split(len(table.y), float(cfg.data.test_fraction), int(cfg.data.seed))
    data = _to_device(table.split(train, test), device)
    settings = method_config(cfg)
    _require_memory(cfg, method, table, len(train), len(test))
    records = FitRecords(
        run_dir, config_fingerprint(cfg, run_dir), bool(cfg.resume), OmegaConf.to_container(cfg, resolve=True)
    )
    log.info(
        "fitting %s on %s: %d training rows, %d held out, %d features (%s), hidden layers %s, device=%s",
        method,
        table.name,
        len(train),
        len(test),
        table.x.shape[1],
        ", ".join(table.columns) if table.columns else "by position",
        list(cfg.model.hidden_sizes) if not method.endswith("_2_hidden") else list(cfg.fit.deep_hidden_sizes),
        device,
    )
    with validate_args(False):
        synchronize(device)
        started = time.perf_counter()
        fitted = _fit(method, data, settings, device, int(cfg.seed) * 1000, records, "fit")
        synchronize(device)
        seconds = time.perf_counter() - started
        log_target = table.target_transform == "log"  # metrics in the target's units, not its log's
        held_out = held_out_metrics if log_target else test_metrics
        metrics_row = held_out(fitted.predict, data, settings)
        mean_rmse = _mean_rmse(data, log_target)
        # the noise against the target's spread on the scale it was fitted on (log(target)'s, for a log target)
        problems = regression_problems(
            metrics_row["rmse"], mean_rmse, fitted.noise_std * data.target_std, data.target_std
        )
        sizes = list(cfg.model.hidden_sizes) if not method.endswith("_2_hidden") else list(cfg.fit.deep_hidden_sizes)
        reference_ll = None
        if len(sizes) > 1 and cfg.fit.reference:  # a deep network: is it better than one hidden layer here?
            reference_ll = _reference_ll(method, data, settings, device, int(cfg.seed) * 1000, records, held_out)
            problems += reference_problems(metrics_row["test_ll"], reference_ll)
        figure = _plot_held_out(fitted, data, settings, table, run_dir / "fit.png")
        model, estimator, scaled = fitted.model, fitted.estimator, data
        if cfg.fit.refit and not problems:  # a failed fit is not refit: there is no model.pt to make
            every = np.arange(len(table.y))
            scaled = _to_device(table.split(every, every[:0]), device)
            log.info("fit.refit=true: refitting on all %d rows for %s", len(every), FILE_NAME)
            # the UCI protocol's uci.save_model refit draws from the same seed: one model for one table
            refit = _fit(method, scaled, settings, device, int(cfg.seed) + 10_000, records, "refit")
            model, estimator = refit.model, refit.estimator
    metrics = {
        fit_key("test_rmse"): metrics_row["rmse"],
        fit_key("mean_rmse"): mean_rmse,
        fit_key("test_ll"): metrics_row["test_ll"],
        fit_key("reference_ll"): reference_ll,
        fit_key("coverage_90"): metrics_row["coverage_90"],
        fit_key("coverage_50"): metrics_row["coverage_50"],
        fit_key("noise_sd"): fitted.noise_std * data.target_std,
        fit_key("train_rows"): len(train),
        fit_key("test_rows"): len(test),
        fit_key("validation_ll"): None,
        fit_key("train_seconds"): seconds,
        fit_key("iterations"): fitted.iterations,
        fit_key("converged"): float(fitted.converged or fitted.stopped_early),
    }
    how = (
        f"L-BFGS, {fitted.iterations} iterations, {fitted.stop}"
        if fitted.optimizer == "lbfgs"
        else f"Adam, {fitted.iterations} epochs, {'stopped by validation' if fitted.stopped_early else 'reached trainer.epochs'}"
    )
    log.info(
        "held-out: RMSE %s, log-likelihood %s per row, 90%% interval covers %.1f%% (50%%: %.1f%%); %s in %.1f s",
        format_value(metrics[fit_key("test_rmse")]),
        format_value(metrics[fit_key("test_ll")]),
        100 * metrics[fit_key("coverage_90")],
        100 * metrics[fit_key("coverage_50")],
        how,
        seconds,
    )
    frame = pd.DataFrame(
        {
            "held-out": [
                f"{len(test)} of {len(table.y)} rows",
                format_value(metrics[fit_key("test_rmse")]),
                format_value(metrics[fit_key("test_ll")]),
                f"{100 * metrics[fit_key('coverage_90')]:.1f} %",
                f"{100 * metrics[fit_key('coverage_50')]:.1f} %",
                format_value(metrics[fit_key("noise_sd")]),
                how,
                format_value(mean_rmse),
                "—" if reference_ll is None else format_value(reference_ll),
                "FAILED: " + "; ".join(problems) if problems else "learned from the features",
            ]
        },
        index=[
            "rows",
            f"RMSE ({table.target})",
            "log-likelihood per row",
            "90 % interval coverage",
            "50 % interval coverage",
            "noise s.d. (learned"
            + (", the median training row's" if method.startswith("heteroscedastic") else "")
            + (f", log({table.target}) units)" if log_target else ")"),
            "training",
            "RMSE of the training mean",
            f"log-likelihood per row of one hidden layer of {REFERENCE_SIZES[0]} (fit.reference)",
            "result",
        ],
    )
    if log_target:
        frame.loc["target"] = f"fitted on log({table.target}); metrics in {table.target}'s units (log-normal)"
    data_frame = pd.DataFrame([metric_row(metrics)])
    tables = write_table(
        frame,
        run_dir,
        "fit",
        caption=f"{method}, hidden layers {sizes}, on {table.name}: a random {100 * float(cfg.data.test_fraction):g} % of the rows held out "
        f"(seed {cfg.data.seed}); units of {table.target}",
        data=data_frame,
    )
    if problems:
        advice = suggestion(sizes, data.input_dim, 1, len(train), bool(fitted.converged or fitted.stopped_early))
        raise FitFailedError(
            failure_message(f"{method} with hidden layers {sizes} on {table.name}:", problems, advice, run_dir),
            metrics,
            tables,
        )
    save_regression_model(run_dir, model, scaled, estimator.name, method)
    return {"metrics": metrics, "tables": tables, "figures": {"fit": figure}, "device": device, "main_table": "fit.md"}


def _reference_ll(
    method: str, data: RegressionData, settings, device, seed: int, records: FitRecords, held_out=test_metrics
) -> float:
    """The held-out log-likelihood per row of ``method``'s one-hidden-layer counterpart (the default
    recipe, :data:`~cfbnn_cli.train.fit_checks.REFERENCE_SIZES`) on the same split: what a deep fit
    is measured against (``fit.reference``)."""
    one_layer = {"deterministic_2_hidden": "closed_form_diagonal", "heteroscedastic_2_hidden": "heteroscedastic"}
    values = OmegaConf.to_container(settings, resolve=True)
    values["model"]["hidden_sizes"] = list(REFERENCE_SIZES)
    reference = OmegaConf.create(values)
    log.info("fit.reference=true: one hidden layer of %d on the same rows, for comparison", REFERENCE_SIZES[0])
    fitted = _fit(one_layer.get(method, method), data, reference, device, seed, records, "reference")
    return held_out(fitted.predict, data, reference)["test_ll"]


def _mean_rmse(data: RegressionData, log_target: bool) -> float:
    """The held-out RMSE, in the target's units, of predicting the training rows' mean for every row
    (what a fit must beat); ``data`` holds the standardized target, or its log's (``log_target``)."""
    if not log_target:  # the standardized training mean is 0
        return float(data.y_test.double().square().mean().sqrt()) * data.target_std
    train = (data.y_train.double() * data.target_std + data.target_mean).exp()
    test = (data.y_test.double() * data.target_std + data.target_mean).exp()
    return float((test - train.mean()).square().mean().sqrt())


def _plot_held_out(fitted: Fitted, data: RegressionData, cfg, table: RegressionTable, path: Path) -> str:
    """Each held-out row's target against its predictive mean, with the central 90 % interval
    (the fit's methods integrate every layer: the predictive is that Normal exactly)."""
    chunk = rows_per_chunk(4 * max(list(cfg.model.hidden_sizes) + list(cfg.uci.deep_hidden_sizes)))

    def moments(x):
        prediction = fitted.model.predict(x, estimator=fitted.estimator)
        prediction = in_target_units(prediction, data.target_mean, data.target_std, table.target_transform)
        return (prediction.mean, *prediction.interval(0.9))

    with torch.no_grad():
        mean, low, high = (t.cpu().numpy() for t in map_row_chunks(moments, data.x_test, chunk))
    target = data.y_test.cpu().double().numpy() * data.target_std + data.target_mean
    target = np.exp(target) if table.target_transform == "log" else target
    inside = (target >= low) & (target <= high)
    fig, (ax,) = new_figure(1, width=3.6, height=3.4)
    ax.errorbar(
        target[inside],
        mean[inside],
        yerr=[mean[inside] - low[inside], high[inside] - mean[inside]],
        fmt="o",
        ms=2.5,
        lw=0.6,
        color="tab:blue",
        label="interval covers the target",
    )
    ax.errorbar(
        target[~inside],
        mean[~inside],
        yerr=[mean[~inside] - low[~inside], high[~inside] - mean[~inside]],
        fmt="o",
        ms=2.5,
        lw=0.6,
        color="tab:red",
        label="interval misses it",
    )
    span = [min(target.min(), low.min()), max(target.max(), high.max())]
    ax.plot(span, span, color="0.5", lw=0.6, ls="--", label="mean = target")
    ax.set_xlabel(f"held-out {table.target}")
    ax.set_ylabel("predictive mean, 90 % interval")
    ax.legend(fontsize=6, loc="upper left")
    caption(
        fig,
        f"{table.name}: {len(target)} held-out rows; the 90 % interval covers {100 * inside.mean():.0f} % "
        f"(RMSE {format_value(math.sqrt(float(np.mean((mean - target) ** 2))))})",
    )
    return save_figure(fig, path)


def metric_row(metrics: Dict[str, float]) -> Dict[str, float]:
    """The ``fit/...`` metrics without their prefix (one row of ``fit.csv``)."""
    return {key.split("/", 1)[1]: value for key, value in metrics.items() if key.startswith("fit/")}
