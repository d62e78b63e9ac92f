"""Figure 1's evaluation: Monte Carlo against the deterministic prediction of a trained head --
accuracy per number of samples, calibration, the time per image (this run's head and one of the
paper's sizes), and their table and figure. On CUDA each prediction runs as a CUDA graph."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Dict, List, Tuple

import pandas as pd
import torch

from ...bnn.classification import approximate_class_probabilities
from ...bnn.layers import cached_weights
from ...bnn.network import bayesian_head
from ...report.figures import caption, legend_below, new_figure, save_figure
from ...report.metric_keys import deterministic_key, monte_carlo_key
from ...report.numbers import format_mean_se, format_value
from ...report.tables import write_table
from ...runtime.cuda_graphs import GraphedCall
from ...runtime.device import synchronize
from ...runtime.progress import progress_bar

log = logging.getLogger(__name__)


def top_k_correct(scores: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    """Whether the label is among the ``k`` highest scores, per row: bool ``(..., N)``."""
    k = min(k, scores.shape[-1])
    return (scores.topk(k, dim=-1).indices == labels.unsqueeze(-1)).any(-1)


def expected_calibration_error(probabilities, labels, bins: int = 15) -> float:
    """Top-label ECE: sum over confidence bins of |accuracy - confidence| weighted by the bin's share."""
    confidence, prediction = probabilities.max(-1)
    correct = (prediction == labels).double()
    edges = torch.linspace(0, 1, bins + 1, dtype=confidence.dtype, device=confidence.device)
    index = torch.bucketize(confidence, edges[1:-1], right=True)
    ece = 0.0
    for b in range(bins):
        members = index == b
        if members.any():
            ece += float(members.double().mean()) * abs(
                float(correct[members].mean()) - float(confidence[members].double().mean())
            )
    return ece


