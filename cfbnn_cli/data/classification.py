"""Tables whose target is a class label: a user's CSV (labels may be text) or one of
scikit-learn's bundled sets (offline), as a :class:`ClassificationTable` in original units;
:meth:`ClassificationTable.split` standardizes the features by the training rows."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import torch

from ..runtime.errors import ConfigError, DataError
from .cells import canonical_cells, sorted_levels
from .layout import InputLayout
from .options import table_options
from .standardize import check_finite_columns, column_statistics, standardize_columns
from .tabular import read_table

log = logging.getLogger(__name__)
BUNDLED = ("digits", "wine", "breast_cancer", "iris")
CLASSIFICATION_DATA = BUNDLED + ("csv",)


@dataclass
class ClassificationSplit:
    """Standardized features (float32) and class indices of a train/test split, with the scaling."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    feature_mean: np.ndarray
    feature_std: np.ndarray


@dataclass
class ClassificationTable:
    name: str
    x: np.ndarray  # (N, D) float64
    labels: np.ndarray  # (N,) the label text
    columns: Optional[List[str]]
    target: str
    classes: List[str] = field(default_factory=list)  # index k = class k
    layout: Optional[InputLayout] = None  # a CSV's: how a model reads a table

    def __post_init__(self):
        # labels are compared as numbers where they are numbers: 1, 1.0 and 01 are one class, `1`
        canonical, merged = canonical_cells(self.labels)
        if merged:
            log.warning(
                "data `%s`: labels of `%s` that are the same number written differently are one class: %s",
                self.name,
                self.target,
                "; ".join(f"{', '.join(found)} -> {name}" for name, found in sorted(merged.items())[:20]),
            )
        self.labels = canonical.astype(str)
        self.classes = sorted_levels(self.labels.tolist())
        if len(self.classes) < 2:
            raise DataError(
                f"data `{self.name}`: the label column `{self.target}` has one class ({self.classes[0]!r}); "
                "nothing to classify"
            )
        lookup = {name: k for k, name in enumerate(self.classes)}
        self.y = np.fromiter((lookup[label] for label in self.labels.tolist()), dtype=np.int64, count=len(self.labels))

    def split(self, train, test) -> ClassificationSplit:
        mean, std = column_statistics(self.x[train])
        std[std == 0] = 1.0  # constant columns carry no information; keep them finite

        def features(rows):
            values = standardize_columns(self.x[rows], mean, std).astype(np.float32)
            check_finite_columns(values, f"data `{self.name}`", self.columns, "feature column")
            return torch.as_tensor(values)

        return ClassificationSplit(
            features(train),
            torch.as_tensor(self.y[train]),
            features(test),
            torch.as_tensor(self.y[test]),
            np.asarray(mean, dtype=np.float64).reshape(-1),
            np.asarray(std, dtype=np.float64).reshape(-1),
        )


def load_classification_table(cfg) -> ClassificationTable:
    """The table ``cfg`` (the ``data`` group of ``cfbnn train classification``) names."""
    name = cfg.name
    if name == "csv":
        if not cfg.path or not cfg.target:
            raise ConfigError("data=csv needs data.path=/path/to/file.csv and data.target=<label column>")
        options = table_options(cfg)
        if options.pop("target_transform") != "none":
            raise ConfigError("data.target_transform is for regression; class labels are not transformed")
        table = read_table(cfg.path, str(cfg.target), labels=True, **options)
        for note in table.notes:
            log.info("%s: %s", cfg.path, note)
        return ClassificationTable(table.name, table.x, table.y, table.columns, table.target, layout=table.layout)
    if name in BUNDLED:
        import sklearn.datasets

        bunch = getattr(sklearn.datasets, f"load_{name}")()
        names = [str(n) for n in bunch.target_names] if len(bunch.target_names) else None
        labels = np.asarray([names[k] if names else str(k) for k in bunch.target])
        columns = [str(c) for c in bunch.feature_names] if getattr(bunch, "feature_names", None) is not None else None
        return ClassificationTable(name, bunch.data.astype(np.float64), labels, columns, "class")
    raise ConfigError(f"data.name={name!r} is not one of {CLASSIFICATION_DATA}")
