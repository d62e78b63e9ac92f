"""``head.pt``: an ``imagenet-predict`` run's classifier head as a file, for ``cfbnn predict``.

:func:`save_head` writes the evaluated head's weights, the sizes and settings that rebuild it
(:func:`cfbnn_cli.bnn.network.bayesian_head`) and the training features' mean and s.d. (the head
sees standardized features), as plain tensors, numbers and strings (``torch.load(weights_only=True)``).
:func:`load_saved_head` checks every field before building anything, as the model file's reader
(:mod:`cfbnn_cli.bnn.model_file`) does: a missing or malformed field, a width that would ask for
terabytes, weights that do not fit or are not finite are one ``DataError`` naming the file and the
field.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ...bnn.footprint import layer_shapes, parameter_count
from ...bnn.likelihoods import CLASSIFICATION_OBJECTIVES
from ...bnn.model_file import MAX_PARAMETERS, MAX_WIDTH, checked_mapping, checked_weights, finite_weights
from ...bnn.network import bayesian_head
from ...moments import ACTIVATIONS
from ...runtime.checkpoints import load_checkpoint
from ...runtime.errors import CheckpointError, DataError, clip
from ...runtime.io import atomic_torch_save
from ...runtime.memory import FLOAT32, require_memory

HEAD_FORMAT = "cfbnn.classifier_head"
HEAD_FILE = "head.pt"
HEAD_VERSION = 1


def save_head(run_dir: Path, model, cfg, feature_dim: int, num_classes: int, mean, std) -> Path:
    """``run_dir/head.pt`` (atomically); a head with non-finite weights is refused
    (:class:`~cfbnn_cli.bnn.model_file.NonFiniteWeightsError`): it could not predict."""
    weights = finite_weights(
        model,
        "the trained head has non-finite weights (NaN or infinity); it cannot predict, so head.pt is not "
        "written (lower trainer.lr, or check the features)",
    )
    record = {
        "format": HEAD_FORMAT,
        "version": HEAD_VERSION,
        "architecture": {
            "feature_dim": int(feature_dim),
            "hidden_sizes": [int(h) for h in cfg.model.hidden_sizes],
            "num_classes": int(num_classes),
            "activation": str(cfg.model.activation),
            "prior_scale": float(cfg.model.prior_scale),
            "init_scale": float(cfg.model.init_scale),
            "objective": str(cfg.objective),
        },
        "state_dict": weights,
        "scaling": {"feature_mean": mean.detach().cpu().double(), "feature_std": std.detach().cpu().double()},
        "data": str(cfg.data.name),
        "backbone": str(cfg.backbone.name),
    }
    return atomic_torch_save(record, Path(run_dir) / HEAD_FILE)


# ----------------------------------------------------------------------------- reading


def _problem(path, field: str, why: str) -> DataError:
    return DataError(
        f"{path} is not a usable cfbnn head file: {field} {why}; rerun `cfbnn imagenet-predict` to write it again"
    )


def _count(value, path, field: str, low: int = 1, high: int = MAX_WIDTH) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _problem(path, field, f"is {clip(repr(value), 40)}, not a whole number in [{low}, {high:,}]")
    return value


def _number(value, path, field: str, low_inclusive: bool = False) -> float:
    valid = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not valid or value < 0 or (value == 0 and not low_inclusive):
        sign = ">= 0" if low_inclusive else "> 0"
        raise _problem(path, field, f"is {clip(repr(value), 40)}, not a finite number {sign}")
    return float(value)


def _architecture(a, path) -> dict:
    needed = ("feature_dim", "hidden_sizes", "num_classes", "activation", "prior_scale", "init_scale", "objective")
    checked_mapping(a, path, "architecture", _problem, needed)
    feature_dim = _count(a["feature_dim"], path, "architecture.feature_dim")
    num_classes = _count(a["num_classes"], path, "architecture.num_classes", 2)
    sizes = a["hidden_sizes"]
    if not isinstance(sizes, list) or len(sizes) != 2:
        raise _problem(path, "architecture.hidden_sizes", f"is {clip(repr(sizes), 40)}, not a list of two widths")
    hidden = [_count(width, path, "architecture.hidden_sizes") for width in sizes]
    widths = [feature_dim, *hidden, num_classes]
    if sum((i + 1) * o for i, o in zip(widths[:-1], widths[1:])) * 2 > MAX_PARAMETERS:
        raise _problem(path, "`architecture`", f"asks for more than {MAX_PARAMETERS:,} parameters")
    for key, allowed in (("activation", ACTIVATIONS), ("objective", CLASSIFICATION_OBJECTIVES)):
        if not isinstance(a[key], str) or a[key] not in allowed:
            raise _problem(path, f"architecture.{key}", f"is {clip(repr(a[key]), 40)}, not one of {sorted(allowed)}")
    _number(a["prior_scale"], path, "architecture.prior_scale")
    _number(a["init_scale"], path, "architecture.init_scale", low_inclusive=True)
    return a


def _scaling(scaling, path, dim: int) -> dict:
    checked_mapping(scaling, path, "scaling", _problem)
    for key in ("feature_mean", "feature_std"):
        value = scaling.get(key)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.shape != (dim,):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise _problem(path, f"scaling.{key}", f"is {clip(shape, 40)}, not {dim} numbers (one per feature)")
        if not torch.isfinite(value).all():
            raise _problem(path, f"scaling.{key}", "holds NaN or infinite values")
    if not (scaling["feature_std"] > 0).all():
        raise _problem(path, "scaling.feature_std", "has a value <= 0")
    return scaling


def load_saved_head(path) -> tuple:
    """``(head in eval mode, the record without its weights)`` from :func:`save_head`'s file;
    every field checked first (see the module docstring)."""
    path = Path(path)
    try:
        record = load_checkpoint(path, what="head file")
    except CheckpointError as error:  # nothing is resumed here: no resume hint
        raise DataError(str(error).split("; nothing was run", 1)[0] + "; rerun `cfbnn imagenet-predict`") from None
    kind, version = record.get("format"), record.get("version")  # a damaged header may hold anything
    if not isinstance(kind, str) or kind != HEAD_FORMAT or type(version) is not int or version != HEAD_VERSION:
        raise DataError(f"{path} is not a cfbnn classifier head file (written by `cfbnn imagenet-predict`)")
    a = _architecture(record.get("architecture"), path)
    scaling = _scaling(record.get("scaling"), path, a["feature_dim"])
    shape = (a["feature_dim"], a["hidden_sizes"], a["num_classes"], "diagonal", 10, 1)  # bayesian_head's network
    weights = checked_weights(record.get("state_dict"), path, _problem, layer_shapes(*shape))
    require_memory(
        FLOAT32 * parameter_count(*shape) * 2,
        f"the head of {path} ({parameter_count(*shape):,} parameters)",
        "predict on a machine with more memory",
    )
    try:
        model = bayesian_head(
            a["feature_dim"],
            a["hidden_sizes"],
            a["num_classes"],
            a["activation"],
            a["prior_scale"],
            a["init_scale"],
            objective=a["objective"],
        )
        model.load_state_dict(weights)
    except (RuntimeError, ValueError, KeyError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise _problem(path, "`state_dict`", f"does not fit the recorded architecture ({clip(reason, 160)})") from None
    info = {k: v for k, v in record.items() if k != "state_dict"}
    info["scaling"] = scaling
    return model.eval(), info
