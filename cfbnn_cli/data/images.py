"""Labelled images for `cfbnn imagenet-predict`: ImageNet (torchvision layout), Fashion-MNIST,
scikit-learn's digits (embedded) and torchvision's FakeData (tests).

Every source gives two datasets, ``train`` and ``held_out`` (ImageNet's official
validation images, which the pipeline splits into test and validation as the paper
does). Items are ``(image, label, ok)``: a file that cannot be decoded yields a zero
image with ``ok = False`` so that extraction can skip and count it instead of
crashing (this works with DataLoader workers too).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from ..runtime.errors import ConfigError, DataError
from .unsupervised import fashion_mnist_arrays

log = logging.getLogger(__name__)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def image_transform(image_size: int, resize: int, channels: int = 3):
    """The paper's fixed preprocessing: resize, center crop, ImageNet normalization (no augmentation)."""
    from torchvision import transforms

    steps = [transforms.Resize(resize), transforms.CenterCrop(image_size)]
    if channels == 1:
        steps.append(transforms.Grayscale(num_output_channels=3))
    steps += [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    return transforms.Compose(steps)


class SafeImages(Dataset):
    """Wrap a dataset of ``(PIL or tensor image, label)``; a failing item becomes ``(zeros, label, False)``."""

    def __init__(self, dataset, shape, describe=None):
        self.dataset = dataset
        self.shape = tuple(shape)
        self.describe = describe or (lambda index: f"item {index}")

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        try:
            image, label = self.dataset[index]
            return image, int(label), True
        except Exception as error:  # a corrupt or unreadable file: skip it, do not stop the extraction
            log.warning("skipping %s: %s", self.describe(index), error)
            return torch.zeros(self.shape), -1, False


class TensorImages(Dataset):
    """In-memory images ``(N, C, H, W)`` in [0, 1] and labels, with an optional transform on PIL images."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform=None):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.images[index]
        if self.transform is not None:
            from torchvision.transforms.functional import to_pil_image

            image = self.transform(to_pil_image(image))
        return image, int(self.labels[index])


def training_subset(labels: torch.Tensor, size, seed: int) -> np.ndarray:
    """Row indices of a class-balanced random subset of ``size`` training images (all rows when
    ``size`` is null): classes take turns in a seeded random order, so every class gets
    ``size // classes`` or one more image (fewer only when a class runs out)."""
    labels = np.asarray(labels)
    if size is None:
        return np.arange(len(labels))
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"data.train_size={size!r} must be a positive number of training images or null (all)")
    if size > len(labels):
        raise ConfigError(f"data.train_size={size} exceeds the {len(labels)} training images; lower it or set null")
    rng = np.random.default_rng(seed)
    queues = [list(rng.permutation(np.flatnonzero(labels == c))) for c in np.unique(labels)]
    chosen = []
    while len(chosen) < size:
        for queue in queues:
            if queue and len(chosen) < size:
                chosen.append(queue.pop(0))
    return np.sort(np.asarray(chosen))


def _digits(cfg, transform):
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.as_tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)  # (1797, 1, 8, 8) in [0, 1]
    labels = torch.as_tensor(digits.target)
    order = np.random.default_rng(cfg.seed).permutation(len(labels))
    n_train = int(round(cfg.train_fraction * len(labels)))
    train, held_out = order[:n_train], order[n_train:]
    train = train[training_subset(labels[train], cfg.get("train_size"), cfg.seed)]
    make = lambda rows: TensorImages(images[rows], labels[rows], transform)  # noqa: E731
    return make(train), make(held_out), 10


def _fashion_mnist(cfg, transform):
    # checks the files and names the install step when they are missing
    pixels, labels, n_train = fashion_mnist_arrays(cfg.root)
    images = torch.as_tensor(pixels, dtype=torch.float32).view(-1, 1, 28, 28)
    labels = torch.as_tensor(labels)
    train = torch.as_tensor(training_subset(labels[:n_train], cfg.get("train_size"), cfg.get("seed", 0)))
    return (
        TensorImages(images[train], labels[train], transform),
        TensorImages(images[n_train:], labels[n_train:], transform),
        10,
    )


def _imagenet(cfg, transform):
    from torchvision.datasets import ImageFolder

    root = Path(cfg.root or "")
    folders = [root / "train", root / "val"]
    missing = [str(f) for f in folders if not f.is_dir()]
    if not cfg.root or missing:
        raise DataError(
            f"ImageNet not found: {', '.join(missing) or 'data.root is not set'}. Set data.root to a folder holding "
            "train/<wnid>/*.JPEG and val/<wnid>/*.JPEG (torchvision's ImageFolder layout; "
            "torchvision.datasets.ImageNet(root, split=...) prepares it from the official archives)"
        )
    train, held_out = (ImageFolder(str(f), transform=transform) for f in folders)
    return train, held_out, len(train.classes)


def _fake(cfg, transform):
    from torchvision.datasets import FakeData

    size = cfg.image_size_raw
    classes = cfg.num_classes
    make = lambda n, seed: FakeData(n, (3, size, size), classes, transform=transform, random_offset=seed)  # noqa: E731
    return make(cfg.n_train, 0), make(cfg.n_held_out, 10_000), classes


def load_image_datasets(cfg, backbone: str) -> Tuple[Dataset, Dataset, int]:
    """``(train, held_out, num_classes)`` for ``cfg.name``; items ``(image, label, ok)``.

    With ``backbone=identity`` images stay at their own size (raw pixels become the
    features); with ``resnet50`` they get the paper's fixed resize/crop/normalization.
    """
    name = cfg.name
    loaders = {
        "digits": (_digits, 1),
        "fashion_mnist": (_fashion_mnist, 1),
        "imagenet": (_imagenet, 3),
        "fake": (_fake, 3),
    }
    if name not in loaders:
        raise ConfigError(f"data.name={name!r} is not one of {sorted(loaders)} (for imagenet-predict)")
    loader, channels = loaders[name]
    transform = None
    shape = None
    if backbone == "resnet50":
        size = int(cfg.image_size)
        transform = image_transform(size, int(cfg.resize), channels)
        shape = (3, size, size)
    elif name in ("imagenet", "fake"):
        from torchvision import transforms

        transform = transforms.ToTensor()
    train, held_out, num_classes = loader(cfg, transform)
    if shape is None:
        shape = tuple(train[0][0].shape)

    def describe(dataset):
        samples = getattr(dataset, "samples", None)
        return (lambda index: samples[index][0]) if samples is not None else (lambda index: f"item {index}")

    return SafeImages(train, shape, describe(train)), SafeImages(held_out, shape, describe(held_out)), num_classes
