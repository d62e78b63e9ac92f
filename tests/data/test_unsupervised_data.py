"""data/unsupervised.py: the VAE's data sets, their split and standardization, Fashion-MNIST intake."""

import gzip
import math
import struct

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from cfbnn_cli.data.unsupervised import (
    fashion_mnist_pixels,
    load_unsupervised_data,
    principal_component_split,
    principal_components,
    split_and_standardize,
    split_rows,
)
from cfbnn_cli.runtime.errors import ConfigError, DataError


def test_data_without_a_vae_loader_is_rejected():
    with pytest.raises(ConfigError, match="data.name='csv' is not one of digits"):
        load_unsupervised_data(OmegaConf.create({"name": "csv"}))


def test_split_is_seven_two_one_and_standardized_by_train():
    x = np.random.default_rng(0).normal(3.0, 2.0, size=(1000, 5))
    data = split_and_standardize("x", x, seed=0)
    assert (len(data.x_train), len(data.x_test), len(data.x_val)) == (700, 200, 100)
    torch.testing.assert_close(data.x_train.mean(0), torch.zeros(5), atol=1e-5, rtol=0)
    assert data.log_scale == pytest.approx(5 * math.log(2.0), abs=0.2)  # sum of log standard deviations


def test_std_floor_bounds_how_far_out_a_test_value_can_lie():
    # column 0 is 0 in every row but one (s.d. ~0.03 over the rows); column 1 spreads over [0, 1]
    rng = np.random.default_rng(0)
    x = np.stack([np.zeros(1000), rng.uniform(0, 1, 1000)], axis=1)
    train, test, _ = split_rows("x", 1000, seed=0)
    x[test[0], 0] = 1.0  # ink where the training rows have none
    x[train[0], 0] = 1.0  # one training row with ink: s.d. sqrt(1/700 - 1/700^2) = 0.0378
    plain = split_and_standardize("x", x, seed=0)
    assert plain.x_test[0, 0] == pytest.approx((1 - 1 / 700) / math.sqrt(1 / 700 - 1 / 700**2), rel=1e-5)  # 26.4
    floored = split_and_standardize("x", x, seed=0, std_floor=0.25)
    assert floored.x_test[0, 0] == pytest.approx((1 - 1 / 700) / 0.25, rel=1e-5)  # the floor, not the column's s.d.
    # column 1's s.d. (uniform on [0, 1]: 0.289) is above the floor, so it keeps its own
    torch.testing.assert_close(floored.x_test[:, 1], plain.x_test[:, 1])
    assert floored.log_scale == pytest.approx(math.log(0.25) + math.log(float(x[train, 1].std())), rel=1e-6)
    # "pooled": the s.d. of all training values together
    pooled = split_and_standardize("x", x, seed=0, std_floor="pooled")
    assert pooled.x_test[0, 0] == pytest.approx((1 - 1 / 700) / float(x[train].std()), rel=1e-5)


def test_principal_components_recover_the_axes_of_a_known_covariance():
    # independent coordinates with variances 9, 4, 1, 0.25, rotated by a known orthogonal matrix
    rng = np.random.default_rng(1)
    rotation, _ = np.linalg.qr(rng.standard_normal((4, 4)))
    z = rng.standard_normal((200_000, 4)) * np.array([3.0, 2.0, 1.0, 0.5])
    x = z @ rotation.T + np.array([5.0, -1.0, 0.0, 2.0])
    mean, basis, kept = principal_components(x, 2)
    np.testing.assert_allclose(mean, [5.0, -1.0, 0.0, 2.0], atol=0.02)
    np.testing.assert_allclose(np.abs(basis.T @ rotation[:, :2]), np.eye(2), atol=0.01)  # the two widest axes
    assert kept == pytest.approx((9 + 4) / (9 + 4 + 1 + 0.25), abs=0.005)
    assert (basis[np.abs(basis).argmax(0), [0, 1]] > 0).all()  # each signed by its largest loading
    with pytest.raises(ConfigError, match="data.components=5 must be between 1 and the data's 4 columns"):
        principal_components(x, 5)


def test_principal_component_split_is_fitted_on_the_training_rows_only():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((500, 6)) @ rng.standard_normal((6, 6))
    data = principal_component_split("x", x, seed=3, components=3)
    assert data.dim == 3 and (len(data.x_train), len(data.x_test), len(data.x_val)) == (350, 100, 50)
    # the training rows' components: mean 0, s.d. 1, uncorrelated
    covariance = np.cov(data.x_train.double().numpy(), rowvar=False, bias=True)
    np.testing.assert_allclose(covariance, np.eye(3), atol=1e-5)
    assert data.log_scale == 0.0  # the standardized components are the data
    assert 0.5 < data.details["pca_variance_kept"] < 1
    # changing the test and validation rows changes nothing fitted: the training rows' features stay
    train, test, val = split_rows("x", 500, seed=3)
    moved = x.copy()
    moved[np.concatenate([test, val])] *= 100.0
    again = principal_component_split("x", moved, seed=3, components=3)
    torch.testing.assert_close(again.x_train, data.x_train)
    # the same affine map applied to 100 times the test rows: 100 x its old value plus one offset per column
    offset = (again.x_test - 100 * data.x_test).double()
    torch.testing.assert_close(offset, offset[:1].expand_as(offset), rtol=0, atol=2e-3)
    assert again.details == data.details


