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

import json
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf

from ...bnn.calibration import NOMINAL_LEVELS
from ...bnn.network import PRIORS
from ...data.regression import RegressionData, RegressionTable, load_regression_table, validate_data_config
from ...moments import ACTIVATIONS, validate_args
from ...report.metric_keys import uci_key
from ...report.tables import write_table
from ...run_values import RunValues, parse_run_values
from ...runtime.checkpoints import note_saved
from ...runtime.checks import require_choice, require_fraction, require_int, require_positive_float, require_widths
from ...runtime.device import synchronize
from ...runtime.errors import CheckpointError, ConfigError, DataError
from ...runtime.io import atomic_write_json
from ...runtime.progress import progress_bar
from ...runtime.rundir import config_fingerprint, refuse_other_config
from ...train.fit_settings import require_prior_scale
from .model_file import save_regression_model
from .uci_methods import (
    DETERMINISTIC_METHODS,
    METHODS,
    Fitted,
    Split,
    fit_method,
    quiet,
    require_method_memory,
    test_metrics,
)
from .uci_report import mean_and_standard_error, plot_coverage, plot_paired_differences, summary_data, summary_table

log = logging.getLogger(__name__)
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
    require_fraction(
        cfg,
        "uci.validation_fraction",
        0.5,
        "the share of each split's training rows that decides when the minibatch methods stop (e.g. 0.1)",
    )
    require_int(cfg, "model.rank", minimum=1)
    require_positive_float(cfg, "model.init_scale")
    require_positive_float(cfg, "uci.sampling_init_scale")
    require_prior_scale(cfg)
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
    saved = OmegaConf.select(cfg, "uci.save_model", default=None)
    if saved is not None and saved not in SAVABLE_METHODS:
        raise ConfigError(
            f"uci.save_model={saved!r} must be null or one of {', '.join(SAVABLE_METHODS)} (the cfbnn networks with a "
            "Normal likelihood: the methods `cfbnn predict` can use)"
        )
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


# what every finished (split, method) record holds: finite numbers in their ranges, counts and
# flags; the summary averages these over splits, so none may be missing, NaN or out of range
# (a record that is, was damaged: resuming from it would average the other splits only)
_PROGRESS_NUMBERS = ("test_ll", "rmse", "train_seconds", "predict_seconds_per_1000", "noise_std")
_NON_NEGATIVE = ("rmse", "train_seconds", "predict_seconds_per_1000", "noise_std")
_PROGRESS_FLAGS = ("converged", "stopped_early")


def _number_problem(value, key: str, low=-math.inf, high=math.inf) -> Optional[str]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{key} is {'missing' if value is None else repr(value)[:40]}, not a number"
    if isinstance(value, int) and abs(value) > 1e300:
        return f"{key} is an integer of {len(str(abs(value)))} digits, not a result"
    if not math.isfinite(value):
        return f"{key} is {value!r}, not a finite number"
    if not low <= value <= high:
        return f"{key} is {value!r:.40}, outside [{low:g}, {high:g}]"
    return None


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
        problem = _number_problem(record.get(key), key, 0.0 if key in _NON_NEGATIVE else -math.inf)
        if problem is not None:
            return f"split {split} {method}: {problem}"
    for key in COVERAGE_COLUMNS:  # a share of the test rows (absent in records of older runs)
        problem = _number_problem(record[key], key, 0.0, 1.0) if key in record else None
        if problem is not None:
            return f"split {split} {method}: {problem}"
    iterations = record.get("iterations")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
        return f"split {split} {method}: iterations {iterations!r:.40} is not a count"
    for key in _PROGRESS_FLAGS:
        if not isinstance(record.get(key), bool):
            return f"split {split} {method}: {key} is not true/false"
    equal = record.get("equal_time_test_ll")
    problem = _number_problem(equal, "equal_time_test_ll") if equal is not None else None
    return f"split {split} {method}: {problem}" if problem is not None else None


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
    stray = next((r for r in records if r["split"] >= n_splits or r["method"] not in methods), None)
    if stray is not None:  # this configuration never writes it: the file was changed, not resumed from
        raise CheckpointError(
            f"{path} holds a record of split {stray['split']} ({stray['method']}), but this run has splits "
            f"0..{n_splits - 1} of {', '.join(methods)}; delete it to re-run every split, or start a fresh run dir"
        )
    return records


