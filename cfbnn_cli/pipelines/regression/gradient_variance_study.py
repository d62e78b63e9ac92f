"""`cfbnn train regression`: train a BNN regressor; gradient variance (paper Table 1).

``run(cfg, run_dir) -> dict``; no Hydra here. Per epoch it logs and records the
ELBO, test RMSE and test log-likelihood (original units) under the closed-form
predictive (mixture over samples of the sampled earlier layers) and under Monte
Carlo (every layer sampled), writes ``metrics.csv`` and ``checkpoints/last.pt``
atomically; ``resume=true`` continues from that checkpoint. At the configured epochs
it measures the gradient variance of both estimators on one fixed minibatch.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Dict, List, Optional

import pandas as pd
import torch
from omegaconf import DictConfig, ListConfig

from ...bnn.calibration import NOMINAL_LEVELS, coverage_curve, mixture_cdf
from ...bnn.footprint import require_fit_memory
from ...bnn.gradient_variance import gradient_variance
from ...bnn.likelihoods import HeteroscedasticNormalLikelihood
from ...bnn.network import PRIORS, BayesianNetwork
from ...bnn.predictive import mixture_log_likelihood, mixture_mean
from ...data.regression import RegressionData, load_regression_data, validate_data_config
from ...moments import ACTIVATIONS, validate_args
from ...report.figures import caption, legend_below, new_figure, plot_calibration, save_figure
from ...report.numbers import format_value
from ...report.table1_schema import (
    DIGITS,
    ESTIMATOR_LABELS,
    RATIO,
    STUDY_ESTIMATORS,
    epoch_heading,
    layout,
    metrics_from_results,
    table_rows,
)
from ...report.tables import write_table
from ...run_values import REGRESSION_LIKELIHOODS, RunValues, parse_run_values
from ...runtime import distributed
from ...runtime.checks import require_choice, require_int, require_positive_float, require_widths
from ...runtime.errors import ConfigError
from ...runtime.numerics import map_row_chunks, rows_per_chunk
from ...runtime.progress import progress_bar
from ...runtime.seed import seed_everything
from ...train import loop_from_config, optimizers
from .model_file import save_regression_model

log = logging.getLogger(__name__)
LIKELIHOODS = REGRESSION_LIKELIHOODS  # parsed into objects in ..run_values


def validate(cfg: DictConfig) -> None:
    """Every check that needs no data, before any work starts."""
    require_choice(cfg, "model.activation", sorted(ACTIVATIONS))
    require_choice(cfg, "model.prior", list(PRIORS))
    validate_data_config(cfg)
    require_widths(cfg, "model.hidden_sizes", example="[200,200]")
    require_positive_float(cfg, "model.prior_scale")
    require_positive_float(cfg, "model.init_scale")
    require_int(cfg, "evaluation.num_samples", minimum=1)
    require_int(cfg, "gradient_variance.num_samples", minimum=0)
    require_int(cfg, "gradient_variance.batch_size", minimum=1)
    require_int(cfg, "gradient_variance.chunk_size", minimum=1)
    gradient_variance_epochs(cfg)


def gradient_variance_epochs(cfg) -> List[int]:
    """``gradient_variance.epochs`` with ``last`` resolved; each in 0..trainer.epochs."""
    epochs = cfg.trainer.epochs
    resolved = []
    chosen = cfg.gradient_variance.epochs
    if chosen is not None and not isinstance(chosen, (list, ListConfig)):
        raise ConfigError(
            f"gradient_variance.epochs={str(chosen)[:40]!r} must be a list of epochs in 0..trainer.epochs ({epochs}) "
            f"or 'last', e.g. gradient_variance.epochs=[{chosen if isinstance(chosen, int) else 0}]"
        )
    for value in chosen or []:
        epoch = epochs if value == "last" else value
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= epochs:
            raise ConfigError(
                f"gradient_variance.epochs contains {value!r}; use integers in 0..trainer.epochs ({epochs}) or 'last'"
            )
        if epoch not in resolved:
            resolved.append(epoch)
    return sorted(resolved)


def _check_against_data(cfg, data: RegressionData) -> None:
    """Every batch size larger than the training rows, named in one message with the values that
    fit (the defaults, 500, suit Table 1's data, not a small file of one's own)."""
    too_large = [("trainer.batch_size", cfg.trainer.batch_size)]
    if cfg.gradient_variance.num_samples:
        too_large.append(("gradient_variance.batch_size", cfg.gradient_variance.batch_size))
    too_large = [(key, value) for key, value in too_large if value > data.num_train]
    if too_large:
        named = " and ".join(f"{key}={value}" for key, value in too_large)
        fix = " ".join(f"{key}={data.num_train}" for key, _ in too_large)
        raise ConfigError(
            f"{named} {'is' if len(too_large) == 1 else 'are'} larger than the {data.num_train} training rows of "
            f"data={data.name}; lower {'it' if len(too_large) == 1 else 'them'}, e.g. {fix}"
        )


@torch.no_grad()
@torch.no_grad()
def test_pit(model: BayesianNetwork, data: RegressionData, num_samples: int, generator) -> torch.Tensor:
    """The PIT of every test target under the closed-form predictive (the mixture :func:`evaluate`
    scores), in row chunks."""
    x, y = data.x_test, data.y_test
    chunk = rows_per_chunk(num_samples * max(layer.out_features for layer in model.gaussian_layers))

    def pit(rows: torch.Tensor):
        means, variances, log_weights = model.predictive_components(
            x[rows], estimator="analytic", num_samples=num_samples, generator=generator
        )
        return mixture_cdf(y[rows], means, variances, log_weights)

    return map_row_chunks(pit, torch.arange(len(y), device=x.device), chunk)


def evaluate(model: BayesianNetwork, data: RegressionData, num_samples: int, generator) -> Dict[str, float]:
    """Test RMSE and per-point log-likelihood in the target's original units, under the
    closed-form predictive (the last two layers integrated, ``num_samples`` draws of any
    earlier sampled layer; for a heteroscedastic network also the log-variance, by
    Gauss-Hermite) and under Monte Carlo (every layer sampled); and ``noise_std``, the
    learned noise or, heteroscedastic, the root mean predicted noise variance over the test
    inputs (at the propagated mean of the log-variance).

    Row chunks keep the peak memory at ``num_samples x chunk x widest layer`` elements,
    whatever the size of the test set.
    """
    x, y = data.x_test, data.y_test
    log_scale = math.log(data.target_std)
    heteroscedastic = model.output_dim == 2
    chunk = rows_per_chunk(num_samples * max(layer.out_features for layer in model.gaussian_layers))

    def per_point(rows: torch.Tensor):
        xb, yb = x[rows], y[rows]
        means, variances, log_weights = model.predictive_components(
            xb, estimator="analytic", num_samples=num_samples, generator=generator
        )
        closed = mixture_log_likelihood(yb, means, variances, log_weights)
        outputs = model.sample_outputs(xb, num_samples, generator=generator)
        if heteroscedastic:  # each draw's own (mean, log-variance)
            sampled_means, sampled_variances = outputs[..., 0], outputs[..., 1].exp()
            noise_variance = model.output_moments(xb, estimator="deterministic", noise=())[0][..., 1].exp()
        else:
            noise_variance = (1.0 / model.precision).expand_as(yb)
            sampled_means, sampled_variances = outputs, noise_variance.expand_as(outputs)
        monte_carlo = mixture_log_likelihood(yb, sampled_means, sampled_variances)
        return closed, monte_carlo, (mixture_mean(means, log_weights) - yb).square(), noise_variance

    closed, monte_carlo, squared_error, noise_variance = map_row_chunks(
        per_point, torch.arange(len(y), device=x.device), chunk
    )
    return {
        "test_rmse": squared_error.mean().sqrt().item() * data.target_std,
        "test_ll_closed_form": closed.mean().item() - log_scale,
        "test_ll_monte_carlo": monte_carlo.mean().item() - log_scale,
        "noise_std": noise_variance.mean().sqrt().item() * data.target_std,
    }


def _gradient_variance_both(model, x, y, num_data, cfg, generator, epoch) -> Dict[str, Dict[str, Dict[str, float]]]:
    """{estimator: {layer: {"mean": v, "scale": v}}} at the current parameters."""
    names = model.layer_names()
    out = {}
    for estimator in STUDY_ESTIMATORS:
        started = time.perf_counter()
        sampled = bool(model.noise_shapes(x.shape[0], estimator=estimator))  # nothing drawn: no bar to show
        with progress_bar(
            total=cfg.gradient_variance.num_samples,
            desc=f"gradient draws, {estimator}, epoch {epoch}",
            leave=False,
            disable=not sampled,
        ) as bar:
            per_param = gradient_variance(
                model,
                x,
                y,
                num_data,
                estimator,
                cfg.gradient_variance.num_samples,
                cfg.gradient_variance.chunk_size,
                generator,
                progress=bar,
                cuda_graphs=cfg.trainer.cuda_graphs,
            )
        out[estimator] = {
            names[i]: {"mean": per_param[f"layers.{i}.loc"], "scale": per_param[f"layers.{i}.log_scale"]}
            for i in range(len(names))
        }
        log.info(
            "gradient variance, %s, epoch %d (%d samples, %.1fs): %s",
            estimator,
            epoch,
            cfg.gradient_variance.num_samples,
            time.perf_counter() - started,
            ", ".join(f"{k} {v['mean']:.3g}/{v['scale']:.3g}" for k, v in out[estimator].items()),
        )
    return out


# gradient variances from S draws carry a relative s.e. of about sqrt(2 / S) (4.5 % at S = 1000):
# two significant digits are what one run's numbers support
KIND_LABELS = {"mean": "means", "scale": "log σ"}


def convergence_note(history: List[dict], key: str = "train_elbo_per_point") -> Dict[str, object]:
    """Whether training had converged at its last epoch, judged on the training objective:
    ``{"converged": bool, "rate": per-epoch change over the last epochs, "average": per-epoch
    change over the run, "text": a phrase for captions}``. Converged means the objective's
    recent rate of improvement is below a tenth of its average rate since epoch 1
    (a linearly falling −ELBO is not converged, however slowly it falls)."""
    values = [h[key] for h in history if h.get(key) is not None]
    if len(values) < 3:  # unknown, not "not converged": the table's heading then says nothing either way
        return {
            "converged": None,
            "rate": None,
            "average": None,
            "text": f"{len(values)} epoch(s): too few to judge convergence",
        }
    window = max(2, len(values) // 10)
    rate = (values[-1] - values[-1 - window]) / window
    average = (values[-1] - values[0]) / (len(values) - 1)
    converged = average <= 0 or rate < 0.1 * average
    text = (
        f"converged: the ELBO per point rose {rate:.2g} per epoch over the last {window} epochs, "
        f"{rate / average:.0%} of its average rate"
        if converged and average > 0
        else f"not converged: the ELBO per point was still rising {rate:.2g} per epoch over the last {window} epochs "
        f"({rate / average:.0%} of its average rate since epoch 1)"
        if average > 0
        else "converged: the ELBO per point stopped rising"
    )
    return {"converged": converged, "rate": rate, "average": average, "text": text}


def gradient_variance_data(results: Dict[int, dict], last_epoch: int, converged: Optional[bool] = None) -> pd.DataFrame:
    """The numbers of Table 1 (``gradient_variance.csv``), one row per (epoch, layer,
    parameter): each estimator's mean gradient variance, the ratio sampling / analytic (empty
    where the analytic variance is 0) and, at the last epoch, whether training had converged."""
    rows = []
    for epoch in sorted(results):
        for layer in next(iter(results[epoch].values())):
            for kind, parameter in (("mean", "weight_means"), ("scale", "log_scale")):
                values = {e: results[epoch][e][layer][kind] for e in STUDY_ESTIMATORS if e in results[epoch]}
                analytic, sampling = values.get("analytic"), values.get("sampling")
                rows.append(
                    {
                        "epoch": epoch,
                        "layer": layer,
                        "parameter": parameter,
                        **values,
                        "ratio_sampling_over_analytic": sampling / analytic if analytic else None,
                        "converged": converged if epoch == last_epoch else None,
                    }
                )
    return pd.DataFrame(rows)


def gradient_variance_table(
    results: Dict[int, dict], last_epoch: int, converged: Optional[bool] = None
) -> pd.DataFrame:
    """Paper Table 1 layout (:mod:`~cfbnn_cli.report.table1_schema`): rows Analytic / Sampling /
    Deterministic / the ratio sampling / analytic; columns epoch x layer; cells "weight means /
    log σ" (two significant digits)."""
    metrics = metrics_from_results(results)
    epochs, layers = layout(metrics)
    body = table_rows(
        [*STUDY_ESTIMATORS, RATIO],
        epochs,
        layers,
        lambda epoch: epoch_heading(epoch, last_epoch, converged),
        lambda key: "—" if metrics[key] is None else format_value(metrics[key], sig=DIGITS),
    )
    frame = pd.DataFrame([columns for _, columns in body], index=[label for label, _ in body])
    frame.index.name = "Estimator"
    return frame