def batched(function, features, batch_size):
    return [function(features[i : i + batch_size]) for i in range(0, len(features), batch_size)]


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def monte_carlo_accuracy(
    model,
    features,
    labels,
    total: int,
    inner_list: List[int],
    batch_size: int,
    generator,
    chunk: int = 512,
    top_k: int = 5,
    cuda_graphs: bool = True,
):
    """Top-1/top-k correct shares per (N_inner, outer trial): ``{n: (top1 (N_outer,), topk (N_outer,))}``.

    Per image, ``total`` logit samples are drawn (``chunk`` at a time, batched); for
    each ``n`` consecutive groups of ``n`` samples average their softmax
    probabilities, and each group is one outer trial. The counts stay on the device (on
    CUDA each chunk is one CUDA graph, its draws from ``generator``): one synchronization
    at the end.
    """
    chunk = max(max(inner_list), min(chunk, total))
    device = features.device
    counts = {
        n: (
            torch.zeros(total // n, dtype=torch.float64, device=device),
            torch.zeros(total // n, dtype=torch.float64, device=device),
        )
        for n in inner_list
    }

    def chunk_counts(size):
        def correct(hidden, y):
            probabilities = torch.softmax(
                model.sample_outputs(hidden, size, generator=generator, after_point_layers=True), -1
            )
            out = []
            for n in inner_list:  # (size, B, O) -> groups of n samples averaged: one outer trial each
                if size % n == 0:
                    grouped = probabilities.view(size // n, n, *probabilities.shape[1:]).mean(1)
                    out += [
                        top_k_correct(grouped, y, 1).double().sum(-1),
                        top_k_correct(grouped, y, top_k).double().sum(-1),
                    ]
            return tuple(out)

        return GraphedCall(
            correct, device, generators=(generator,), label="Monte Carlo prediction", enabled=cuda_graphs
        )

    graphed = {}
    for start in progress_bar(range(0, len(labels), batch_size), desc="Monte Carlo prediction", leave=False):
        x, y = features[start : start + batch_size], labels[start : start + batch_size]
        hidden = model.point_features(x)
        for offset in range(0, total, chunk):
            size = min(chunk, total - offset)
            if size not in graphed:
                graphed[size] = chunk_counts(size)
            parts = iter(graphed[size](hidden, y))
            for n in inner_list:
                if size % n == 0:
                    trials = slice(offset // n, (offset + size) // n)
                    counts[n][0][trials] += next(parts)
                    counts[n][1][trials] += next(parts)
    return {n: (top1.cpu() / len(labels), topk.cpu() / len(labels)) for n, (top1, topk) in counts.items()}


@torch.no_grad()
def time_per_image(model, features, inner_list, batch_size, generator, device, cuda_graphs: bool = True):
    """Seconds per image: deterministic argmax y_hat, and Monte Carlo with each N_inner (one trial).

    Each method is timed as the pipeline predicts: on CUDA as a CUDA graph per batch size
    (captured, and replayed once, before the clock starts)."""

    def deterministic(x):
        return model.output_mean(x).argmax(-1)

    def monte_carlo(n):
        return lambda x: torch.softmax(model.sample_outputs(x, n, generator=generator), -1).mean(0).argmax(-1)

    sizes = sorted({len(features[i : i + batch_size]) for i in range(0, len(features), batch_size)})

    def timed(function, label):
        function = GraphedCall(function, device, generators=(generator,), label=label, enabled=cuda_graphs)
        for size in sizes:  # warm-up: eager, captured, replayed
            function(features[:size])
            function(features[:size])
        synchronize(device)
        started = time.perf_counter()
        batched(function, features, batch_size)
        synchronize(device)
        return (time.perf_counter() - started) / len(features)

    with cached_weights():  # the weights are fixed here: each batch reuses the stacked means and variances
        return (
            timed(deterministic, "deterministic prediction"),
            {n: timed(monte_carlo(n), f"Monte Carlo prediction (N_inner={n})") for n in inner_list},
        )


PAPER_HEAD = (2048, [1000, 1000], 1000)  # the paper's Figure 1 head: ResNet50 features, 1000 classes
PAPER_BATCH = 256


@torch.no_grad()
def time_paper_head(cfg, inner_list, device) -> Tuple[float, Dict[int, float]]:
    """:func:`time_per_image` for a head of the paper's sizes (2048-1000-1000-1000, random
    weights and random features: the time does not depend on the values) on
    ``PAPER_BATCH`` images, so the timing table shows the paper's claim at the paper's size."""
    feature_dim, hidden, classes = PAPER_HEAD
    generator = torch.Generator().manual_seed(cfg.seed + 7)
    head = (
        bayesian_head(
            feature_dim,
            hidden,
            classes,
            cfg.model.activation,
            cfg.model.prior_scale,
            cfg.model.init_scale,
            generator,
            objective=cfg.objective,
        )
        .to(device)
        .eval()
    )
    features = torch.randn(PAPER_BATCH, feature_dim, generator=generator).to(device)
    sampler = torch.Generator(device=device).manual_seed(cfg.seed + 8)
    return time_per_image(head, features, inner_list, PAPER_BATCH, sampler, device, cfg.trainer.cuda_graphs)


DETERMINISTIC_LABEL = "Deterministic argmax ŷ (eq. 42)"


def _head_sizes(cfg, data) -> List[int]:
    return [data["x_train"].shape[1], *cfg.model.hidden_sizes, data["num_classes"]]


def describe_run(cfg, data) -> str:
    """One line naming the data, features, head and training of a run (figure and table captions)."""
    subset = cfg.data.get("train_size")
    images = f"{len(data['y_train'])} training images" + (" (a class-balanced subset)" if subset else "")
    features = "raw pixels" if cfg.backbone.name == "identity" else f"{cfg.backbone.name} features"
    sizes = _head_sizes(cfg, data)
    return (
        f"{cfg.data.name}, {images}, {len(data['y_test'])} test images, {features}; head "
        f"{'-'.join(str(n) for n in sizes)} trained with objective={cfg.objective}, batch {cfg.trainer.batch_size}, "
        f"seed {cfg.seed}"
    )


def _plot(raw: pd.DataFrame, deterministic: Dict[str, float], top_k: int, total: int, description: str, path) -> str:
    """Figure 1: top-1 (left) and top-k (right) test accuracy of Monte Carlo against N_inner
    (mean over the outer trials, error bars one s.d., band min-max) and the deterministic
    prediction (dashed)."""
    fig, axes = new_figure(2, width=7.0, height=3.2)
    for ax, k in zip(axes, (1, top_k)):
        ax.errorbar(
            raw["N_inner"],
            raw[f"top{k}_mean"],
            yerr=raw[f"top{k}_sd"],
            fmt="o-",
            ms=4,
            lw=1.4,
            capsize=2,
            color="C0",
            label="Monte Carlo: mean ± s.d. over outer trials",
            zorder=3,
        )
        ax.fill_between(
            raw["N_inner"],
            raw[f"top{k}_min"],
            raw[f"top{k}_max"],
            color="C0",
            alpha=0.18,
            lw=0,
            label="Monte Carlo: min–max over outer trials",
        )
        ax.axhline(deterministic[f"top{k}"], color="k", ls="--", lw=1.2, label="deterministic argmax ŷ (no sampling)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(raw["N_inner"]))
        ax.set_xticklabels([str(n) for n in raw["N_inner"]])
        ax.set_xlabel("N_inner (samples averaged per prediction)")
        ax.set_ylabel(f"top-{k} test accuracy")
        ax.set_title(f"top-{k}")
        ax.grid(alpha=0.3)
    legend_below(fig, axes)
    caption(fig, f"{description}; Monte Carlo: {total} logit samples per image as N_inner × N_outer")
    return save_figure(fig, path)


def _plot_accuracy_against_time(
    raw, deterministic, deterministic_seconds, mc_seconds, top_k, device, description, path
) -> str:
    """Accuracy against the time one prediction takes: Monte Carlo with each N_inner (a point each,
    labelled) and the deterministic prediction, top-1 (left) and top-k (right); what the paper's fast
    prediction buys, on this machine."""
    fig, axes = new_figure(2, width=7.0, height=3.2)
    for ax, k in zip(axes, (1, top_k)):
        times = [1e3 * mc_seconds[n] for n in raw["N_inner"]]
        ax.plot(times, raw[f"top{k}_mean"], "o-", ms=4, lw=1.4, color="C0", label="Monte Carlo (N_inner labelled)")
        for n, t, accuracy in zip(raw["N_inner"], times, raw[f"top{k}_mean"]):
            ax.annotate(
                str(n), (t, accuracy), xytext=(5, -2), textcoords="offset points", fontsize=7, color="C0", va="top"
            )
        ax.plot(
            [1e3 * deterministic_seconds],
            [deterministic[f"top{k}"]],
            "*",
            ms=12,
            color="k",
            label="deterministic argmax ŷ",
            ls="none",
        )
        ax.set_xscale("log")
        ax.margins(x=0.08, y=0.12)  # room for the labels of the first and last points
        ax.set_xlabel(f"ms per image ({device.type})")
        ax.set_ylabel(f"top-{k} test accuracy")
        ax.set_title(f"top-{k}")
        ax.grid(alpha=0.3)
    legend_below(fig, axes)
    caption(
        fig, f"Test accuracy against prediction time per image (Monte Carlo: mean over the outer trials). {description}"
    )
    return save_figure(fig, path)


def prediction_table(raw: pd.DataFrame, deterministic: Dict[str, float], top_k: int) -> pd.DataFrame:
    """Figure 1 as a table, plain labels: one row per N_inner of Monte Carlo and one for
    the deterministic prediction (no N_inner: nothing is sampled); each accuracy as
    mean ± s.e. over the outer trials, its s.d. over the trials (what one prediction with
    N_inner samples varies by) and its difference to the deterministic one."""
    rows = []
    for r in raw.itertuples(index=False):
        r = r._asdict()
        row = {"Method": "Monte Carlo", "N_inner": str(r["N_inner"]), "N_outer": str(r["N_outer"])}
        for k in (1, top_k):
            mean, sd, n = r[f"top{k}_mean"], r[f"top{k}_sd"], r["N_outer"]
            se = sd / math.sqrt(n) if n > 1 else None
            row[f"Top-{k}"] = format_mean_se(mean, se, sig=3)
            row[f"Top-{k} s.d. (trials)"] = format_value(sd, sig=2) if n > 1 else ""
            row[f"Top-{k} − deterministic"] = format_mean_se(
                mean - deterministic[f"top{k}"], se, sig=3, signed=True, scientific=False
            )
        rows.append(row)
    row = {"Method": DETERMINISTIC_LABEL, "N_inner": "", "N_outer": ""}
    for k in (1, top_k):
        row.update(
            {
                f"Top-{k}": format_value(deterministic[f"top{k}"], sig=3),
                f"Top-{k} s.d. (trials)": "",
                f"Top-{k} − deterministic": "",
            }
        )
    rows.append(row)
    return pd.DataFrame(rows)


@torch.no_grad()
def evaluate(cfg, model, data, run_dir: Path, device) -> dict:
    x, y = data["x_test"], data["y_test"]
    batch = cfg.evaluation.batch_size
    top_k = cfg.evaluation.top_k
    total = cfg.evaluation.total_samples
    output_moments = GraphedCall(
        model.output_moments, device, label="deterministic prediction", enabled=cfg.trainer.cuda_graphs
    )
    means, variances = (torch.cat(parts) for parts in zip(*batched(output_moments, x, batch)))
    deterministic = {
        "top1": round(float(top_k_correct(means, y, 1).double().mean()), 12),
        f"top{top_k}": round(float(top_k_correct(means, y, top_k).double().mean()), 12),
    }
    corrected = approximate_class_probabilities(means, variances)  # the logits' moments are already here
    plain = torch.softmax(means, -1)
    calibration = {}
    for name, probabilities in (("variance_corrected", corrected), ("plain_softmax", plain)):
        calibration[f"{name}/nll"] = float(
            -torch.log(probabilities.gather(-1, y.unsqueeze(-1)).clamp(min=1e-12)).mean()
        )
        calibration[f"{name}/ece"] = expected_calibration_error(probabilities, y)
    inner_list = sorted(cfg.evaluation.inner_samples)
    generator = torch.Generator(device=device).manual_seed(cfg.seed + 5)
    accuracy = monte_carlo_accuracy(
        model, x, y, total, inner_list, batch, generator, top_k=top_k, cuda_graphs=cfg.trainer.cuda_graphs
    )
    timing_rows = x[: cfg.evaluation.timing_images]
    deterministic_seconds, mc_seconds = time_per_image(
        model, timing_rows, inner_list, batch, generator, device, cfg.trainer.cuda_graphs
    )
    paper = time_paper_head(cfg, inner_list, device) if cfg.evaluation.paper_head_timing else None
    raw_rows = []
    for n in inner_list:
        row = {"N_inner": n, "N_outer": len(accuracy[n][0])}
        for k, values in zip((1, top_k), accuracy[n]):
            # accuracies are multiples of 1 / test images: 12 decimals drop float noise (an s.d. of 4e-16 over equal trials)
            row.update(
                {
                    f"top{k}_mean": round(float(values.mean()), 12),
                    f"top{k}_sd": round(float(values.std()), 12) if len(values) > 1 else 0.0,
                    f"top{k}_min": float(values.min()),
                    f"top{k}_max": float(values.max()),
                }
            )
        raw_rows.append(row)
    raw = pd.DataFrame(raw_rows)
    description = describe_run(cfg, data)
    table = prediction_table(raw, deterministic, top_k)
    # the numbers, one per column: a row per Monte Carlo N_inner, then the deterministic prediction
    numbers = pd.concat(
        [
            raw.assign(method="monte_carlo"),
            pd.DataFrame([{"method": "deterministic", **{f"{k}_mean": v for k, v in deterministic.items()}}]),
        ],
        ignore_index=True,
    )[["method", *raw.columns]]
    tables = write_table(
        table,
        run_dir,
        "prediction",
        data=numbers,
        index=False,
        caption=f"Test accuracy of Monte Carlo (N_inner samples averaged per prediction; {total} "
        f"per image as N_inner × N_outer outer trials; mean ± s.e. over the trials) and of the "
        f"deterministic prediction argmax ŷ. {description}",
    )
    heads = [("-".join(str(n) for n in _head_sizes(cfg, data)) + " (this run's)", deterministic_seconds, mc_seconds)]
    if paper is not None:
        heads.append(
            ("-".join(str(n) for n in [PAPER_HEAD[0], *PAPER_HEAD[1], PAPER_HEAD[2]]) + " (paper size)", *paper)
        )
    timing = pd.DataFrame(
        [
            row
            for head, det, mc in heads
            for row in [
                {
                    "Head": head,
                    "Method": DETERMINISTIC_LABEL,
                    "N_inner": "",
                    "ms / image": format_value(1e3 * det),
                    "× deterministic": "1",
                }
            ]
            + [
                {
                    "Head": head,
                    "Method": "Monte Carlo",
                    "N_inner": str(n),
                    "ms / image": format_value(1e3 * t),
                    "× deterministic": format_value(t / det),
                }
                for n, t in mc.items()
            ]
        ]
    )
    graphs = "as CUDA graphs" if device.type == "cuda" and cfg.trainer.cuda_graphs else "eagerly"
    timing_numbers = pd.DataFrame(
        [
            {"head": head, "method": method, "n_inner": n, "seconds_per_image": t, "ratio_to_deterministic": t / det}
            for head, det, mc in heads
            for method, n, t in [("deterministic", None, det)] + [("monte_carlo", n, t) for n, t in mc.items()]
        ]
    )
    tables.update(
        write_table(
            timing,
            run_dir,
            "timing",
            data=timing_numbers,
            index=False,
            caption=f"Prediction time per image on {device.type}, run {graphs} (one outer trial "
            f"for Monte Carlo): this run's head on {len(timing_rows)} test images in "
            f"batches of {batch}"
            + (
                ""
                if paper is None
                else f"; a head of the paper's sizes (random weights: "
                f"the time does not depend on them) on one batch of {PAPER_BATCH}"
            ),
        )
    )
    # the accuracy table is the command's main table (printed once at the end); the timing table here
    log.info("prediction time per image:\n%s", timing.to_markdown(index=False))
    figures = {
        "prediction": _plot(raw, deterministic, top_k, total, description, run_dir / "prediction.png"),
        "accuracy_against_time": _plot_accuracy_against_time(
            raw,
            deterministic,
            deterministic_seconds,
            mc_seconds,
            top_k,
            device,
            description,
            run_dir / "accuracy_against_time.png",
        ),
    }
    metrics = {
        "evaluation/top_k": top_k,
        deterministic_key("top1"): deterministic["top1"],
        deterministic_key(f"top{top_k}"): deterministic[f"top{top_k}"],
        deterministic_key("ms_per_image"): 1e3 * deterministic_seconds,
        "test_images": len(y),
        "train_images": len(data["y_train"]),
    }
    metrics.update({f"calibration/{k}": v for k, v in calibration.items()})
    for row in raw_rows:
        n = row["N_inner"]
        for k in (1, top_k):
            for stat in ("mean", "sd", "min", "max"):
                metrics[monte_carlo_key(n, f"top{k}_{stat}")] = row[f"top{k}_{stat}"]
        metrics[monte_carlo_key(n, "ms_per_image")] = 1e3 * mc_seconds[n]
        metrics[monte_carlo_key(n, "speed_ratio_mc_over_deterministic")] = mc_seconds[n] / deterministic_seconds
    if paper is not None:
        metrics["paper_head/deterministic/ms_per_image"] = 1e3 * paper[0]
        for n, seconds in paper[1].items():
            metrics[f"paper_head/monte_carlo/N{n}/ms_per_image"] = 1e3 * seconds
            metrics[f"paper_head/monte_carlo/N{n}/speed_ratio_mc_over_deterministic"] = seconds / paper[0]
    return {"metrics": metrics, "tables": tables, "figures": figures}