def prediction_seconds_per_1000(predict, data: RegressionData, device, repeats: int) -> float:
    """The median of ``repeats`` timed predictions of 1,000 points, after a warm-up."""
    thousand = data.x_test.repeat(math.ceil(1000 / data.x_test.shape[0]), 1)[:1000]
    predict(thousand)  # warm-up
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        predict(thousand)
        synchronize(device)
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


def _warm_up(methods: List[str], table: RegressionTable, splits, cfg, device) -> None:
    """Untimed: each method trained briefly once (compiles the fast moments, imports Pyro,
    fills the allocator), so the first timed split is not charged for one-off costs."""
    small = OmegaConf.to_container(cfg, resolve=True)
    small["trainer"]["epochs"] = 2
    small["uci"].update(max_iterations=5, predictive_samples=8, validation_samples=8, timing_repeats=1)
    small = OmegaConf.create(small)
    train, test = splits[0]
    data = _to_device(table.split(train, test), device)
    with quiet("cfbnn_cli.train.loop"):
        for method in methods:
            evaluate(fit_method(method, Split(data, 0, warm_up=True), small, device, seed=0), data, device, small)


def _to_device(data: RegressionData, device) -> RegressionData:
    data.x_train, data.y_train = data.x_train.to(device), data.y_train.to(device)
    data.x_test, data.y_test = data.x_test.to(device), data.y_test.to(device)
    return data


def _require_memory(
    cfg, methods: List[str], input_dim: int, train_rows: int, test_rows: int, minibatch: List[str]
) -> None:
    """Each method's network and the rows it holds at once (a split's training rows for L-BFGS, a
    minibatch for Adam), counted before anything is allocated: one line naming the widths."""
    for method in methods:
        setting = (
            "uci.deep_hidden_sizes" if DETERMINISTIC_METHODS.get(method, (None, False))[1] else "model.hidden_sizes"
        )
        adam = method in minibatch
        require_method_memory(
            method,
            f"uci.methods: {method}",
            setting,
            [int(h) for h in OmegaConf.select(cfg, setting)],
            input_dim,
            rows=min(int(cfg.trainer.batch_size), train_rows) if adam else train_rows,
            optimizer="adam" if adam else "lbfgs",
            prediction_rows=test_rows,
            rank=int(cfg.model.rank),
            fix=f"lower {setting}, or leave {method} out of uci.methods",
        )


def run(cfg: DictConfig, run_dir, values: Optional[RunValues] = None) -> dict:
    run_dir = Path(run_dir)
    methods = validate(cfg)
    device = (values or parse_run_values(cfg)).device  # the typed values (the CLI passes them)
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
    _require_memory(cfg, methods, table.x.shape[1], n_train, len(splits[0][1]), minibatch)
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
        with progress_bar(total=remaining, desc="uci", unit="fit", leave=False) as bar:
            for k, (train, test) in enumerate(splits):
                split = Split(_to_device(table.split(train, test), device), k, progress=bar)
                for method in order:
                    if (k, method) in done:
                        if method == reference:
                            split.equal_time_seconds = done[(k, method)]["train_seconds"]
                        continue
                    bar.set_description(f"split {k} {method}")
                    synchronize(device)
                    started = time.perf_counter()
                    fitted = fit_method(method, split, cfg, device, seed=cfg.seed * 1000 + k)
                    synchronize(device)
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
                        "stop": fitted.stop,  # how L-BFGS stopped, in words ("" for Adam)
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
                    note_saved(progress_path)
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
    tables.update(write_table(summary, run_dir, "uci", caption=caption, data=summary_data(frame, methods, reference)))
    log.debug("UCI protocol, %s:\n%s", table.name, summary.to_markdown())
    figures = {
        "uci": plot_paired_differences(
            frame,
            methods,
            reference,
            f"UCI protocol on {table.name}: {len(splits)} random 90/10 splits",
            run_dir / "uci.png",
        )
    }
    coverage = plot_coverage(
        frame, methods, f"UCI protocol on {table.name}: {len(splits)} random 90/10 splits", run_dir / "calibration.png"
    )
    if coverage is not None:
        figures["calibration"] = coverage
    saved = OmegaConf.select(cfg, "uci.save_model", default=None)
    if saved is not None:
        save_refit_model(saved, table, cfg, device, run_dir)
    return {
        "metrics": _metrics(frame, methods, reference, len(splits)),
        "tables": tables,
        "figures": figures,
        "device": device,
    }


