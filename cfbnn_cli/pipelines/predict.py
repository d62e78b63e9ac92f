"""``cfbnn predict MODEL NEW.csv``: a trained model's predictions for new rows of a table.

MODEL is a finished ``cfbnn train regression`` or ``cfbnn train classification`` run dir (its
``model.pt``), or a model file written by ``cfbnn_cli.bnn.save_model``. NEW.csv has a header
row and the model's feature columns in any order; the target column may be there (ignored), an
unnamed leading index column is left out, and other columns are refused unless ``--keep`` names
them (they are copied to the output, e.g. an ID). A row with a blank feature gets empty
prediction cells (counted on stderr) instead of refusing the file.

Regression writes, per row and in the target's units: ``mean``, ``sd``, ``var_a`` and ``var_b``
(the predictive variance from the last hidden layer's weights and from the output layer's,
paper eq. (44), in squared target units), ``noise`` (the likelihood's variance, squared units)
and the central ``--level`` interval ``lower_90``, ``upper_90``. Classification writes the
predicted ``label``, its ``probability`` and one ``p_<class>`` column per class.

The rows are read, predicted and written in chunks: memory does not grow with the file's length.
The output (default ``RUN_DIR/predictions.csv``, or beside a model file) is written atomically.
Every problem is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch

from ..bnn.estimators import ESTIMATORS, make_estimator
from ..bnn.model_file import FILE_NAME, SavedModel, load_model
from ..bnn.predictive import default_estimator, describe
from ..data.tabular import FeatureChunk, iter_feature_chunks
from ..runtime.device import resolve_device
from ..runtime.errors import CfbnnError, ConfigError, DataError, listing, one_line
from ..runtime.io import atomic_text_writer, remove_stale_temporary_files
from ..runtime.numerics import map_row_chunks, rows_per_chunk
from ..runtime.run_activity import running_owner
from ..runtime.safefs import describe_file, output_error, shown_path

HELP = __doc__.split("\n\n", 1)[1]
READ_ROWS = 8192  # rows read and written at a time
# what a run dir holds before its results.json: a run started there (interrupted, or still running)
UNFINISHED_SIGNS = (".cfbnn", "checkpoints", "metrics.csv", "uci_progress.json")
OUT_FIX = "pass --out a file in a folder you can write (e.g. --out ~/predictions.csv)"


def model_path(source) -> Path:
    """The model file of a run dir (checked finished), or ``source`` itself if it is a file."""
    source = Path(source)
    if source.is_file():
        return source
    if not source.is_dir():
        what = describe_file(source)
        what = "no such run dir or model file" if what == "no such file" else what
        raise DataError(f"{shown_path(source)}: {what} (the model: a finished run dir, or a model file)")
    if not (source / "results.json").is_file():
        if any(os.path.lexists(source / name) for name in UNFINISHED_SIGNS):
            owner = running_owner(source)
            if owner is not None:
                raise DataError(
                    f"{source} is a cfbnn run that has not finished: it is still training ({owner} is writing to it); "
                    "wait for it to finish, then predict"
                )
            raise DataError(
                f"{source} is a cfbnn run that has not finished: it was interrupted (no results.json, and no process is "
                "writing to it); "
                "resume it (the same command with resume=true and this hydra.run.dir), then predict"
            )
        raise DataError(
            f"{source} is not a cfbnn run dir (no results.json); pass the dir a run printed, or a model file"
        )
    if not (source / "done").is_file():
        status = _recorded_status(source)
        if status is not None and status[0] == "failed":
            raise DataError(
                f"{source} is a failed run ({status[1][:200] or 'see its results.json'}); fix that and train again, "
                "then predict"
            )
        raise DataError(f"{source} is not finished (no `done` file); resume it with resume=true, then predict")
    if not (source / FILE_NAME).is_file():
        raise DataError(
            f"{source} has no {FILE_NAME}: predict reads `cfbnn train regression` and `cfbnn train classification` "
            "runs (a finished one writes it)"
        )
    return source / FILE_NAME


def _recorded_status(run_dir: Path):
    """``(status, error)`` from the run's ``results.json``; ``None`` where it cannot be read."""
    try:
        record = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
        return str(record.get("status")), str(record.get("error") or "")
    except (OSError, ValueError, AttributeError):
        return None


