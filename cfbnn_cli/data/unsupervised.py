"""Unsupervised continuous data for the VAE: digits (embedded), a synthetic latent
model, YearPredictionMSD's 90 features, Fashion-MNIST's pixels and Fashion-MNIST on its
first 90 principal components (a stand-in shaped like MSD's 90 continuous features).

Every loader returns :class:`UnsupervisedData`: rows split at random (from the seed)
into train / test / validation in the proportions 7:2:1 (paper), each column
standardized by the training rows; ``log_scale`` (the sum of the log standard
deviations) converts a log-density of standardized rows back to original units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict

import numpy as np
import torch

from ..runtime.errors import ConfigError, DataError
from .regression import read_year_prediction_msd
from .standardize import check_finite_columns, column_statistics, standardize_columns

FASHION_MNIST_SCRIPT = "python data_scripts/prepare_fashion_mnist.py"
FASHION_MNIST_FILES = ("train-images-idx3-ubyte", "t10k-images-idx3-ubyte")


@dataclass
class UnsupervisedData:
    name: str
    x_train: torch.Tensor
    x_val: torch.Tensor
    x_test: torch.Tensor
    log_scale: float  # sum_d log std_d: log p(x_original) = log p(x_standardized) - log_scale
    details: Dict[str, float] = field(default_factory=dict)  # numbers about the data for results.json

    @property
    def dim(self) -> int:
        return self.x_train.shape[1]


def split_rows(name: str, n: int, seed: int, fractions=(0.7, 0.2, 0.1)):
    """Row indices ``(train, test, validation)`` of a random split of ``n`` rows in ``fractions``
    (paper 7:2:1), drawn from ``seed``."""
    n_test = int(round(fractions[1] * n))
    n_val = int(round(fractions[2] * n))
    n_train = n - n_test - n_val
    if n_train < 2 or n_test < 1 or n_val < 1:
        raise DataError(f"data `{name}` has {n} rows: too few for a 7:2:1 train/test/validation split")
    order = np.random.default_rng(seed).permutation(n)
    return order[:n_train], order[n_train : n_train + n_test], order[n_train + n_test :]


def split_and_standardize(
    name: str, x: np.ndarray, seed: int, fractions=(0.7, 0.2, 0.1), std_floor=None
) -> UnsupervisedData:
    """Random train/test/validation split in ``fractions`` (paper 7:2:1), standardized by train.

    ``std_floor``: None, a number in ``x``'s units, or ``"pooled"`` (the standard deviation of
    all training values together); each column is divided by the larger of its own standard
    deviation and the floor, so no test value lies more than ``range / floor`` standard
    deviations from its column's training mean."""
    train, test, val = split_rows(name, len(x), seed, fractions)
    return _standardized(name, x, train, test, val, std_floor)


def _standardized(name, x, train, test, val, std_floor=None) -> UnsupervisedData:
    mean, std = column_statistics(x[train])
    if std_floor is not None:
        std = np.maximum(std, pooled_std(x[train]) if std_floor == "pooled" else float(std_floor))
    std[std == 0] = 1.0  # a constant column (e.g. a blank pixel) carries nothing; keep it finite

    def tensor(rows):
        values = standardize_columns(x[rows], mean, std)
        check_finite_columns(values, f"data `{name}`")
        values = torch.as_tensor(np.ascontiguousarray(values), dtype=torch.float32)
        check_finite_columns(values.numpy(), f"data `{name}`")
        return values

    return UnsupervisedData(name, tensor(train), tensor(val), tensor(test), float(np.log(std).sum()))


def pooled_std(x: np.ndarray) -> float:
    """The standard deviation of all values of ``x`` together (``ddof=0``): an image channel's
    one scale, as per-channel normalization uses (Fashion-MNIST's training pixels: 0.353)."""
    x = np.asarray(x, dtype=np.float64)
    return float(np.sqrt(((x - x.mean()) ** 2).mean()))


def principal_components(x: np.ndarray, components: int):
    """``(mean, basis (D, components), variance kept)`` of the principal components of the rows
    ``x``: the eigenvectors of their covariance with the largest eigenvalues, each signed so that
    its largest loading is positive (the projection then does not depend on the LAPACK build);
    ``variance kept`` is their share of the total variance."""
    x = np.asarray(x, dtype=np.float64)
    if not 1 <= components <= x.shape[1]:
        raise ConfigError(f"data.components={components} must be between 1 and the data's {x.shape[1]} columns")
    mean = x.mean(0)
    centred = x - mean
    eigenvalues, vectors = np.linalg.eigh(centred.T @ centred / len(x))
    order = np.argsort(eigenvalues)[::-1][:components]
    basis = vectors[:, order]
    basis = basis * np.sign(basis[np.abs(basis).argmax(0), np.arange(components)])
    total = eigenvalues.clip(min=0).sum()
    return mean, basis, float(eigenvalues[order].clip(min=0).sum() / total) if total > 0 else 1.0