# the closed forms and the deterministic network: cfbnn networks with a Normal likelihood
SAVABLE_METHODS = ("closed_form_diagonal", "closed_form_full", "closed_form_lowrank", "deterministic_2_hidden")


def save_refit_model(method: str, table: RegressionTable, cfg, device, run_dir: Path) -> Path:
    """``uci.save_model=<method>``: that method refit on every row of the data (the splits were
    for measuring it; a model to use is best trained on all of them), saved as ``model.pt`` for
    ``cfbnn predict``."""
    every_row = np.arange(len(table.y))
    full = _to_device(table.split(every_row, every_row[:0]), device)
    log.info("uci.save_model=%s: refitting on all %d rows for model.pt", method, len(every_row))
    fitted = fit_method(method, Split(full, len(every_row)), cfg, device, seed=cfg.seed + 10_000)
    return save_regression_model(run_dir, fitted.model, full, fitted.estimator, method)


COVERAGE_COLUMNS = tuple(f"coverage_{round(100 * level)}" for level in NOMINAL_LEVELS)


def _metrics(frame: pd.DataFrame, methods: List[str], reference: Optional[str], n_splits: int) -> Dict[str, float]:
    metrics: Dict[str, float] = {"uci/n_splits": n_splits}
    for method in methods:
        part = frame[frame["method"] == method]
        for column in ("test_ll", "rmse"):
            mean, se = mean_and_standard_error(part[column])
            metrics[uci_key(method, f"{column}_mean")] = mean
            metrics[uci_key(method, f"{column}_se")] = se
        equal = part["equal_time_test_ll"].astype(float)
        metrics[uci_key(method, "equal_time_test_ll_mean")] = float(equal.mean()) if equal.notna().all() else None
        metrics[uci_key(method, "test_ll_sd_over_splits")] = (
            float(part["test_ll"].std(ddof=1)) if len(part) > 1 else None
        )
        metrics[uci_key(method, "train_seconds_median")] = float(part["train_seconds"].median())
        metrics[uci_key(method, "iterations_median")] = float(part["iterations"].median())
        metrics[uci_key(method, "predict_seconds_per_1000_median")] = float(part["predict_seconds_per_1000"].median())
        for column in COVERAGE_COLUMNS:  # calibration: mean over splits (absent in records of older runs)
            values = part[column].astype(float) if column in part else None
            metrics[uci_key(method, f"{column}_mean")] = (
                float(values.mean()) if values is not None and values.notna().all() else None
            )
    for closed in [m for m in methods if m.startswith("closed_form_")]:
        for peer in [m for m in methods if not m.startswith("closed_form_")]:
            key = f"uci/compare/{closed}_vs_{peer}"
            # paired over splits: the same split's difference, so split-to-split spread cancels
            paired = (
                frame[frame["method"] == closed].set_index("split")["test_ll"]
                - frame[frame["method"] == peer].set_index("split")["test_ll"]
            ).dropna()
            mean, se = mean_and_standard_error(paired)
            metrics[f"{key}/test_ll_difference"] = mean
            metrics[f"{key}/test_ll_difference_se"] = se
            metrics[f"{key}/train_time_ratio"] = (
                metrics[uci_key(closed, "train_seconds_median")] / metrics[uci_key(peer, "train_seconds_median")]
            )
            metrics[f"{key}/predict_speedup"] = (
                metrics[uci_key(peer, "predict_seconds_per_1000_median")]
                / metrics[uci_key(closed, "predict_seconds_per_1000_median")]
            )
    return metrics