def _write_idx(path, magic, array):
    with gzip.open(path, "wb") as handle:
        handle.write(
            struct.pack(">I", magic)
            + b"".join(struct.pack(">I", n) for n in array.shape)
            + array.astype(np.uint8).tobytes()
        )


def test_fashion_mnist_prepare_script_and_loader_on_small_local_files(tmp_path):
    import importlib.util
    from pathlib import Path

    source = tmp_path / "debian"
    source.mkdir()
    rng = np.random.default_rng(0)
    for split, count in (("train", 30), ("t10k", 10)):
        _write_idx(source / f"{split}-images-idx3-ubyte.gz", 2051, rng.integers(0, 256, (count, 28, 28)))
        _write_idx(source / f"{split}-labels-idx1-ubyte.gz", 2049, rng.integers(0, 10, (count,)))
    script = Path(__file__).resolve().parents[2] / "data_scripts" / "prepare_fashion_mnist.py"
    spec = importlib.util.spec_from_file_location("prepare_fashion_mnist", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    root = tmp_path / "fashion"
    with pytest.raises(SystemExit, match="t10k-images-idx3-ubyte.gz holds 10 items, expected 10000"):
        module.main(["--source", str(source), "--out", str(root)])
    assert module.main(["--source", str(source), "--out", str(root), "--allow-subset"]) == 0
    pixels = fashion_mnist_pixels(root)
    assert pixels.shape == (40, 784) and 0 <= pixels.min() and pixels.max() <= 1
    data = load_unsupervised_data(OmegaConf.create({"name": "fashion_mnist", "root": str(root), "seed": 0}))
    assert data.dim == 784 and len(data.x_train) == 28
    # data.std_floor=pooled: no test pixel further than 1 / (the training pixels' s.d.) from its mean
    floored = load_unsupervised_data(
        OmegaConf.create({"name": "fashion_mnist", "root": str(root), "seed": 0, "std_floor": "pooled"})
    )
    train = pixels[split_rows("fashion_mnist", 40, 0)[0]]
    assert floored.x_test.abs().max() <= 1 / train.std() + 1e-5
    # the stand-in: the images on their first principal components, fitted on the training rows
    pca = load_unsupervised_data(
        OmegaConf.create({"name": "fashion_mnist_pca90", "root": str(root), "seed": 0, "components": 5})
    )
    assert pca.dim == 5 and (len(pca.x_train), len(pca.x_test), len(pca.x_val)) == (28, 8, 4)
    # by hand: the training rows' components, each standardized by the training rows
    train_rows, test_rows, _ = split_rows("fashion_mnist", 40, 0)
    _, basis, kept = principal_components(train, 5)
    projected = (pixels - train.mean(0)) @ basis
    by_hand = (projected[test_rows] - projected[train_rows].mean(0)) / projected[train_rows].std(0)
    np.testing.assert_allclose(pca.x_test.numpy(), by_hand, rtol=1e-4, atol=1e-4)
    assert pca.details["pca_variance_kept"] == pytest.approx(kept)
    # data.rows: a nested subset, the same rows for every seed
    cfg = lambda rows, seed: OmegaConf.create({"name": "fashion_mnist", "root": str(root), "seed": seed, "rows": rows})
    small = load_unsupervised_data(cfg(20, 0))
    assert len(small.x_train) + len(small.x_val) + len(small.x_test) == 20
    with pytest.raises(ConfigError, match="data.rows=41 exceeds the 40 rows"):
        load_unsupervised_data(cfg(41, 0))
    from cfbnn_cli.data.images import load_image_datasets

    train, held_out, classes = load_image_datasets(
        OmegaConf.create({"name": "fashion_mnist", "root": str(root)}), "identity"
    )
    assert (len(train), len(held_out), classes) == (30, 10, 10)  # the package's train / test files
    image, label, ok = train[0]
    assert image.shape == (1, 28, 28) and 0 <= label < 10 and ok


def test_missing_fashion_mnist_names_the_install_step(tmp_path):
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist.*prepare_fashion_mnist.py"):
        load_unsupervised_data(
            OmegaConf.create({"name": "fashion_mnist", "root": str(tmp_path / "nothing"), "seed": 0})
        )


def test_nested_subset_is_the_same_for_every_seed_and_nested_across_sizes():
    from cfbnn_cli.data.unsupervised import nested_subset

    x = np.arange(1000.0)[:, None]
    ten, twenty = nested_subset(x, 10, "data.rows"), nested_subset(x, 20, "data.rows")
    assert set(ten[:, 0]) < set(twenty[:, 0])  # a smaller subset inside a larger one
    assert len(np.unique(twenty)) == 20 and np.all(np.diff(twenty[:, 0]) > 0)  # distinct rows, in file order
    assert not np.array_equal(ten[:, 0], np.arange(10.0))  # drawn at random, not the first rows
    assert np.array_equal(nested_subset(x, 1000, "data.rows"), x)