def principal_component_split(name: str, x: np.ndarray, seed: int, components: int) -> UnsupervisedData:
    """The rows of ``x`` split 7:2:1 (as :func:`split_and_standardize`), projected onto the
    ``components`` principal components of the *training* rows, and each component standardized
    by the training rows. The standardized components are the data: ``log_scale`` is 0, so a
    log-density is per row of standardized components (as for features given standardized);
    ``details["pca_variance_kept"]`` is the share of the training rows' variance they keep."""
    train, test, val = split_rows(name, len(x), seed)
    mean, basis, kept = principal_components(x[train], components)
    data = _standardized(name, (np.asarray(x, dtype=np.float64) - mean) @ basis, train, test, val)
    data.log_scale = 0.0
    data.details["pca_variance_kept"] = kept
    return data


def synthetic_latent(dim=90, rows=5000, latent_dim=5, hidden=50, noise_std=0.5, seed=0) -> np.ndarray:
    """Rows ``x = tanh(z W1) W2 + noise`` with ``z ~ N(0, I_latent)``: a nonlinear latent model."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((rows, latent_dim))
    w1 = rng.standard_normal((latent_dim, hidden)) / math.sqrt(latent_dim) * 2.0
    w2 = rng.standard_normal((hidden, dim)) / math.sqrt(hidden)
    return np.tanh(z @ w1) @ w2 + noise_std * rng.standard_normal((rows, dim))


def fashion_mnist_pixels(root) -> np.ndarray:
    """All 70,000 Fashion-MNIST images as ``(70000, 784)`` floats in [0, 1] (labels unused)."""
    return fashion_mnist_arrays(root)[0]


def fashion_mnist_arrays(root):
    """``(pixels (70000, 784) in [0, 1], labels (70000,), n_train)``: the ``n_train`` (60k) training
    images first, then the 10k test ones.

    Reads torchvision's layout ``<root>/FashionMNIST/raw/`` (prepared from Debian's
    ``dataset-fashion-mnist`` by ``data_scripts/prepare_fashion_mnist.py``).
    """
    raw = Path(root) / "FashionMNIST" / "raw"
    missing = [name for name in FASHION_MNIST_FILES if not (raw / name).is_file()]
    if missing:
        raise DataError(
            f"Fashion-MNIST not found: {', '.join(str(raw / m) for m in missing)} missing. Install it with "
            f"`apt-get install dataset-fashion-mnist` and run `{FASHION_MNIST_SCRIPT} --out {root}`, "
            f"or set data.root=<a folder holding FashionMNIST/raw>"
        )
    from torchvision.datasets import FashionMNIST

    parts, labels = [], []
    for train in (True, False):
        try:
            dataset = FashionMNIST(str(root), train=train, download=False)
        except Exception as error:  # torchvision raises RuntimeError/ValueError on a truncated file
            raise DataError(
                f"Fashion-MNIST files under {raw} could not be read ({error}); re-run `{FASHION_MNIST_SCRIPT}`"
            ) from error
        parts.append(dataset.data.reshape(dataset.data.shape[0], -1).numpy().astype(np.float64) / 255.0)
        labels.append(dataset.targets.numpy())
    return np.concatenate(parts), np.concatenate(labels), len(labels[0])


SUBSET_SEED = 0


def nested_subset(x: np.ndarray, rows: int, key: str) -> np.ndarray:
    """The first ``rows`` rows of one fixed random order of ``x`` (``SUBSET_SEED``, whatever the
    run's seed): every seed sees the same rows, and a smaller subset lies inside a larger one,
    so results at two sizes differ by the rows added, not by a redraw."""
    if rows > len(x):
        raise ConfigError(f"{key}={rows} exceeds the {len(x)} rows of the data; lower it or set {key}=null (all)")
    order = np.random.default_rng(SUBSET_SEED).permutation(len(x))
    return x[np.sort(order[:rows])]


def load_unsupervised_data(cfg) -> UnsupervisedData:
    """Dispatch on ``cfg.name`` (a ``conf/vae/data/`` option); ``cfg.seed`` draws the 7:2:1 split."""
    name = cfg.name
    if name == "digits":
        from sklearn.datasets import load_digits

        return split_and_standardize("digits", load_digits().data.astype(np.float64), cfg.seed)
    if name == "synthetic":
        x = synthetic_latent(cfg.input_dim, cfg.rows, cfg.latent_dim, cfg.teacher_hidden, cfg.noise_std, cfg.seed)
        return split_and_standardize("synthetic", x, cfg.seed)
    if name == "year_prediction_msd":
        return split_and_standardize(
            "year_prediction_msd", read_year_prediction_msd(cfg.path, cfg.expected_rows)[:, 1:], cfg.seed
        )
    if name in ("fashion_mnist", "fashion_mnist_pca90"):
        pixels = fashion_mnist_pixels(cfg.root)
        rows = cfg.get("rows")
        if rows is not None:
            pixels = nested_subset(pixels, int(rows), "data.rows")
        if name == "fashion_mnist_pca90":
            return principal_component_split(name, pixels, cfg.seed, int(cfg.components))
        return split_and_standardize(name, pixels, cfg.seed, std_floor=cfg.get("std_floor"))
    raise ConfigError(
        f"data.name={name!r} is not one of digits, synthetic, year_prediction_msd, fashion_mnist, "
        "fashion_mnist_pca90 (for the VAE)"
    )
