"""``cfbnn predict MODEL NEW.csv``: a trained model's predictions for new rows of a table.

MODEL is a finished ``cfbnn train regression`` or ``cfbnn train classification`` run dir (its
``model.pt``), or a model file written by ``cfbnn_cli.bnn.save_model``. NEW.csv (or NEW.csv.gz)
has a header row and the model's columns in any order, by name: the training file's layout works
as it is (the target, an unnamed leading index column and the columns the training run left out
are ignored). A column the model does not know is refused unless ``--keep`` names it (only the
columns named are copied to the output, e.g. an ID; none may share a name with an output
column). A row with a blank feature gets empty prediction cells (counted on stderr) instead of
refusing the file; a categorical level training never saw is an error, or, with ``--unseen
zeros``, all-zero indicators.

Regression writes, per row and in the target's units: ``mean``, ``sd``, ``var_a`` and ``var_b``
(the predictive variance from the last hidden layer's weights and from the output layer's,
paper eq. (44), in squared target units), ``noise`` (the likelihood's variance, squared units)
and the central ``--level`` interval ``lower_90``, ``upper_90`` (a model fitted on the target's
log: the log-normal's ``mean``, ``sd``, ``median``, the variance's parts on the log scale
``log_var_a``, ``log_var_b``, ``log_noise``, and the interval). Classification writes the
predicted ``label``, its ``probability`` and one ``p_<class>`` column per class.

The rows are read, predicted and written in chunks: memory does not grow with the file's length.
The output (default ``RUN_DIR/predictions.csv``, or beside a model file) is written atomically
(``--out -``: to the standard output), and never over one of the command's inputs.
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
from ..bnn.predictive import default_estimator
from ..bnn.target_units import describe_in_target_units, in_target_units, regression_columns
from ..data.layout import UNSEEN_POLICIES
from ..data.tabular import FeatureChunk, iter_feature_chunks
from ..runtime.command_line import OneLineParser, whole_number
from ..runtime.device import resolve_device
from ..runtime.errors import CfbnnError, ConfigError, DataError, listing, one_line
from ..runtime.io import STDOUT, text_output
from ..runtime.memory import require_sample_memory
from ..runtime.numerics import map_row_chunks, rows_per_chunk
from ..runtime.run_activity import running_owner
from ..runtime.rundir import refuse_output_over_input
from ..runtime.safefs import describe_file, input_error, output_error, shown_path

HELP = __doc__.split("\n\n", 1)[1]
READ_ROWS = 8192  # rows read and written at a time
# what a run dir holds before its results.json: a run started there (interrupted, or still running)
UNFINISHED_SIGNS = (".cfbnn", "checkpoints", "metrics.csv", "uci_progress.json")
OUT_FIX = "pass --out a file in a folder you can write (e.g. --out ~/predictions.csv)"
MAX_SAMPLES = 1_000_000  # draws of the sampled layers: a mixture's moments then carry a 0.1 % Monte Carlo error
SAMPLES_WHY = "a million draws put a mixture's Monte Carlo error at 0.1 % of its s.d."


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
        if sampled:  # even one row holds every draw: counted before anything is drawn
            require_sample_memory(num_samples, max(widths))

    def columns(self) -> list:
        if self.saved.task == "classification":
            return ["label", "probability"] + [f"p_{name}" for name in self.saved.classes]
        return regression_columns(self.saved.target_transform, self.level)

    def __call__(self, x: torch.Tensor) -> dict:
        saved = self.saved

        def regression(rows):
            prediction = saved.network.predict(
                rows, estimator=self.estimator, num_samples=self.num_samples, generator=self.generator
            )
            prediction = in_target_units(prediction, saved.target_mean, saved.target_std, saved.target_transform)
            return tuple(describe_in_target_units(prediction, self.level).values())

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
        return {name: self._written(name, value) for name, value in zip(self.columns(), values)}

    def _written(self, name: str, value: torch.Tensor) -> np.ndarray:
        """float32, as the network computes (pandas writes the fewest digits that read back to it);
        but a Normal's mean and interval carry the target's offset, added in float64: they are
        rounded to the network's float32 resolution in the target's units instead (a target near
        1e12 with an s.d. of 1 keeps its decimals)."""
        offset = self.saved.target_transform == "none" and (name == "mean" or name.startswith(("lower_", "upper_")))
        if not offset:
            return value.float().cpu().numpy()
        decimals = int(np.clip(-np.floor(np.log10(self.saved.target_std * 1e-7)), -300, 300))
        value = value.double().cpu().numpy()
        with np.errstate(over="ignore", invalid="ignore"):
            rounded = np.round(value, decimals)
        return np.where(np.isfinite(rounded) | ~np.isfinite(value), rounded, value)


def refuse_broken_model(predictor: "_Predictor", saved: SavedModel, path: Path, device) -> None:
    """A model whose prediction at the training rows' mean (the origin of its standardized inputs)
    is not finite is a damaged model file (weights that overflow), whatever rows it is given: said
    so, before the rows are blamed. The draws it takes are given back: the rows' draws are as without it."""
    state = predictor.generator.get_state()
    values = predictor(torch.zeros(1, saved.input_dim, device=device))
    predictor.generator.set_state(state)
    if not all(np.isfinite(value).all() for value in values.values() if value.dtype != object):
        raise DataError(
            f"{path}: the model's prediction at the training rows' mean is not finite, so its weights are damaged "
            "(they overflow float32); retrain, or point at another model file"
        )


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
    unseen: Optional[str] = None,
) -> Path:
    """Write the predictions of the model ``source`` (a run dir or a model file) for the rows of
    ``data_path``; returns the output path. See the module docstring."""
    path = model_path(source)
    data_path = Path(data_path)
    if not 1 <= num_samples <= MAX_SAMPLES:
        raise ConfigError(f"--num-samples {num_samples} must be in 1..{MAX_SAMPLES:,} ({SAMPLES_WHY})")
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
    if str(out) != STDOUT:
        _check_out(out)
        refuse_output_over_input(out, [("the model file", path), ("the table of new rows", data_path)], source)
    generator = torch.Generator(device=torch_device).manual_seed(seed)
    predictor = _Predictor(saved, make_estimator(estimator), num_samples, level, generator, torch_device)
    if unseen is not None and unseen not in UNSEEN_POLICIES:
        raise ConfigError(f"--unseen {unseen} must be one of {', '.join(UNSEEN_POLICIES)}")
    with torch.no_grad():
        refuse_broken_model(predictor, saved, path, torch_device)
    try:
        passed, chunks = iter_feature_chunks(
            data_path,
            saved.layout,
            saved.input_dim,
            saved.target,
            keep=keep,
            chunk_rows=read_rows,
            reserved=["row", *predictor.columns()],
            unseen=unseen,
        )
        rows, incomplete = _write_predictions(out, passed, chunks, predictor, saved, data_path, torch_device)
    except OSError as error:  # the output's folder or file cannot be made or written, or the rows read
        message = input_error(error, data_path) or output_error(error, out.parent, OUT_FIX)
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
    names = ["row", *passed, *predictor.columns()]
    rows = incomplete = 0
    with text_output(out) as handle:  # atomic, or streamed to the standard output (--out -)
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
    parser = OneLineParser(prog="cfbnn predict", description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a finished `cfbnn train regression|classification` run dir, or a model file")
    parser.add_argument("data", help="a CSV of new rows with the model's columns (the training file's layout works)")
    parser.add_argument(
        "--out", default=None, help="where to write the predictions (default: beside the model; - : standard output)"
    )
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
        "--num-samples",
        type=whole_number,
        default=64,
        help=f"draws of the sampled layers, where the estimator samples any (at most {MAX_SAMPLES:,})",
    )
    parser.add_argument("--seed", type=whole_number, default=0, help="seed of those draws")
    parser.add_argument(
        "--unseen",
        choices=UNSEEN_POLICIES,
        default=None,
        help="a categorical level the model never saw: error, or zeros (every indicator 0); default: the model's",
    )
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
            unseen=args.unseen,
        )
    except CfbnnError as error:
        print(f"cfbnn: error: {one_line(error)}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("cfbnn: interrupted; no predictions were written", file=sys.stderr)
        return 130
    if str(path) != STDOUT:
        print(f"cfbnn: predictions in {path}")
    return 0
