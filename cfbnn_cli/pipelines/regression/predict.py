"""``cfbnn predict RUN_DIR NEW.csv``: a finished ``train regression`` run's predictive on new rows.

Reads the run's ``model.pt`` (:mod:`cfbnn_cli.pipelines.regression.model_file`), the new rows
(a numeric CSV with the training file's feature columns, in any order; the target column may
be there and is then ignored), puts them on the training scale, and writes ``predictions.csv``
(atomically) in original units: ``row`` (the file's data row, from 1), ``mean``, ``sd``,
``var_a`` and ``var_b`` (the predictive variance from the hidden layer's and from the output
layer's weights, paper eq. (44)), ``noise`` (the likelihood's) and the central 90 % interval
``lower_90``, ``upper_90``. Every problem is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np
import torch

from ...bnn.estimators import ESTIMATORS, make_estimator
from ...bnn.predictive import describe
from ...data.regression import decoded_lines, parse_numeric_rows
from ...data.standardize import check_finite_columns, standardize_columns
from ...runtime.errors import CfbnnError, ConfigError, DataError
from ...runtime.io import atomic_write_text
from .model_file import FILE_NAME, load_regression_model

HELP = __doc__.split("\n\n", 1)[1]


def _without_column(line: str, position: int) -> str:
    """A CSV line without its field at ``position`` (a line with too few fields is left for the
    parser to name)."""
    fields = next(csv.reader([line]), [])
    if len(fields) <= position:
        return line
    out = io.StringIO()
    csv.writer(out, lineterminator="").writerow(fields[:position] + fields[position + 1 :])
    return out.getvalue()


def read_feature_rows(path: Path, columns: Optional[List[str]], input_dim: int, target: str) -> np.ndarray:
    """The new rows' features ``(N, D)`` in the training file's column order."""
    if not path.is_file():
        raise DataError(f"{path}: no such file (the rows to predict, a CSV with a header row)")
    lines = decoded_lines(path)
    if not lines or not lines[0].strip():
        raise DataError(f"{path} is empty (or its first line, the header, is blank)")
    header = [name.strip() for name in next(csv.reader(lines[:1]))]
    if target in header and header.count(target) == 1:  # ignored: it may be blank or NA in new rows
        position = header.index(target)
        header.pop(position)
        lines = lines[:1] + [_without_column(line, position) for line in lines[1:]]
    table = parse_numeric_rows(lines[1:], str(path), expected_columns=len(header), first_line=2)
    if table.size == 0:
        raise DataError(f"{path} has a header but no data rows")
    if columns is None:  # generated training data: features by position
        kept = [i for i, name in enumerate(header) if name != target]
        if len(kept) != input_dim:
            raise DataError(
                f"{path} has {len(kept)} feature columns; the model was trained on {input_dim} (generated data, "
                "read by position)"
            )
        return table[:, kept]
    missing = [name for name in columns if name not in header]
    extra = [name for name in header if name not in columns and name != target]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        if extra:
            parts.append(f"not in the training file: {', '.join(extra)}")
        raise DataError(
            f"{path}: the columns differ from the training file's ({'; '.join(parts)}); give exactly the features "
            f"{', '.join(columns)} (the target `{target}` may stay)"
        )
    duplicated = sorted({name for name in header if header.count(name) > 1})
    if duplicated:
        raise DataError(f"{path}: column names appear twice: {', '.join(duplicated)}")
    return table[:, [header.index(name) for name in columns]]


def predict_run(run_dir, data_path, out=None, estimator=None, num_samples: int = 64, seed: int = 0) -> Path:
    run_dir, data_path = Path(run_dir), Path(data_path)
    if not (run_dir / "results.json").is_file():
        raise DataError(f"{run_dir} is not a cfbnn run dir (no results.json); pass the dir a run printed")
    if not (run_dir / "done").is_file():
        status = _recorded_status(run_dir)
        if status is not None and status[0] == "failed":
            raise DataError(
                f"{run_dir} is a failed run ({status[1][:200] or 'see its results.json'}); fix that and train again, "
                "then predict"
            )
        raise DataError(f"{run_dir} is not finished (no `done` file); resume it with resume=true, then predict")
    model_path = run_dir / FILE_NAME
    if not model_path.is_file():
        raise DataError(
            f"{run_dir} has no {FILE_NAME}: predict reads `cfbnn train regression` runs (a finished one writes it)"
        )
    model, info = load_regression_model(model_path)
    if info["architecture"]["likelihood"] != "normal":
        raise DataError(
            f"{run_dir}: predict supports the Normal likelihood; this run used {info['architecture']['likelihood']}"
        )
    estimator = estimator or info["estimator"]
    if estimator not in ESTIMATORS:
        raise ConfigError(f"--estimator {estimator!r} is not one of {', '.join(ESTIMATORS)}")
    estimator = make_estimator(estimator)  # an object from here on
    if num_samples < 1:
        raise ConfigError(f"--num-samples {num_samples} must be >= 1")
    if not 0 <= seed < 2**63:
        raise ConfigError(f"--seed {seed} must be in 0..2^63-1")
    out = Path(out) if out is not None else run_dir / "predictions.csv"
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a file path, e.g. --out {out / 'predictions.csv'}")
    scaling = info["scaling"]
    features = read_feature_rows(data_path, info["columns"], info["architecture"]["input_dim"], info["target"])
    standardized = standardize_columns(features, scaling["feature_mean"].numpy(), scaling["feature_std"].numpy())
    check_finite_columns(standardized.astype(np.float32), str(data_path), info["columns"], "feature column")
    x = torch.as_tensor(standardized, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    try:
        prediction = model.predict(x, estimator=estimator, num_samples=num_samples, generator=generator)
    except (MemoryError, RuntimeError) as error:  # torch's "can't allocate memory" is a RuntimeError
        if isinstance(error, RuntimeError) and "alloc" not in str(error):
            raise
        raise ConfigError(
            f"--num-samples {num_samples} draws of {len(x)} rows do not fit in memory; lower --num-samples, "
            "or predict the rows in parts"
        ) from None
    prediction = prediction.unscaled(scaling["target_mean"], scaling["target_std"])
    columns = describe(prediction, coverage=0.9)
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["row", *columns])
    values = np.stack([c.double().numpy() for c in columns.values()], axis=1)
    for index, row in enumerate(values, start=1):
        writer.writerow([index, *(repr(float(v)) for v in row)])
    return atomic_write_text(out, text.getvalue())


def _recorded_status(run_dir: Path):
    """``(status, error)`` from the run's ``results.json``; ``None`` where it cannot be read."""
    try:
        record = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
        return str(record.get("status")), str(record.get("error") or "")
    except (OSError, ValueError, AttributeError):
        return None


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="cfbnn predict", description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", help="a finished `cfbnn train regression` run dir")
    parser.add_argument("data", help="a CSV of new rows with the training file's feature columns")
    parser.add_argument("--out", default=None, help="where to write the predictions (default: RUN_DIR/predictions.csv)")
    parser.add_argument("--estimator", default=None, help=f"one of {', '.join(ESTIMATORS)} (default: the run's own)")
    parser.add_argument(
        "--num-samples", type=int, default=64, help="draws of the sampled layers, where the estimator samples any"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of those draws")
    args = parser.parse_args(list(argv))
    try:
        path = predict_run(args.run_dir, args.data, args.out, args.estimator, args.num_samples, args.seed)
    except CfbnnError as error:
        print(f"cfbnn: error: {error}", file=sys.stderr)
        return error.exit_code
    print(f"cfbnn: predictions in {path}")
    return 0