class _Predictor:
    """One chunk of standardized rows -> the output columns (a dict of ``(n,)`` arrays)."""

    def __init__(self, saved: SavedModel, estimator, num_samples: int, level: float, generator, device):
        self.saved, self.estimator, self.num_samples = saved, estimator, num_samples
        self.level, self.generator, self.device = level, generator, device
        widths = [layer.out_features for layer in saved.network.layers]
        sampled = bool(estimator.noise_shapes(saved.network, 1))
        # samples x rows x widest layer per intermediate: bounded, whatever the file's length
        self.compute_rows = rows_per_chunk((num_samples if sampled else 4) * max(widths))

    def columns(self) -> list:
        if self.saved.task == "classification":
            return ["label", "probability"] + [f"p_{name}" for name in self.saved.classes]
        percent = f"{100 * self.level:g}"
        return ["mean", "sd", "var_a", "var_b", "noise", f"lower_{percent}", f"upper_{percent}"]

    def __call__(self, x: torch.Tensor) -> dict:
        saved = self.saved

        def regression(rows):
            prediction = saved.network.predict(
                rows, estimator=self.estimator, num_samples=self.num_samples, generator=self.generator
            ).unscaled(saved.target_mean, saved.target_std)
            return tuple(describe(prediction, coverage=self.level).values())

        def classification(rows):
            return saved.network.predict(
                rows, estimator=self.estimator, num_samples=self.num_samples, generator=self.generator
            ).probs

        with torch.no_grad():
            if saved.task == "classification":
                probabilities = map_row_chunks(classification, x, self.compute_rows, dim=0).float().cpu().numpy()
                best = probabilities.argmax(1)
                columns = {"label": np.asarray(saved.classes, dtype=object)[best]}
                columns["probability"] = probabilities[np.arange(len(best)), best]
                columns.update({f"p_{name}": probabilities[:, k] for k, name in enumerate(saved.classes)})
                return columns
            values = map_row_chunks(regression, x, self.compute_rows)
        # float32, as computed: pandas writes each with the fewest digits that read back to it
        return {name: value.float().cpu().numpy() for name, value in zip(self.columns(), values)}


def _standardized(saved: SavedModel, chunk: FeatureChunk, path: Path, device) -> torch.Tensor:
    x = chunk.x[chunk.complete]
    with np.errstate(over="ignore", invalid="ignore"):  # what overflows is named below, one line
        if saved.feature_mean is not None:
            x = (x - saved.feature_mean.numpy()) / saved.feature_std.numpy()
        x32 = x.astype(np.float32)
    bad = ~np.isfinite(x32)
    if bad.any():
        row, column = np.argwhere(bad)[0]
        name = saved.columns[column] if saved.columns else f"#{column + 1}"
        number = chunk.rows[chunk.complete][row]
        raise DataError(
            f"{path}, row {number}, column `{name}`: {chunk.x[chunk.complete][row, column]:.6g} is too far outside the "
            "training rows' range to standardize in float32; check the value"
        )
    return torch.as_tensor(x32, device=device)


def predict_run(
    source,
    data_path,
    out=None,
    estimator: Optional[str] = None,
    num_samples: int = 64,
    seed: int = 0,
    *,
    level: float = 0.9,
    device: str = "cpu",
    keep: Sequence[str] = (),
    read_rows: int = READ_ROWS,
) -> Path:
    """Write the predictions of the model ``source`` (a run dir or a model file) for the rows of
    ``data_path``; returns the output path. See the module docstring."""
    path = model_path(source)
    data_path = Path(data_path)
    if num_samples < 1:
        raise ConfigError(f"--num-samples {num_samples} must be >= 1")
    if not 0 <= seed < 2**63:
        raise ConfigError(f"--seed {seed} must be in 0..2^63-1")
    if not 0 < level < 1:
        raise ConfigError(f"--level {level} must be in (0, 1), e.g. 0.9 for the central 90 % interval")
    torch_device = resolve_device(device)
    saved = load_model(path, map_location=torch_device)
    estimator = estimator or default_estimator(saved.network, saved.estimator)  # sampled layers: one pass instead
    if estimator not in ESTIMATORS:
        raise ConfigError(f"--estimator {estimator!r} is not one of {', '.join(ESTIMATORS)}")
    heteroscedastic = getattr(saved.network.likelihood, "needs_covariance", False)  # (mean, log-variance) outputs
    if saved.task == "regression" and saved.network.output_dim != 1 and not heteroscedastic:
        raise DataError(
            f"{path}: predict supports one-output Normal and heteroscedastic regression models, and classifiers"
        )
    out = Path(out) if out is not None else path.parent / "predictions.csv"
    _check_out(out)
    generator = torch.Generator(device=torch_device).manual_seed(seed)
    predictor = _Predictor(saved, make_estimator(estimator), num_samples, level, generator, torch_device)
    passed, chunks = iter_feature_chunks(
        data_path, saved.columns, saved.input_dim, saved.target, keep=keep, chunk_rows=read_rows
    )
    try:
        rows, incomplete = _write_predictions(out, passed, chunks, predictor, saved, data_path, torch_device)
    except OSError as error:  # the output's folder or file cannot be made or written
        message = output_error(error, out.parent, OUT_FIX)
        if message is None:
            raise
        raise ConfigError(message) from None
    if incomplete:
        print(
            f"cfbnn: {incomplete} of {rows} rows have a blank feature: their prediction cells are empty",
            file=sys.stderr,
        )
    return out