def _plot_gradient_variance(
    results, path, description: str, last_epoch: int, converged: Optional[bool], num_samples: int
):
    """Bars of the two estimators' mean gradient variance for each layer's weight means and
    log σ, one panel per epoch on one shared log axis, with ± one standard error (a variance
    from S draws: sqrt(2 / (S - 1)) of it); the ratio sampling / analytic written above each pair."""
    relative_se = math.sqrt(2 / max(num_samples - 1, 1))
    epochs = sorted(results)
    fig, axes = new_figure(len(epochs), width=max(3.6 * len(epochs), 4.5), height=3.4, sharey=True)
    width = 0.4
    low, high = math.inf, 0.0
    for ax, epoch in zip(axes, epochs):
        layers = list(next(iter(results[epoch].values())))
        pairs = [(layer, kind) for layer in layers for kind in ("mean", "scale")]
        styles = {"analytic": dict(color="C0"), "sampling": dict(color="C1", hatch="///", edgecolor="white")}
        for offset, estimator in ((-width / 2, "analytic"), (width / 2, "sampling")):
            values = [results[epoch][estimator][layer][kind] for layer, kind in pairs]
            errors = [[min(relative_se, 0.9) * v for v in values], [relative_se * v for v in values]]  # log axis: > 0
            ax.bar(
                [i + offset for i in range(len(values))],
                values,
                width,
                yerr=errors,
                error_kw=dict(ecolor="0.2", capsize=2, lw=0.8),
                label=ESTIMATOR_LABELS[estimator],
                **styles[estimator],
            )
            positive = [v for v in values if v > 0]  # a log axis shows no 0 (nothing sampled: exact)
            if positive:
                low, high = min(low, min(positive)), max(high, max(positive))
        for i, (layer, kind) in enumerate(pairs):
            analytic, sampling = results[epoch]["analytic"][layer][kind], results[epoch]["sampling"][layer][kind]
            for offset, value, color in ((-width / 2, analytic, "C0"), (width / 2, sampling, "C1")):
                if value == 0:  # exactly 0 (that layer is integrated, not sampled): said where its bar would stand
                    ax.text(
                        i + offset,
                        0.02,
                        "0",
                        transform=ax.get_xaxis_transform(),
                        ha="center",
                        va="bottom",
                        fontsize=8,
                        color=color,
                    )
            if analytic > 0:
                ax.annotate(
                    f"×{format_value(sampling / analytic, sig=2)}",
                    (i, max(analytic, sampling)),
                    xytext=(0, 2),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
        ax.set_yscale("log")
        ax.set_xticks(range(len(pairs)))
        ax.set_xticklabels([f"{layer}\n{KIND_LABELS[kind]}" for layer, kind in pairs])
        ax.set_title(epoch_heading(epoch, last_epoch, converged))
        ax.grid(axis="y", alpha=0.3)
    if high == 0.0:  # every variance is exactly 0: the network is integrated in closed form throughout
        low, high = 1e-12, 1e-9
        for ax in axes:
            ax.text(
                0.5,
                0.5,
                "every gradient variance is 0\n(nothing is sampled)",
                transform=ax.transAxes,
                ha="center",
                va="center",
                fontsize=8,
            )
    axes[0].set_ylim(low / 3, high * 30)  # room above the tallest pair for its ratio
    axes[0].set_ylabel("gradient variance\n(mean over the tensor's elements)")
    legend_below(fig, axes)
    caption(
        fig,
        f"Gradient variance of the weight means and of log σ (the log-scale parameters), per layer; "
        f"×: sampling / analytic; error bars ± one standard error ({100 * relative_se:.0f} % of each variance, "
        f"from {num_samples} draws). The deterministic estimator (not drawn: a log axis has no 0) has "
        f"variance 0 in every layer. {description}",
    )
    return save_figure(fig, path)


def _plot_training(history: List[dict], path, description: str, convergence: Dict[str, object]):
    fig, axes = new_figure(3, width=7.5, height=3.0)
    epochs = [h["epoch"] for h in history]
    axes[0].plot(epochs, [-h["train_elbo_per_point"] for h in history], "o-", ms=3, color="C2")
    axes[0].set_ylabel("−ELBO per point\n(standardized targets, nats)")
    axes[1].plot(epochs, [h["test_rmse"] for h in history], "o-", ms=3, color="C3")
    axes[1].set_ylabel("test RMSE (original units)")
    closed = [h["test_ll_closed_form"] for h in history]
    monte_carlo = [h["test_ll_monte_carlo"] for h in history]
    axes[2].plot(epochs, closed, "-", marker="o", ms=5, mfc="none", lw=1.6, color="C0", label="closed-form predictive")
    axes[2].plot(epochs, monte_carlo, "--", marker="x", ms=5, lw=1.2, color="C1", label="Monte Carlo predictive")
    axes[2].set_ylabel("test log-likelihood per point\n(original units, nats)")
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    gap = max(abs(a - b) for a, b in zip(closed, monte_carlo))
    legend_below(fig, axes)
    caption(
        fig,
        f"{description}. Test log-likelihood: the two predictives differ by at most {format_value(gap, sig=1)} "
        f"nats. Training {convergence['text']}.",
    )
    return save_figure(fig, path)


def describe_run(cfg, data: RegressionData, num_draws: bool = True) -> str:
    """One line naming the data, network, estimator, draws, batch and seed (captions)."""
    heteroscedastic = cfg.likelihood == "heteroscedastic"
    sizes = "-".join(str(n) for n in [data.input_dim, *cfg.model.hidden_sizes, 2 if heteroscedastic else 1])
    noise = " (outputs: mean and log noise variance)" if heteroscedastic else ""
    text = (
        f"Data {data.name} ({data.num_train} training rows, {data.input_dim} features), network {sizes}{noise}, "
        f"trained with the {cfg.estimator} estimator (batch {cfg.trainer.batch_size}, lr {cfg.trainer.lr}, "
        f"{cfg.trainer.epochs} epochs), seed {cfg.seed}"
    )
    if num_draws:
        text += (
            f"; {cfg.gradient_variance.num_samples} single-sample gradients per estimator on one fixed batch of "
            f"{cfg.gradient_variance.batch_size} training rows"
        )
    return text


def run(cfg: DictConfig, run_dir, values: Optional[RunValues] = None) -> dict:
    run_dir = Path(run_dir)
    values = values or parse_run_values(cfg)  # the typed values (the CLI passes them)
    validate(cfg)
    device = values.device
    generator = seed_everything(cfg.seed)
    data = load_regression_data(cfg.data)
    _check_against_data(cfg, data)
    require_fit_memory(  # the network, Adam's state and a minibatch, before any of them is allocated
        f"model.hidden_sizes={list(cfg.model.hidden_sizes)} on {data.input_dim:,} input features",
        data.input_dim,
        cfg.model.hidden_sizes,
        2,
        rows=max(int(cfg.trainer.batch_size), int(cfg.gradient_variance.batch_size)),
        optimizer="adam",
        fix="lower model.hidden_sizes (or the data's width, data.input_dim)",
    )
    gv_epochs = gradient_variance_epochs(cfg) if cfg.gradient_variance.num_samples else []
    estimator, likelihood = values.estimator, values.new_likelihood()
    heteroscedastic = isinstance(likelihood, HeteroscedasticNormalLikelihood)
    model = BayesianNetwork(
        data.input_dim,
        list(cfg.model.hidden_sizes),
        2 if heteroscedastic else 1,
        cfg.model.activation,
        prior_scale=cfg.model.prior_scale,
        init_scale=cfg.model.init_scale,
        likelihood=likelihood,
        generator=generator,
        prior=cfg.model.prior,
    ).to(device)
    optimizer = optimizers.adam(model.parameters(), lr=cfg.trainer.lr)
    x_train, y_train = data.x_train.to(device), data.y_train.to(device)
    data.x_test, data.y_test = data.x_test.to(device), data.y_test.to(device)
    num_data = data.num_train
    # one fixed minibatch for the gradient variances (paper: 500 random training points)
    gv_index = torch.randperm(num_data, generator=torch.Generator().manual_seed(cfg.seed + 1))[
        : cfg.gradient_variance.batch_size
    ]
    gv_x, gv_y = x_train[gv_index.to(device)], y_train[gv_index.to(device)]
    # each rank draws its own noise (rank 0's stream is the single-process one)
    sample_generator = torch.Generator(device=device).manual_seed(cfg.seed + 2 + 1000 * distributed.rank())

    def loss(rows):
        # under torchrun: this rank's rows of the global batch (DDP averages the gradients)
        noise = model.sample_noise(rows.numel(), estimator=estimator, generator=sample_generator)
        if loop.trained is model:  # one process: the ELBO in one call (one autograd node where every layer is
            return -model.elbo(
                x_train[rows], y_train[rows], num_data=num_data, estimator=estimator, noise=noise
            )  # closed form)
        ell = loop.trained(x_train[rows], y_train[rows], estimator=estimator, noise=noise)
        return -(num_data / rows.numel() * ell - model.kl())

    def evaluate_epoch(epoch):
        return evaluate(model, data, cfg.evaluation.num_samples, sample_generator)

    def measure(epoch, row):
        if epoch in gv_epochs and distributed.is_main():  # only rank 0 measures
            gv_results[epoch] = _gradient_variance_both(model, gv_x, gv_y, num_data, cfg, sample_generator, epoch)

    options = dict(
        evaluate=evaluate_epoch,
        after_epoch=measure,
        objective_scale=1.0 / num_data,
        label="train",
        extra={"gradient_variance": {}},
    )
    loop = loop_from_config(
        cfg, run_dir, model, optimizer, loss, num_data, device, generator, sample_generator, **options
    )
    loop.restore()
    gv_results: Dict[int, dict] = loop.extra["gradient_variance"]
    log.info(
        "data=%s (%d train, %d test, %d features), network %d-%s-%d, estimator=%s, likelihood=%s, device=%s",
        data.name,
        num_data,
        data.x_test.shape[0],
        data.input_dim,
        data.input_dim,
        "-".join(str(h) for h in cfg.model.hidden_sizes),
        model.output_dim,
        estimator,
        values.likelihood_name,
        device,
    )
    if 0 in gv_epochs and 0 not in gv_results and distributed.is_main():
        gv_results[0] = _gradient_variance_both(model, gv_x, gv_y, num_data, cfg, sample_generator, 0)
    with validate_args(False):
        history = loop.run().history
    if not distributed.is_main():
        return {"metrics": {}, "tables": {}, "figures": {}, "device": device}

    tables, figures, metrics_out = {}, {}, {}
    convergence = convergence_note(history) if history else {"converged": None, "text": "no epochs"}
    if history:
        figures["training"] = _plot_training(
            history, run_dir / "training.png", describe_run(cfg, data, False), convergence
        )
        metrics_out.update({f"final_{k}": v for k, v in history[-1].items() if k != "epoch"})
        if model.output_dim == 1:  # a Normal predictive (a heteroscedastic one is not a Gaussian mixture here)
            pit = test_pit(model, data, cfg.evaluation.num_samples, sample_generator).cpu()
            for level, share in coverage_curve(pit, NOMINAL_LEVELS):
                metrics_out[f"calibration/coverage_{round(100 * level)}"] = share
            figures["calibration"] = plot_calibration(
                pit, run_dir / "calibration.png", f"Closed-form predictive. {describe_run(cfg, data, False)}"
            )
        metrics_out["train/converged"] = None if convergence["converged"] is None else float(convergence["converged"])
    result_extra = {}
    if gv_results:
        frame = gradient_variance_table(gv_results, cfg.trainer.epochs, convergence["converged"])
        table_caption = (
            f"Mean gradient variances (weight means / log σ, the log-scale parameters; two significant digits: "
            f"{cfg.gradient_variance.num_samples} draws give a relative s.e. of about "
            f"{100 * math.sqrt(2 / max(cfg.gradient_variance.num_samples - 1, 1)):.0f} %). "
            f"{describe_run(cfg, data)}. End of training: {convergence['text']}."
        )
        numbers = gradient_variance_data(gv_results, cfg.trainer.epochs, convergence["converged"])
        tables.update(write_table(frame, run_dir, "gradient_variance", caption=table_caption, data=numbers))
        log.debug("gradient variance (weight means / log σ):\n%s", frame.to_markdown())
        figures["gradient_variance"] = _plot_gradient_variance(
            gv_results,
            run_dir / "gradient_variance.png",
            describe_run(cfg, data),
            cfg.trainer.epochs,
            convergence["converged"],
            cfg.gradient_variance.num_samples,
        )
        result_extra["main_table"] = "gradient_variance.md"
        metrics_out.update(metrics_from_results(gv_results))
    # the trained network and its scaling, for `cfbnn predict RUN_DIR NEW.csv`
    save_regression_model(run_dir, model, data, estimator.name)
    return {"metrics": metrics_out, "tables": tables, "figures": figures, "device": device, **result_extra}
