"""`cfbnn imagenet-predict`: frozen features, a Bayesian head, Monte Carlo vs deterministic
prediction (paper "Fast Prediction", Figure 1).

``run(cfg, run_dir) -> dict``; no Hydra here. Stages (``stage``):

* ``features`` -- the backbone's features of the training and held-out images,
  cached on disk (:mod:`.features`); later stages and later runs reuse them;
* ``train`` -- the head (:func:`cfbnn_cli.bnn.network.bayesian_head`) with
  ``objective=sampling|approximation|control_variate``; the validation accuracy of
  the deterministic prediction picks the epoch (``checkpoints/best.pt``; ``last.pt``
  every epoch; ``resume=true`` continues);
* ``evaluate`` -- on the test images: Monte Carlo class probabilities from
  ``evaluation.total_samples`` samples split as ``N_inner`` inside and
  ``N_outer = total / N_inner`` outer trials, top-1/top-5 accuracy per ``N_inner``
  with its spread over the trials; the deterministic ``argmax y_hat``; calibration
  (NLL, ECE) of the variance-corrected softmax; the time per image of each;
* ``all`` (default) -- the three in order.

The held-out images (ImageNet's official validation set) are split into test and
validation (``split.validation_fraction``, 10k of 50k in the paper) from
``split.seed``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Dict, List

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from ...bnn.classification import approximate_class_probabilities
from ...bnn.network import BayesianNetwork, bayesian_head
from ...data.images import load_image_datasets
from ...moments import ACTIVATIONS, validate_args
from ...report.figures import new_figure, save_figure
from ...report.tables import write_table
from ...runtime.checks import require_choice, require_int, require_positive_float
from ...runtime.device import resolve_device
from ...runtime.errors import ConfigError
from ...runtime import distributed
from ...runtime.checkpoints import load_checkpoint
from ...runtime.rundir import config_fingerprint
from ...runtime.seed import seed_everything
from ...train import TrainingLoop
from . import features as feature_cache

log = logging.getLogger(__name__)
STAGES = ("features", "train", "evaluate", "all")
# how the head is trained: the paper sampled; the approximation and the control variate are its appendix
OBJECTIVES = ("sampling", "approximation", "control_variate")
BACKBONES = ("identity", "resnet50")


def validate(cfg: DictConfig) -> None:
    require_choice(cfg, "stage", STAGES)
    require_choice(cfg, "objective", OBJECTIVES)
    require_choice(cfg, "backbone.name", BACKBONES)
    require_choice(cfg, "model.activation", sorted(ACTIVATIONS))
    sizes = OmegaConf.select(cfg, "model.hidden_sizes")
    if not sizes or len(sizes) != 2 or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in sizes):
        raise ConfigError(f"model.hidden_sizes={sizes} must be two positive widths [ML layer, Bayesian layer], e.g. [1000,1000]")
    require_positive_float(cfg, "model.prior_scale")
    require_positive_float(cfg, "model.init_scale")
    require_int(cfg, "trainer.num_samples", minimum=1)
    total = require_int(cfg, "evaluation.total_samples", minimum=1)
    inner = list(OmegaConf.select(cfg, "evaluation.inner_samples") or [])
    bad = [n for n in inner if isinstance(n, bool) or not isinstance(n, int) or n < 1 or total % n]
    if not inner or bad:
        raise ConfigError(
            f"evaluation.inner_samples={inner} must be positive integers dividing evaluation.total_samples={total}"
            + (f"; these do not: {bad}" if bad else "")
        )
    require_int(cfg, "evaluation.batch_size", minimum=1)
    require_int(cfg, "evaluation.timing_images", minimum=1)
    require_int(cfg, "features.batch_size", minimum=1)
    require_int(cfg, "features.shard_size", minimum=1)
    fraction = OmegaConf.select(cfg, "split.validation_fraction")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ConfigError(f"split.validation_fraction={fraction!r} must be strictly between 0 and 1 (paper: 0.2 = 10k of 50k)")


# ----------------------------------------------------------------------------- stages


def compute_features(cfg, device):
    """Train and held-out features (cached), and the number of skipped (unreadable) images."""
    backbone, description = feature_cache.build_backbone(cfg.backbone.name, cfg.backbone.get("weights"), device)
    train_set, held_out_set, num_classes = load_image_datasets(cfg.data, cfg.backbone.name)
    fields = {"data": cfg.data.name, **OmegaConf.to_container(cfg.data, resolve=True), **description}
    folder = feature_cache.cache_folder(cfg.features.cache_dir, fields)
    kwargs = dict(device=device, batch_size=cfg.features.batch_size, shard_size=cfg.features.shard_size,
                  num_workers=cfg.features.get("num_workers", 0))
    train = feature_cache.extract(train_set, "train", backbone, folder, fields, **kwargs)
    held_out = feature_cache.extract(held_out_set, "held_out", backbone, folder, fields, **kwargs)
    return {"train": train, "held_out": held_out, "num_classes": num_classes, "folder": folder}


def split_held_out(features, labels, validation_fraction: float, seed: int):
    """``(test, validation)`` index arrays of the held-out images (paper: 40k / 10k)."""
    order = np.random.default_rng(seed).permutation(len(labels))
    n_val = max(1, int(round(validation_fraction * len(labels))))
    if len(labels) - n_val < 1:
        raise ConfigError(f"split.validation_fraction={validation_fraction} leaves no test images of {len(labels)}")
    return torch.as_tensor(np.sort(order[n_val:])), torch.as_tensor(np.sort(order[:n_val]))


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
            ece += float(members.double().mean()) * abs(float(correct[members].mean()) - float(confidence[members].double().mean()))
    return ece


def _batched(function, features, batch_size):
    return [function(features[i : i + batch_size]) for i in range(0, len(features), batch_size)]


def build_head(cfg, data, generator=None):
    return bayesian_head(data["x_train"].shape[1], list(cfg.model.hidden_sizes), data["num_classes"],
                         cfg.model.activation, cfg.model.prior_scale, cfg.model.init_scale, generator,
                         objective=cfg.objective)


def train_head(cfg, data, run_dir: Path, device) -> Dict:
    generator = seed_everything(cfg.seed)
    x, y = data["x_train"], data["y_train"]
    model = build_head(cfg, data, generator).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.trainer.lr)
    # each rank draws its own logit samples; the data order is shared (same seed everywhere)
    sampler = torch.Generator(device=device).manual_seed(cfg.seed + 1 + 1000 * distributed.rank())
    num_data = len(y)

    def loss(rows):  # the negative ELBO per training image; DDP averages the gradients over ranks
        ell = loop.trained(x[rows], y[rows], "analytic", None, sampler, cfg.trainer.num_samples)
        return -(num_data / rows.numel() * ell - model.kl()) / num_data

    @torch.no_grad()
    def validation_accuracy(epoch):
        means = torch.cat([m for m, _ in _batched(model.output_moments, data["x_val"], cfg.evaluation.batch_size)])
        return {"val_top1": float(top_k_correct(means, data["y_val"], 1).double().mean())}

    loop = TrainingLoop(
        model, optimizer, loss, num_data, cfg.trainer.batch_size, device, epochs=cfg.trainer.epochs,
        data_generator=generator, generators={"sampler": sampler}, checkpoint_dir=run_dir / "checkpoints",
        fingerprint=config_fingerprint(cfg, run_dir), resume=cfg.resume, evaluate=validation_accuracy,
        select=("val_top1", "max"), best_payload=lambda: {"sizes": _sizes(data)}, metrics_path=run_dir / "metrics.csv",
        label=f"head ({cfg.objective})", config=OmegaConf.to_container(cfg, resolve=True),
    )
    loop.restore()
    result = loop.run()
    return {"history": result.history, "best": result.best}


def _sizes(data):
    return {"feature_dim": data["x_train"].shape[1], "num_classes": data["num_classes"]}


def load_head(cfg, data, run_dir: Path, device) -> BayesianNetwork:
    path = Path(cfg.evaluation.get("checkpoint") or run_dir / "checkpoints" / "best.pt")
    if not path.is_file():
        raise ConfigError(
            f"no trained head at {path}: run stage=train (or all) with the same hydra.run.dir first, "
            "or set evaluation.checkpoint=/path/to/best.pt"
        )
    model = build_head(cfg, data).to(device)
    try:
        model.load_state_dict(load_checkpoint(path, device, "trained head")["model"])
    except (RuntimeError, KeyError) as error:
        raise ConfigError(f"{path} was trained with other sizes than model.hidden_sizes={list(cfg.model.hidden_sizes)} "
                          f"and these features ({error.args[0].splitlines()[0]})") from error
    return model.eval()


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def monte_carlo_accuracy(model, features, labels, total: int, inner_list: List[int], batch_size: int, generator,
                         chunk: int = 512):
    """Top-1/top-5 correct counts per (N_inner, outer trial): ``{n: (top1 (N_outer,), top5 (N_outer,))}``.

    Per image, ``total`` logit samples are drawn (``chunk`` at a time, batched); for
    each ``n`` consecutive groups of ``n`` samples average their softmax
    probabilities, and each group is one outer trial.
    """
    chunk = max(max(inner_list), min(chunk, total))
    counts = {n: (torch.zeros(total // n, dtype=torch.float64), torch.zeros(total // n, dtype=torch.float64)) for n in inner_list}
    for start in tqdm(range(0, len(labels), batch_size), desc="Monte Carlo prediction", leave=False):
        x, y = features[start : start + batch_size], labels[start : start + batch_size]
        hidden = model.point_features(x)
        for offset in range(0, total, chunk):
            size = min(chunk, total - offset)
            probabilities = torch.softmax(model.sample_outputs(hidden, size, generator, after_point_layers=True), -1)  # (size, B, O)
            for n in inner_list:
                if size % n:
                    continue
                grouped = probabilities.view(size // n, n, *probabilities.shape[1:]).mean(1)
                trials = slice(offset // n, (offset + size) // n)
                counts[n][0][trials] += top_k_correct(grouped, y, 1).double().sum(-1).cpu()
                counts[n][1][trials] += top_k_correct(grouped, y, 5).double().sum(-1).cpu()
    return {n: (top1 / len(labels), top5 / len(labels)) for n, (top1, top5) in counts.items()}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_per_image(model, features, inner_list, batch_size, generator, device):
    """Seconds per image: deterministic argmax y_hat, and Monte Carlo with each N_inner (one trial)."""
    def deterministic(x):
        return model.output_mean(x).argmax(-1)

    def monte_carlo(n):
        return lambda x: torch.softmax(model.sample_outputs(x, n, generator), -1).mean(0).argmax(-1)

    def timed(function):
        function(features[: min(8, len(features))])  # warm-up
        _sync(device)
        started = time.perf_counter()
        _batched(function, features, batch_size)
        _sync(device)
        return (time.perf_counter() - started) / len(features)

    return timed(deterministic), {n: timed(monte_carlo(n)) for n in inner_list}


def _plot(table, deterministic, path):
    fig, axes = new_figure(2, width=6.5, height=2.5)
    mc = table[table["method"] == "Monte Carlo"]
    for ax, k in zip(axes, ("top-1", "top-5")):
        ax.plot(mc["N_inner"], mc[f"{k} mean"], "o-", ms=3, label="Monte Carlo")
        ax.fill_between(mc["N_inner"], mc[f"{k} min"], mc[f"{k} max"], alpha=0.25, label="min-max over outer trials")
        ax.axhline(deterministic[k], color="k", ls="--", lw=1, label="deterministic argmax ŷ")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N_inner (samples inside the average)")
        ax.set_ylabel(f"{k} accuracy")
    axes[0].legend(loc="lower right")
    return save_figure(fig, path)


@torch.no_grad()
def evaluate(cfg, model, data, run_dir: Path, device) -> dict:
    x, y = data["x_test"], data["y_test"]
    batch = cfg.evaluation.batch_size
    means, variances = (torch.cat(parts) for parts in zip(*_batched(model.output_moments, x, batch)))
    deterministic = {"top-1": float(top_k_correct(means, y, 1).double().mean()),
                     "top-5": float(top_k_correct(means, y, 5).double().mean())}
    corrected = approximate_class_probabilities(means, variances)  # the logits' moments are already here
    plain = torch.softmax(means, -1)
    calibration = {}
    for name, probabilities in (("variance_corrected", corrected), ("plain_softmax", plain)):
        calibration[f"{name}/nll"] = float(-torch.log(probabilities.gather(-1, y.unsqueeze(-1)).clamp(min=1e-12)).mean())
        calibration[f"{name}/ece"] = expected_calibration_error(probabilities, y)
    inner_list = sorted(cfg.evaluation.inner_samples)
    generator = torch.Generator(device=device).manual_seed(cfg.seed + 5)
    accuracy = monte_carlo_accuracy(model, x, y, cfg.evaluation.total_samples, inner_list, batch, generator)
    timing_rows = x[: cfg.evaluation.timing_images]
    deterministic_seconds, mc_seconds = time_per_image(model, timing_rows, inner_list, batch, generator, device)
    rows = []
    for n in inner_list:
        top1, top5 = accuracy[n]
        rows.append({"method": "Monte Carlo", "N_inner": n, "N_outer": len(top1),
                     "top-1 mean": float(top1.mean()), "top-1 sd": float(top1.std()) if len(top1) > 1 else 0.0,
                     "top-1 min": float(top1.min()), "top-1 max": float(top1.max()),
                     "top-5 mean": float(top5.mean()), "top-5 sd": float(top5.std()) if len(top5) > 1 else 0.0,
                     "top-5 min": float(top5.min()), "top-5 max": float(top5.max())})
    rows.append({"method": "deterministic argmax ŷ", "N_inner": 0, "N_outer": 1,
                 "top-1 mean": deterministic["top-1"], "top-1 sd": 0.0, "top-1 min": deterministic["top-1"], "top-1 max": deterministic["top-1"],
                 "top-5 mean": deterministic["top-5"], "top-5 sd": 0.0, "top-5 min": deterministic["top-5"], "top-5 max": deterministic["top-5"]})
    table = pd.DataFrame(rows)
    tables = write_table(table.set_index(["method", "N_inner"]), run_dir, "prediction",
                         caption=f"Top-1/top-5 test accuracy, Monte Carlo ({cfg.evaluation.total_samples} samples per image) vs deterministic",
                         )
    timing = pd.DataFrame(
        [{"method": "deterministic argmax ŷ", "N_inner": 0, "ms / image": 1e3 * deterministic_seconds, "MC / deterministic": 1.0}]
        + [{"method": "Monte Carlo", "N_inner": n, "ms / image": 1e3 * s, "MC / deterministic": s / deterministic_seconds}
           for n, s in mc_seconds.items()]
    )
    tables.update(write_table(timing.set_index(["method", "N_inner"]), run_dir, "timing",
                              caption="Prediction time per image (one outer trial for Monte Carlo)"))
    log.info("prediction on %d test images:\n%s\n%s", len(y), table.to_markdown(index=False), timing.to_markdown(index=False))
    figures = {"prediction": _plot(table, deterministic, run_dir / "prediction.png")}
    metrics = {"deterministic/top1": deterministic["top-1"], "deterministic/top5": deterministic["top-5"],
               "deterministic/ms_per_image": 1e3 * deterministic_seconds, "test_images": len(y)}
    metrics.update({f"calibration/{k}": v for k, v in calibration.items()})
    for row in rows[:-1]:
        n = row["N_inner"]
        metrics[f"monte_carlo/N{n}/top1_mean"] = row["top-1 mean"]
        metrics[f"monte_carlo/N{n}/top1_sd"] = row["top-1 sd"]
        metrics[f"monte_carlo/N{n}/top5_mean"] = row["top-5 mean"]
        metrics[f"monte_carlo/N{n}/ms_per_image"] = 1e3 * mc_seconds[n]
        metrics[f"monte_carlo/N{n}/speed_ratio_mc_over_deterministic"] = mc_seconds[n] / deterministic_seconds
    return {"metrics": metrics, "tables": tables, "figures": figures}


# ----------------------------------------------------------------------------- run


def supports_distributed(cfg: DictConfig) -> bool:
    """Feature extraction and head training run under torchrun (``distributed.nproc``)."""
    return True


def run(cfg: DictConfig, run_dir) -> dict:
    run_dir = Path(run_dir)
    validate(cfg)
    device = resolve_device(cfg.device)
    computed = compute_features(cfg, device)
    (x_train, y_train, skipped_train), (x_held, y_held, skipped_held) = computed["train"], computed["held_out"]
    metrics = {"features/train_images": len(y_train), "features/held_out_images": len(y_held),
               "features/skipped_unreadable_images": skipped_train + skipped_held, "features/dim": x_train.shape[1]}
    result = {"metrics": metrics, "tables": {}, "figures": {}, "device": device}
    log.info("features: %d train, %d held-out images, %d dims (%s); %d unreadable skipped", len(y_train), len(y_held),
             x_train.shape[1], computed["folder"], skipped_train + skipped_held)
    if cfg.stage == "features":
        return result
    if cfg.trainer.batch_size > len(y_train):
        raise ConfigError(f"trainer.batch_size={cfg.trainer.batch_size} exceeds the {len(y_train)} training images; lower it")
    test_index, val_index = split_held_out(x_held, y_held, cfg.split.validation_fraction, cfg.split.seed)
    # standardize by the training features (ResNet features are >= 0 and of uneven scale)
    mean = x_train.float().mean(0)
    std = x_train.float().std(0).clamp(min=1e-6)

    def prepare(x):
        return ((x.float() - mean) / std).to(device)

    data = {"x_train": prepare(x_train), "y_train": y_train.to(device), "x_val": prepare(x_held[val_index]),
            "y_val": y_held[val_index].to(device), "x_test": prepare(x_held[test_index]), "y_test": y_held[test_index].to(device),
            "num_classes": computed["num_classes"]}
    with validate_args(False):
        if cfg.stage in ("train", "all"):
            trained = train_head(cfg, data, run_dir, device)
            metrics["train/best_epoch"] = trained["best"]["epoch"]
            metrics["train/best_val_top1"] = trained["best"]["value"]
        if cfg.stage in ("evaluate", "all") and distributed.is_main():  # evaluation is cheap: rank 0 alone
            model = load_head(cfg, data, run_dir, device)
            evaluated = evaluate(cfg, model, data, run_dir, device)
            metrics.update(evaluated["metrics"])
            result["tables"], result["figures"] = evaluated["tables"], evaluated["figures"]
    return result
