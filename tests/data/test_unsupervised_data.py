"""data/unsupervised.py: the VAE's data sets, their split and standardization, Fashion-MNIST intake."""

import gzip
import math
import struct

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from cfbnn_cli.data.unsupervised import fashion_mnist_pixels, load_unsupervised_data, split_and_standardize
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
