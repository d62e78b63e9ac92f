"""``cfbnn train classification``: a closed-form Bayesian classifier fitted to a table.

The network is ``D -> 50 ReLUs -> K logits`` with mean-field Normal weights (``model.*``), priors
N(0, 1) and posterior standard deviations started at 0.1 (the UCI protocol's recipe), and the
paper's softmax likelihood: its expected log-likelihood is the deterministic approximation of
eq. (38), so the objective has nothing sampled. On one random train/test split
(``data.test_fraction``, from ``data.seed``):

* up to ``fit.full_batch_max_rows`` training rows the objective is minimized by full-batch
  L-BFGS to convergence; above, by minibatch Adam stopped by the held-out log-likelihood of a
  validation split (``fit.validation_fraction``, ``fit.patience``);
* the held-out rows give the accuracy and the log-likelihood per row (of the class
  probabilities ``softmax(y_hat + log(1 + var/2))`` implied by eq. (38)), beside scikit-learn's
  logistic regression on the same split (``fit.baseline``); ``classification.md``, a
  reliability figure ``classification.png`` and ``results.json`` (``fit/...``);
* ``model.pt`` (:func:`~cfbnn_cli.bnn.model_file.save_run_model`, with the label names), refit on
  every row first (``fit.refit``) or the model tested: ``cfbnn predict RUN NEW.csv`` writes each
  new row's class probabilities and predicted label.

Labels may be text or numbers; classes are ordered numerically where every label is a number.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

from ..bnn.footprint import require_fit_memory, rows_at_once
from ..bnn.likelihoods import CategoricalLikelihood
from ..bnn.model_file import FILE_NAME, save_run_model
from ..bnn.network import BayesianNetwork
from ..data.classification import (
    CLASSIFICATION_DATA,
    ClassificationSplit,
    ClassificationTable,
    load_classification_table,
)
from ..data.tabular import MISSING_POLICIES, held_out_split
from ..moments import validate_args
from ..report.figures import caption, new_figure, save_figure
from ..report.metric_keys import fit_key
from ..report.numbers import format_value
from ..report.tables import write_table
from ..run_values import RunValues, parse_run_values
from ..runtime.checks import require_bool, require_choice, require_int
from ..runtime.device import synchronize
from ..runtime.rundir import config_fingerprint
from ..train import TrainingLoop, optimizers
from ..train.fit_checks import FitFailedError, classification_problems, failure_message, suggestion
from ..train.fit_records import FitProgress, FitRecords, epoch_note, run_adam_phase, run_lbfgs_phase
from ..train.fit_settings import fit_estimator, input_scale, prior_scale, scale_first_layer, validate_fit_settings
from ..train.full_batch import minimize_with_polish
from ..train.graphs import BatchLoss

log = logging.getLogger(__name__)


def validate(cfg: DictConfig) -> None:
    """Every check that needs no data, before any work starts."""
    require_choice(cfg, "data.name", list(CLASSIFICATION_DATA))
    if OmegaConf.select(cfg, "data.missing", default=None) is not None:
        require_choice(cfg, "data.missing", list(MISSING_POLICIES))
    require_int(cfg, "data.seed", minimum=0)
    validate_fit_settings(cfg)
    require_bool(cfg, "fit.baseline")


def supports_distributed(cfg: DictConfig) -> bool:
    return False


def _network(table: ClassificationTable, cfg, seed: int) -> BayesianNetwork:
    return BayesianNetwork(
        table.x.shape[1],
        list(cfg.model.hidden_sizes),
        len(table.classes),
        cfg.model.activation,
        "diagonal",
        prior_scale=prior_scale(cfg, cfg.model.hidden_sizes),
        init_scale=float(cfg.model.init_scale),
        likelihood=CategoricalLikelihood("approximation"),
        generator=torch.Generator().manual_seed(seed),
    )


def log_likelihood_per_row(model: BayesianNetwork, x: torch.Tensor, y: torch.Tensor, estimator) -> torch.Tensor:
    """``log p(y_n | x_n)`` of the predicted class probabilities (under ``estimator``), per row ``(N,)``."""
    with torch.no_grad():
        probabilities = model.predict(x, estimator=estimator).probs
    return probabilities.gather(-1, y[:, None]).squeeze(-1).clamp_min(1e-300).log()


class _Fit:
    """One model fitted on ``split``'s training rows as the fit's ``phase`` (``fit`` or ``refit``):
    L-BFGS or Adam (see the module docstring), its progress shown, its rows in metrics.csv and its
    checkpoint kept (:mod:`~cfbnn_cli.train.fit_records`)."""

    def __init__(self, table, split: ClassificationSplit, cfg, device, seed: int, records: FitRecords, phase: str):
        self.model = _network(table, cfg, seed).to(device)
        self.estimator = fit_estimator(cfg.model.hidden_sizes)
        # deeper than one hidden layer: the first layer trains on the inputs times `scale`, its prior then
        # N(0, 1) in the inputs' units (fit_settings.input_scale); the factor goes into its weights after
        scale = input_scale(cfg, cfg.model.hidden_sizes)
        if scale != 1.0:
            scale_first_layer(self.model, 1.0 / scale)
        x, y = split.x_train.to(device) * scale, split.y_train.to(device)
        rows = len(y)
        started = time.perf_counter()
        if rows <= cfg.fit.full_batch_max_rows:
            estimator = self.estimator

            def objective_in(dtype):  # the rows' features in `dtype` (float64: the polish); labels as they are
                features = x.to(dtype)
                return lambda: -self.model.elbo(features, y, num_data=rows, estimator=estimator) / rows

            def run_stage(minimizer, stage):
                name = f"{phase}_{stage}" if stage else phase
                what = "L-BFGS iteration {count} of at most {total}"
                with FitProgress(name, minimizer.max_iterations, "it", what) as bar:
                    return run_lbfgs_phase(minimizer, self.model, records, name, bar)

            result = minimize_with_polish(
                objective_in,
                self.model,
                run_stage,
                max_iterations=cfg.fit.max_iterations,
                rtol=cfg.fit.rtol,
                label=f"{phase} objective",
            )
            self.optimizer, self.iterations, self.converged = "lbfgs", result.iterations, result.converged
            self.stop, self.stopped_early = result.describe(), False
        else:
            self._adam(x, y, cfg, device, seed, records, phase)
        if scale != 1.0:
            scale_first_layer(self.model, scale)
        synchronize(device)
        self.seconds = time.perf_counter() - started

    def _adam(self, x, y, cfg, device, seed: int, records: FitRecords, phase: str) -> None:
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed + 1)).to(device)
        held = max(1, int(round(cfg.fit.validation_fraction * len(y))))
        fit_rows, validation_rows = order[held:], order[:held]
        model = self.model
        batch_size = min(int(cfg.trainer.batch_size), len(fit_rows))
        steps = cfg.trainer.epochs * -(-len(fit_rows) // batch_size)
        what = f"Adam, {len(fit_rows)} rows in batches of {batch_size}, step {{count}} of at most {{total}}"
        with FitProgress(phase, steps, "step", what) as bar:
            loop = TrainingLoop(
                model,
                optimizers.adam(model.parameters(), lr=cfg.trainer.lr),
                # the fit rows, a minibatch gathered from them (outside a CUDA graph)
                BatchLoss(
                    (x[fit_rows], y[fit_rows]),
                    lambda xb, yb: -model.elbo(xb, yb, num_data=len(fit_rows), estimator=self.estimator),
                ),
                len(fit_rows),
                batch_size,
                device,
                epochs=cfg.trainer.epochs,
                data_generator=torch.Generator().manual_seed(seed + 2),
                label=phase,
                evaluate=lambda epoch: {
                    "validation_ll": float(
                        log_likelihood_per_row(model, x[validation_rows], y[validation_rows], self.estimator).mean()
                    )
                },
                after_epoch=lambda epoch, row: bar.note(epoch_note(loop, epoch)),
                select=("validation_ll", "max"),
                objective_scale=1.0 / len(fit_rows),  # metrics.csv: the ELBO per row, not the whole data's
                patience=cfg.fit.patience,
                evaluate_every=cfg.fit.evaluate_every,
                cuda_graphs=cfg.trainer.cuda_graphs,
                progress=bar,
                **records.loop_options(phase),
            )
            history, stopped_early = run_adam_phase(loop, records)
        loop.load_best()
        self.optimizer, self.iterations = "adam", len(history)
        self.converged, self.stopped_early, self.stop = False, stopped_early, ""

    def describe(self) -> str:
        if self.optimizer == "lbfgs":
            return f"L-BFGS, {self.iterations} iterations, {self.stop}"
        state = "stopped by validation" if self.stopped_early else "reached trainer.epochs"
        return f"Adam, {self.iterations} epochs, {state}"


def _baseline(split: ClassificationSplit, classes: int) -> Tuple[float, float]:
    """scikit-learn's logistic regression (its defaults: L2, C = 1) on the same standardized split:
    ``(held-out accuracy, held-out negative log-likelihood per row)`` (a class the training rows lack
    has probability 0, floored at 1e-300 as the fit's own)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model = LogisticRegression(max_iter=2000).fit(split.x_train.numpy(), split.y_train.numpy())
    labels = split.y_test.numpy()
    probabilities = np.zeros((len(labels), classes))
    probabilities[:, model.classes_] = model.predict_proba(split.x_test.numpy())
    nll = -float(np.log(np.maximum(probabilities[np.arange(len(labels)), labels], 1e-300)).mean())
    return float((model.predict(split.x_test.numpy()) == labels).mean()), nll


def _frequency_nll(split: ClassificationSplit, classes: int) -> float:
    """The held-out negative log-likelihood per row of predicting the training rows' class
    frequencies for every row (add-one counts: a class the training rows lack is not impossible)."""
    counts = np.bincount(split.y_train.numpy(), minlength=classes) + 1.0
    return -float(np.log(counts / counts.sum())[split.y_test.numpy()].mean())


def run(cfg: DictConfig, run_dir, values: Optional[RunValues] = None) -> dict:
    run_dir = Path(run_dir)
    validate(cfg)
    device = (values or parse_run_values(cfg)).device
    table = load_classification_table(cfg.data)
    train, test = held_out_split(len(table.y), float(cfg.data.test_fraction), int(cfg.data.seed))
    split = table.split(train, test)
    rows, optimizer = rows_at_once(
        len(train), cfg.fit.full_batch_max_rows, cfg.trainer.batch_size, len(table.y) if cfg.fit.refit else 0
    )
    require_fit_memory(
        f"model.hidden_sizes={list(cfg.model.hidden_sizes)}",
        table.x.shape[1],
        cfg.model.hidden_sizes,
        len(table.classes),
        rows=rows,
        optimizer=optimizer,
        prediction_rows=len(test),
        fix="lower model.hidden_sizes (or fit.full_batch_max_rows, to train on minibatches)",
    )
    log.info(
        "fitting a closed-form classifier on %s: %d training rows, %d held out, %d features, %d classes (%s), "
        "hidden layers %s, device=%s",
        table.name,
        len(train),
        len(test),
        table.x.shape[1],
        len(table.classes),
        ", ".join(table.classes[:10]) + (", ..." if len(table.classes) > 10 else ""),
        list(cfg.model.hidden_sizes),
        device,
    )
    with validate_args(False):
        records = FitRecords(
            run_dir, config_fingerprint(cfg, run_dir), bool(cfg.resume), OmegaConf.to_container(cfg, resolve=True)
        )
        fitted = _Fit(table, split, cfg, device, int(cfg.seed) * 1000, records, "fit")
        x_test, y_test = split.x_test.to(device), split.y_test.to(device)
        with torch.no_grad():
            probabilities = fitted.model.predict(x_test, estimator=fitted.estimator).probs
        log_likelihood = log_likelihood_per_row(fitted.model, x_test, y_test, fitted.estimator)
        accuracy = float((probabilities.argmax(-1) == y_test).double().mean())
        frequency_nll = _frequency_nll(split, len(table.classes))
        problems = classification_problems(-float(log_likelihood.mean()), frequency_nll)
        model, scaling = fitted.model, split
        if cfg.fit.refit and not problems:  # a failed fit is not refit: there is no model.pt to make
            every = np.arange(len(table.y))
            scaling = table.split(every, every[:0])
            log.info("fit.refit=true: refitting on all %d rows for %s", len(every), FILE_NAME)
            model = _Fit(table, scaling, cfg, device, int(cfg.seed) + 10_000, records, "refit").model
    baseline, baseline_nll = _baseline(split, len(table.classes)) if cfg.fit.baseline else (None, None)
    metrics = {
        fit_key("test_accuracy"): accuracy,
        fit_key("test_nll"): -float(log_likelihood.mean()),
        fit_key("baseline_accuracy"): baseline,
        fit_key("baseline_nll"): baseline_nll,
        fit_key("frequency_nll"): frequency_nll,
        fit_key("train_rows"): len(train),
        fit_key("test_rows"): len(test),
        fit_key("classes"): len(table.classes),
        fit_key("train_seconds"): fitted.seconds,
        fit_key("iterations"): fitted.iterations,
        fit_key("converged"): float(fitted.converged or fitted.stopped_early),
    }
    log.info(
        "held-out: accuracy %.2f%%, log-likelihood %s per row%s; %s in %.1f s",
        100 * accuracy,
        format_value(-metrics[fit_key("test_nll")]),
        f" (logistic regression on the same split: {100 * baseline:.2f}%, {format_value(-baseline_nll)})"
        if baseline is not None
        else "",
        fitted.describe(),
        fitted.seconds,
    )
    frame = pd.DataFrame(
        {
            "held-out": [
                f"{len(test)} of {len(table.y)} rows",
                f"{len(table.classes)}",
                f"{100 * accuracy:.2f} %",
                format_value(-metrics[fit_key("test_nll")]),
                f"{100 * baseline:.2f} %" if baseline is not None else "—",
                format_value(-baseline_nll) if baseline_nll is not None else "—",
                format_value(-frequency_nll),
                fitted.describe(),
                "FAILED: " + "; ".join(problems) if problems else "learned from the features",
            ]
        },
        index=[
            "rows",
            "classes",
            "accuracy",
            "log-likelihood per row",
            "logistic regression's accuracy",
            "logistic regression's log-likelihood per row",
            "log-likelihood per row of the training class frequencies",
            "training",
            "result",
        ],
    )
    tables = write_table(
        frame,
        run_dir,
        "classification",
        caption=f"closed-form classifier on {table.name}: a random {100 * float(cfg.data.test_fraction):g} % of the "
        f"rows held out (seed {cfg.data.seed}); logistic regression: scikit-learn's defaults on the same split",
        data=pd.DataFrame([{k.split("/", 1)[1]: v for k, v in metrics.items()}]),
    )
    figure = _plot_reliability(probabilities.double().cpu().numpy(), y_test.cpu().numpy(), table, run_dir)
    if problems:
        advice = suggestion(
            cfg.model.hidden_sizes, table.x.shape[1], len(table.classes), len(train), bool(fitted.converged)
        )
        message = failure_message(f"the classifier on {table.name}:", problems, advice, run_dir)
        raise FitFailedError(message, metrics, tables)
    save_run_model(
        run_dir,
        model,
        table,
        scaling,
        classes=table.classes,
        estimator=str(fitted.estimator),
        method="closed_form_classifier",
    )
    return {
        "metrics": metrics,
        "tables": tables,
        "figures": {"classification": figure},
        "device": device,
        "main_table": "classification.md",
    }


def _plot_reliability(probabilities: np.ndarray, labels: np.ndarray, table: ClassificationTable, run_dir: Path) -> str:
    """Held-out reliability: in bins of the predicted label's probability, the share predicted right."""
    confidence = probabilities.max(1)
    right = probabilities.argmax(1) == labels
    edges = np.linspace(0.0, 1.0, 11)
    which = np.clip(np.digitize(confidence, edges) - 1, 0, 9)
    fig, (ax,) = new_figure(1, width=3.6, height=3.4)
    centres, shares, counts = [], [], []
    for k in range(10):
        members = which == k
        if members.any():
            centres.append(float(confidence[members].mean()))
            shares.append(float(right[members].mean()))
            counts.append(int(members.sum()))
    ax.plot([0, 1], [0, 1], color="0.5", lw=0.6, ls="--", label="calibrated")
    ax.plot(centres, shares, "o-", ms=3, lw=0.8, color="tab:blue", label="held-out rows")
    for centre, share, count in zip(centres, shares, counts):
        ax.annotate(str(count), (centre, share), textcoords="offset points", xytext=(3, -8), fontsize=5)
    ax.set_xlim(0, 1.02)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("probability of the predicted label")
    ax.set_ylabel("share predicted right")
    ax.legend(fontsize=6, loc="upper left")
    caption(
        fig,
        f"{table.name}: {len(labels)} held-out rows in bins of confidence (numbers: rows per bin); "
        f"accuracy {100 * right.mean():.1f} %",
    )
    return save_figure(fig, run_dir / "classification.png")
