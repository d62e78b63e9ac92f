"""``cfbnn predict RUN_DIR NEW_FEATURES``: a finished ``imagenet-predict`` run's head on new features.

Reads the run's ``head.pt`` (:func:`cfbnn_cli.pipelines.imagenet.pipeline.save_head`) and
feature vectors of the run's backbone (``.npy``: an ``(N, D)`` array; ``.npz``: an array
``features``, or its only array; ``.csv``: a header row and ``D`` numeric columns), puts them
on the training scale, and writes ``predictions.csv`` (atomically): ``row`` (from 1),
``argmax_mean`` (the deterministic prediction ``argmax ŷ``, paper eq. (42)), then for the ``k``
most probable classes (``--top-k``, default 5) ``class_i`` and ``probability_i`` under the
variance-corrected softmax of the logits' exact moments (eq. (38); nothing is sampled).
Every problem is one line on stderr and exit code 2.
"""

from __future__ import annotations

import csv
import io
import os
import sys
from pathlib import Path

import numpy as np
import torch

from ...bnn.classification import approximate_class_probabilities
from ...data.regression import parse_numeric_rows
from ...data.tabular import decoded_lines
from ...runtime.errors import ConfigError, DataError, clip, listing
from ...runtime.io import STDOUT, atomic_write_text, remove_stale_temporary_files
from ...runtime.rundir import refuse_output_over_input
from ...runtime.safefs import describe_file, output_error, shown_path
from .head_file import HEAD_FILE, load_saved_head


def read_features(path: Path, feature_dim: int) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"{shown_path(path)}: {describe_file(path)} (the features to predict: .npy, .npz or .csv)")
    if path.suffix == ".npy":
        try:
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as error:
            raise DataError(f"{path} is not a readable .npy array ({clip(error, 200)})") from None
    elif path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as archive:
                names = list(archive.files)
                if "features" not in names and len(names) != 1:
                    raise DataError(f"{path} holds {listing(names)}: name the feature array `features`")
                array = archive["features" if "features" in names else names[0]]
        except (OSError, ValueError) as error:
            raise DataError(f"{path} is not a readable .npz archive ({clip(error, 200)})") from None
    else:
        lines = decoded_lines(path)
        if len(lines) < 2:
            raise DataError(f"{path} needs a header row and at least one row of features")
        header_width = len(next(csv.reader(lines[:1])))
        array = parse_numeric_rows(lines[1:], str(path), expected_columns=header_width, first_line=2)
    if array.ndim != 2 or array.shape[1] != feature_dim or not np.issubdtype(array.dtype, np.number):
        raise DataError(
            f"{path}: features of shape {tuple(array.shape)}; the head takes (N, {feature_dim}) numbers "
            "(the run's backbone's features)"
        )
    if array.shape[0] == 0:
        raise DataError(f"{path} holds no rows of features (shape {tuple(array.shape)}): nothing to predict")
    if not np.isfinite(array).all():
        row = int(np.argwhere(~np.isfinite(array))[0][0]) + 1
        raise DataError(f"{path}: row {row} holds a non-finite feature")
    return array.astype(np.float64)


def _rows(mask: torch.Tensor) -> str:
    """The 1-based numbers of the rows where ``mask`` holds, the first few and how many."""
    rows = (torch.nonzero(mask).reshape(-1) + 1).tolist()
    return f"{listing(rows, 5)}{f' ({len(rows):,} rows)' if len(rows) > 5 else ''}"


def _refuse_rows(mask: torch.Tensor, path: Path, what: str) -> None:
    if bool(mask.any()):
        raise DataError(
            f"{path}: row(s) {_rows(mask)} {what}: their features lie too far outside the training features' "
            "range; check those rows (features of the run's own backbone)"
        )


def predict_run(run_dir, data_path, out=None, top_k: int = 5) -> Path:
    run_dir, data_path = Path(run_dir), Path(data_path)
    if not (run_dir / "done").is_file():
        raise DataError(f"{run_dir} is not finished (no `done` file); resume it with resume=true, then predict")
    model, info = load_saved_head(run_dir / HEAD_FILE)
    a = info["architecture"]
    if top_k < 1:
        raise ConfigError(f"--top-k {top_k} must be >= 1")
    k = min(top_k, a["num_classes"])
    features = torch.as_tensor(read_features(data_path, a["feature_dim"]))
    scaling = info["scaling"]
    with np.errstate(over="ignore"):
        x = ((features - scaling["feature_mean"]) / scaling["feature_std"]).float()
    _refuse_rows(~torch.isfinite(x).all(-1), data_path, "cannot be standardized in float32")
    with torch.no_grad():
        mean, variance = model.output_moments(x, estimator="analytic", noise=())
        probabilities = approximate_class_probabilities(mean, variance)
    finite = torch.isfinite(mean).all(-1) & torch.isfinite(variance.reshape(len(x), -1)).all(-1)
    _refuse_rows(~(finite & torch.isfinite(probabilities).all(-1)), data_path, "give no finite class probabilities")
    top = probabilities.topk(k, dim=-1)
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(
        ["row", "argmax_mean"] + [f"{name}_{i}" for i in range(1, k + 1) for name in ("class", "probability")]
    )
    rows = zip(mean.argmax(-1).tolist(), top.indices.tolist(), top.values.double().tolist())
    for index, (deterministic, classes, values) in enumerate(rows, start=1):
        pairs = [item for pair in zip(classes, (repr(v) for v in values)) for item in pair]
        writer.writerow([index, deterministic] + pairs)
    out = Path(out) if out is not None else run_dir / "predictions.csv"
    if str(out) == STDOUT:
        sys.stdout.write(text.getvalue())
        return out
    if out.is_dir() or (os.path.lexists(out) and not out.is_symlink() and not out.is_file()):
        raise ConfigError(f"--out {shown_path(out)} is {describe_file(out)}; give a regular file's path")
    refuse_output_over_input(out, [("the head file", run_dir / HEAD_FILE), ("the features", data_path)], run_dir)
    try:
        remove_stale_temporary_files(out.parent, out.name)  # what a killed predict left for this output
        return atomic_write_text(out, text.getvalue())
    except OSError as error:  # the output's folder or file cannot be made or written
        message = output_error(error, out.parent, "pass --out a file in a folder you can write")
        if message is None:
            raise
        raise ConfigError(message) from None


def main(argv) -> int:
    import argparse

    from ...runtime.command_line import OneLineParser
    from ...runtime.errors import CfbnnError, one_line

    parser = OneLineParser(
        prog="cfbnn predict",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", help="a finished `cfbnn imagenet-predict` run dir (it holds head.pt)")
    parser.add_argument("data", help="features of new images: .npy, .npz or .csv, (N, feature dim)")
    parser.add_argument("--out", default=None, help="where to write the predictions (default: RUN_DIR/predictions.csv)")
    parser.add_argument("--top-k", type=int, default=5, help="how many classes per row, most probable first")
    args = parser.parse_args(list(argv))
    try:
        path = predict_run(args.run_dir, args.data, args.out, args.top_k)
    except CfbnnError as error:
        print(f"cfbnn: error: {one_line(error)}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:  # the predictions file is written whole (atomically) or not at all
        print("cfbnn: interrupted; no predictions were written", file=sys.stderr)
        return 130
    if str(path) != STDOUT:
        print(f"cfbnn: predictions in {path}")
    return 0