def _check_out(out: Path) -> None:
    """Refuse an output path that is a directory or anything but a regular file, or that cannot
    even be looked at (a name too long), before any work."""
    try:
        if out.is_dir():
            raise ConfigError(f"--out {out} is a directory; give a file path, e.g. --out {out / 'predictions.csv'}")
        if os.path.lexists(out) and not out.is_symlink() and not out.is_file():
            raise ConfigError(f"--out {shown_path(out)} is {describe_file(out)}; give a regular file's path")
    except OSError as error:
        message = output_error(error, out.parent, OUT_FIX)
        if message is None:
            raise
        raise ConfigError(message) from None


def _write_predictions(out: Path, passed, chunks, predictor, saved, data_path: Path, torch_device):
    """Stream the predictions into ``out`` (atomically); ``(rows, incomplete rows)``. The temporary
    files a killed predict left for ``out`` go first (cfbnn's own names only, none being written)."""
    remove_stale_temporary_files(out.parent, out.name)
    names = ["row", *passed, *predictor.columns()]
    rows = incomplete = 0
    with atomic_text_writer(out) as handle:
        pd.DataFrame(columns=names).to_csv(handle, index=False)
        for chunk in chunks:
            frame = pd.DataFrame({"row": chunk.rows})
            for j, name in enumerate(passed):
                frame[name] = [row[j] for row in chunk.passed]
            if chunk.complete.any():
                values = predictor(_standardized(saved, chunk, data_path, torch_device))
                _refuse_non_finite(values, chunk, data_path)
                for name, value in values.items():
                    column = np.full(len(chunk.rows), None if value.dtype == object else np.nan, dtype=value.dtype)
                    column[chunk.complete] = value
                    frame[name] = column
            else:
                for name in predictor.columns():
                    frame[name] = np.nan
            frame.to_csv(handle, header=False, index=False)
            rows += len(chunk.rows)
            incomplete += int((~chunk.complete).sum())
        if rows == 0:  # inside the block: whatever `out` held stays
            raise DataError(f"{data_path} has a header but no data rows")
    return rows, incomplete


def _refuse_non_finite(values: dict, chunk: FeatureChunk, path: Path) -> None:
    numbers = [v for v in values.values() if v.dtype != object]
    bad = np.zeros(int(chunk.complete.sum()), dtype=bool)
    for value in numbers:
        bad |= ~np.isfinite(value)
    if bad.any():
        rows = chunk.rows[chunk.complete][bad]
        raise DataError(
            f"{path}: the prediction of row(s) {listing(rows.tolist(), 5)} is not "
            "finite: their features lie too far outside the training rows' range; check those rows"
        )


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="cfbnn predict", description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", help="a finished `cfbnn train regression|classification` run dir, or a model file")
    parser.add_argument("data", help="a CSV of new rows with the model's feature columns")
    parser.add_argument("--out", default=None, help="where to write the predictions (default: beside the model)")
    parser.add_argument(
        "--keep",
        action="append",
        default=[],
        metavar="COLUMN",
        help="copy this column to the output (e.g. an ID); repeatable",
    )
    parser.add_argument(
        "--level", type=float, default=0.9, help="the central interval's probability (regression; default 0.9)"
    )
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")
    parser.add_argument("--estimator", default=None, help=f"one of {', '.join(ESTIMATORS)} (default: the model's own)")
    parser.add_argument(
        "--num-samples", type=int, default=64, help="draws of the sampled layers, where the estimator samples any"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of those draws")
    args = parser.parse_args(list(argv))
    try:
        path = predict_run(
            args.model,
            args.data,
            args.out,
            args.estimator,
            args.num_samples,
            args.seed,
            level=args.level,
            device=args.device,
            keep=args.keep,
        )
    except CfbnnError as error:
        print(f"cfbnn: error: {one_line(error)}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("cfbnn: interrupted; no predictions were written", file=sys.stderr)
        return 130
    print(f"cfbnn: predictions in {path}")
    return 0
