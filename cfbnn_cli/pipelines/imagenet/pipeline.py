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
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from ...bnn.network import BayesianNetwork, bayesian_head
from ...data.images import load_image_datasets
from ...moments import ACTIVATIONS, validate_args
from ...run_values import RunValues, parse_run_values
from ...runtime import distributed
from ...runtime.checkpoints import load_model_weights
from ...runtime.checks import (
    require_bool,
    require_choice,
    require_int,
    require_positive_float,
    require_present_bounds,
    require_widths,
)
from ...runtime.errors import CheckpointError, ConfigError
from ...runtime.seed import seed_everything
from ...train import loop_from_config, optimizers
from . import features as feature_cache
from .head_file import HEAD_FILE, HEAD_FORMAT, load_saved_head, save_head  # noqa: F401 (their public home)
from .prediction import batched, evaluate, top_k_correct

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
    if len(require_widths(cfg, "model.hidden_sizes", example="[1000,1000]")) != 2:
        raise ConfigError(
            f"model.hidden_sizes={list(cfg.model.hidden_sizes)} must be two positive widths [ML layer, "
            "Bayesian layer], e.g. [1000,1000]"
        )
    require_present_bounds(
        cfg,
        {
            "data.n_train": 1,
            "data.n_held_out": 2,
            "data.num_classes": 2,
            "data.image_size_raw": 1,
            "data.image_size": 1,
            "data.resize": 1,
            "data.train_size": 1,
        },
        fractions=["data.train_fraction"],
        seeds=["data.seed", "split.seed"],
    )
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
    require_int(cfg, "evaluation.top_k", minimum=2)
    require_int(cfg, "evaluation.batch_size", minimum=1)
    require_int(cfg, "evaluation.timing_images", minimum=1)
    require_bool(cfg, "evaluation.paper_head_timing")
    require_int(cfg, "features.batch_size", minimum=1)
    require_int(cfg, "features.shard_size", minimum=1)
    fraction = OmegaConf.select(cfg, "split.validation_fraction")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ConfigError(
            f"split.validation_fraction={fraction!r} must be strictly between 0 and 1 (paper: 0.2 = 10k of 50k)"
        )


# ----------------------------------------------------------------------------- stages


def compute_features(cfg, device):
    """Train and held-out features (cached), and the number of skipped (unreadable) images."""
    backbone, description = feature_cache.build_backbone(cfg.backbone.name, cfg.backbone.get("weights"), device)
    train_set, held_out_set, num_classes = load_image_datasets(cfg.data, cfg.backbone.name)
    fields = {"data": cfg.data.name, **OmegaConf.to_container(cfg.data, resolve=True), **description}
    folder = feature_cache.cache_folder(cfg.features.cache_dir, fields)
    kwargs = dict(
        device=device,
        batch_size=cfg.features.batch_size,
        shard_size=cfg.features.shard_size,
        num_workers=cfg.features.get("num_workers", 0),
        num_classes=num_classes,
    )
    train = feature_cache.extract(train_set, "train", backbone, folder, fields, **kwargs)
    held_out = feature_cache.extract(held_out_set, "held_out", backbone, folder, fields, **kwargs)
    if train[0].shape[1] != held_out[0].shape[1]:
        raise CheckpointError(
            f"the feature cache {folder} holds train features of width {train[0].shape[1]} and "
            f"held-out features of width {held_out[0].shape[1]}; delete the folder to extract again"
        )
    return {"train": train, "held_out": held_out, "num_classes": num_classes, "folder": folder}


def split_held_out(features, labels, validation_fraction: float, seed: int):
    """``(test, validation)`` index arrays of the held-out images (paper: 40k / 10k)."""
    order = np.random.default_rng(seed).permutation(len(labels))
    n_val = max(1, int(round(validation_fraction * len(labels))))
    if len(labels) - n_val < 1:
        raise ConfigError(f"split.validation_fraction={validation_fraction} leaves no test images of {len(labels)}")
    return torch.as_tensor(np.sort(order[n_val:])), torch.as_tensor(np.sort(order[:n_val]))


def build_head(cfg, data, generator=None):
    return bayesian_head(
        data["x_train"].shape[1],
        list(cfg.model.hidden_sizes),
        data["num_classes"],
        cfg.model.activation,
        cfg.model.prior_scale,
        cfg.model.init_scale,
        generator,
        objective=cfg.objective,
    )


def train_head(cfg, data, run_dir: Path, device) -> Dict:
    generator = seed_everything(cfg.seed)
    x, y = data["x_train"], data["y_train"]
    model = build_head(cfg, data, generator).to(device)
    optimizer = optimizers.adam(model.parameters(), lr=cfg.trainer.lr)
    # each rank draws its own logit samples; the data order is shared (same seed everywhere)
    sampler = torch.Generator(device=device).manual_seed(cfg.seed + 1 + 1000 * distributed.rank())
    num_data = len(y)

    def loss(rows):  # the negative ELBO per training image; DDP averages the gradients over ranks
        ell = loop.trained(
            x[rows], y[rows], estimator="analytic", generator=sampler, num_samples=cfg.trainer.num_samples
        )
        return -(num_data / rows.numel() * ell - model.kl()) / num_data

    @torch.no_grad()
    def validation_accuracy(epoch):
        means = torch.cat([m for m, _ in batched(model.output_moments, data["x_val"], cfg.evaluation.batch_size)])
        return {"val_top1": float(top_k_correct(means, data["y_val"], 1).double().mean())}

    options = dict(
        evaluate=validation_accuracy,
        select=("val_top1", "max"),
        best_payload=lambda: {"sizes": _sizes(data)},
        label=f"head ({cfg.objective})",
    )
    loop = loop_from_config(cfg, run_dir, model, optimizer, loss, num_data, device, generator, sampler, **options)
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
    load_model_weights(
        model,
        path,
        device,
        "trained head",
        hint=f"; was it trained with other sizes than model.hidden_sizes={list(cfg.model.hidden_sizes)} "
        "and these features?",
    )
    return model.eval()


# ----------------------------------------------------------------------------- run


def supports_distributed(cfg: DictConfig) -> bool:
    """Feature extraction and head training run under torchrun (``distributed.nproc``)."""
    return True


def run(cfg: DictConfig, run_dir, values: Optional[RunValues] = None) -> dict:
    run_dir = Path(run_dir)
    validate(cfg)
    values = values or parse_run_values(cfg)  # the typed values (the CLI passes them)
    device = values.device
    computed = compute_features(cfg, device)
    (x_train, y_train, skipped_train), (x_held, y_held, skipped_held) = computed["train"], computed["held_out"]
    metrics = {
        "features/train_images": len(y_train),
        "features/held_out_images": len(y_held),
        "features/skipped_unreadable_images": skipped_train + skipped_held,
        "features/dim": x_train.shape[1],
    }
    result = {"metrics": metrics, "tables": {}, "figures": {}, "device": device}
    log.info(
        "features: %d train, %d held-out images, %d dims (%s); %d unreadable skipped",
        len(y_train),
        len(y_held),
        x_train.shape[1],
        computed["folder"],
        skipped_train + skipped_held,
    )
    if cfg.stage == "features":
        return result
    top_k, num_classes = cfg.evaluation.top_k, computed["num_classes"]
    if cfg.stage in ("evaluate", "all") and top_k >= num_classes:
        raise ConfigError(
            f"evaluation.top_k={top_k} must be below the {num_classes} classes of data={cfg.data.name} "
            f"(top-{num_classes} accuracy is 1); e.g. evaluation.top_k={max(2, num_classes // 3)}"
        )
    if cfg.stage in ("evaluate", "all") and 2 * top_k > num_classes:
        log.warning(
            "evaluation.top_k=%d is more than half of the %d classes: top-%d accuracy will be near 1 for any "
            "prediction",
            top_k,
            num_classes,
            top_k,
        )
    if cfg.trainer.batch_size > len(y_train):
        raise ConfigError(
            f"trainer.batch_size={cfg.trainer.batch_size} exceeds the {len(y_train)} training images; lower it"
        )
    test_index, val_index = split_held_out(x_held, y_held, cfg.split.validation_fraction, cfg.split.seed)
    # standardize by the training features (ResNet features are >= 0 and of uneven scale)
    mean = x_train.float().mean(0)
    std = x_train.float().std(0).clamp(min=1e-6)

    def prepare(x):
        return ((x.float() - mean) / std).to(device)

    data = {
        "x_train": prepare(x_train),
        "y_train": y_train.to(device),
        "x_val": prepare(x_held[val_index]),
        "y_val": y_held[val_index].to(device),
        "x_test": prepare(x_held[test_index]),
        "y_test": y_held[test_index].to(device),
        "num_classes": computed["num_classes"],
    }
    with validate_args(False):
        if cfg.stage in ("train", "all"):
            trained = train_head(cfg, data, run_dir, device)
            metrics["train/best_epoch"] = trained["best"]["epoch"]
            metrics["train/best_val_top1"] = trained["best"]["value"]
        if cfg.stage in ("evaluate", "all") and distributed.is_main():  # evaluation is cheap: rank 0 alone
            model = load_head(cfg, data, run_dir, device)
            # the head and its feature scaling, for `cfbnn predict RUN_DIR NEW_FEATURES.npy`
            save_head(run_dir, model, cfg, data["x_train"].shape[1], data["num_classes"], mean, std)
            evaluated = evaluate(cfg, model, data, run_dir, device)
            metrics.update(evaluated["metrics"])
            result["tables"], result["figures"] = evaluated["tables"], evaluated["figures"]
            result["main_table"] = "prediction.md"
    return result
