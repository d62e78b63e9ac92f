"""Models as files: a trained network with what it takes to predict on new rows in original units.

:func:`save_model` writes, :func:`load_model` reads (a :class:`SavedModel`). ``cfbnn train
regression`` and ``cfbnn train classification`` write ``model.pt`` with it, ``cfbnn predict``
reads it, and a network trained in Python runs through ``cfbnn predict`` once saved::

    save_model("model.pt", network, feature_mean=x.mean(0), feature_std=x.std(0),
               target_mean=float(y.mean()), target_std=float(y.std()), columns=names, target="y")
    saved = load_model("runs/my/model.pt")  # a CLI-trained model, in one line
    saved.predict(new_rows)                 # original units in and out

The file holds plain tensors, numbers, strings and lists only, so it loads with
``torch.load(weights_only=True)`` (no pickle of arbitrary objects), and every field is checked
on loading: a file that is not a cfbnn model, or is damaged, is one ``DataError`` naming the
file and the field, never a traceback from deep inside the network.

Fields: ``architecture`` (the keyword arguments that rebuild the
:class:`~cfbnn_cli.bnn.network.BayesianNetwork`), ``state_dict`` (its weights), ``scaling``
(the training rows' feature means and standard deviations, the target's mean and standard
deviation: the network sees standardized values), ``columns`` / ``target`` (the feature names,
``None`` for features read by position, and the target's name), ``classes`` (a classifier's
label names, index ``k`` the ``k``-th output), ``estimator`` (the default for predicting),
``method`` and ``data`` (free text: how and on what it was trained), ``layout`` (version 3: how
the model reads a table by column name -- the columns it reads, the categorical ones' levels,
the columns its training file had and the run left out, the target's transform; see
:class:`~cfbnn_cli.data.layout.InputLayout`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np
import torch

from ..data.frames import model_features
from ..data.layout import InputLayout
from ..runtime.checkpoints import load_checkpoint
from ..runtime.errors import CheckpointError, DataError, NonFiniteResultError, clip
from ..runtime.io import atomic_torch_save
from ..runtime.memory import FLOAT32, require_memory
from ..runtime.safefs import describe_file
from .estimators import ESTIMATORS
from .footprint import layer_shapes, parameter_count
from .likelihoods import CLASSIFICATION_OBJECTIVES, CategoricalLikelihood, HeteroscedasticNormalLikelihood
from .likelihoods import NormalLikelihood as _Normal
from .network import BayesianNetwork
from .predictive import default_estimator
from .target_units import in_target_units


class NonFiniteWeightsError(NonFiniteResultError, ValueError):
    """A network with NaN or infinite weights was given to :func:`save_model`: a ``ValueError`` for
    the library, a failed run (exit 1, nothing written) for the CLI."""


def finite_weights(model, refusal: str) -> dict:
    """``model``'s state dict on the CPU, detached, for a file; :class:`NonFiniteWeightsError`
    (``refusal``) if a floating-point entry holds a NaN or an infinity: such a file could not predict."""
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if not all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point()):
        raise NonFiniteWeightsError(refusal)
    return weights


FORMAT = "cfbnn.model"
VERSION = 3  # 3: the layout (categorical levels, left-out columns, target transform); 2 is read too
READ_VERSIONS = (2, 3)
LEGACY_FORMAT = "cfbnn.regression_model"  # version 1: regression only, read as such
FILE_NAME = "model.pt"
# bounds a damaged or hostile file cannot get past (a width of 1e11 would ask for terabytes)
MAX_WIDTH = 1_000_000
MAX_LAYERS = 1000
MAX_PARAMETERS = 2_000_000_000
_LIKELIHOODS = ("normal", "heteroscedastic", "softmax", "logistic")
_COVARIANCES = ("diagonal", "full", "lowrank")


def architecture_of(model: BayesianNetwork) -> dict:
    """The keyword arguments that rebuild ``model`` (its weights then come from its state dict)."""
    layers = list(model.layers)
    gaussian = model.gaussian_layers
    likelihood = model.likelihood
    if isinstance(likelihood, HeteroscedasticNormalLikelihood):
        name, objective = "heteroscedastic", "approximation"
    elif isinstance(likelihood, CategoricalLikelihood):
        name, objective = ("logistic" if likelihood.logistic else "softmax"), likelihood.objective
    else:
        name, objective = "normal", "approximation"
    ranks = [layer.factor.shape[-1] for layer in gaussian if layer.covariance == "lowrank"]
    first = layers[0]
    input_dim = first.in_features if isinstance(first, torch.nn.Linear) else first.loc.shape[1] - int(first.bias)
    return {
        "input_dim": int(input_dim),
        "hidden_sizes": [int(layer.out_features) for layer in layers[:-1]],
        "output_dim": int(model.output_dim),
        "activation": str(model.activation.name),
        "covariance": [str(layer.covariance) for layer in gaussian],
        "rank": int(ranks[0]) if ranks else 10,
        "prior_scale": float(model.prior_scale),
        "prior": str(model.prior),
        "point_layers": int(model.point_layers),
        "output_bias": bool(getattr(layers[-1], "bias", True) is not False),
        "likelihood": name,
        "objective": objective,
        "learn_precision": isinstance(getattr(likelihood, "log_precision", None), torch.nn.Parameter),
    }


def _vector(values, name: str, size: int) -> Optional[torch.Tensor]:
    if values is None:
        return None
    tensor = torch.as_tensor(
        np.asarray(values.detach().cpu() if torch.is_tensor(values) else values), dtype=torch.float64
    )
    tensor = tensor.reshape(-1)
    if tensor.numel() != size:
        raise ValueError(f"`{name}` has {tensor.numel()} values; the network has {size} input features")
    if not torch.isfinite(tensor).all() or (name == "feature_std" and not (tensor > 0).all()):
        raise ValueError(f"`{name}` must be finite{' and positive' if name == 'feature_std' else ''}")
    return tensor


def save_model(
    path,
    model: BayesianNetwork,
    *,
    feature_mean=None,
    feature_std=None,
    target_mean: float = 0.0,
    target_std: float = 1.0,
    columns: Optional[Sequence[str]] = None,
    target: str = "y",
    classes: Optional[Sequence[str]] = None,
    estimator: str = "analytic",
    method: str = "",
    data: str = "",
    layout: Optional[InputLayout] = None,
) -> Path:
    """Write ``model`` to ``path`` atomically, with the scaling its inputs and target had.

    ``feature_mean`` / ``feature_std`` (``(D,)``; ``None``: the network takes the features as
    they are) and ``target_mean`` / ``target_std`` (regression) put new rows on the network's
    scale and its predictions back in original units. ``columns`` names the ``D`` features (new
    rows are then matched by name; ``None``: by position). ``classes``: a classifier's label
    names, one per class (default ``"0"``, ``"1"``, ...). ``layout``: how the model reads a
    table (:class:`~cfbnn_cli.data.layout.InputLayout`; its features are ``columns``, which it
    gives where ``columns`` is ``None``).
    """
    if not isinstance(model, BayesianNetwork):
        raise TypeError(f"`model` must be a cfbnn BayesianNetwork; got {type(model).__name__}")
    architecture = architecture_of(model)
    dim = architecture["input_dim"]
    if layout is not None:
        if not isinstance(layout, InputLayout):
            raise TypeError(f"`layout` must be an InputLayout; got {type(layout).__name__}")
        columns = layout.features if columns is None else columns
        if [str(c) for c in columns] != layout.features:
            raise ValueError("`columns` must be the layout's features")
    if columns is not None:
        columns = [str(c) for c in columns]
        if len(columns) != dim or len(set(columns)) != dim:
            raise ValueError(f"`columns` must be {dim} distinct names, one per input feature; got {len(columns)}")
    categorical = isinstance(model.likelihood, CategoricalLikelihood)
    if categorical:
        count = 2 if model.likelihood.logistic else model.output_dim
        classes = [str(k) for k in (classes if classes is not None else range(count))]
        if len(classes) != count or len(set(classes)) != count:
            raise ValueError(f"`classes` must be {count} distinct names, one per class; got {classes}")
    elif classes is not None:
        raise ValueError("`classes` is for a categorical network; this one is a regression network")
    if not (math.isfinite(target_mean) and math.isfinite(target_std) and target_std > 0):
        raise ValueError(
            f"`target_mean` must be finite and `target_std` finite and > 0; got {target_mean}, {target_std}"
        )
    if estimator not in ESTIMATORS:
        raise ValueError(f"`estimator` must be one of {ESTIMATORS}; got {estimator!r}")
    weights = finite_weights(
        model,
        "the model has non-finite weights (NaN or infinity); it cannot predict, so it is not saved "
        "(check the data for extreme values, or lower the learning rate)",
    )
    record = {
        "format": FORMAT,
        "version": VERSION,
        "task": "classification" if categorical else "regression",
        "architecture": architecture,
        "state_dict": weights,
        "scaling": {
            "feature_mean": _vector(feature_mean, "feature_mean", dim),
            "feature_std": _vector(feature_std, "feature_std", dim),
            "target_mean": float(target_mean),
            "target_std": float(target_std),
        },
        "columns": columns,
        "target": str(target),
        "classes": classes,
        "data": str(data),
        "estimator": str(estimator),
        "method": str(method),
        "layout": (layout or InputLayout(columns, str(target))).record() if columns is not None else None,
    }
    return atomic_torch_save(record, Path(path))


def save_run_model(run_dir, model: BayesianNetwork, data, scaling=None, **fields) -> Path:
    """``RUN_DIR/model.pt`` (:data:`FILE_NAME`) of a ``cfbnn train`` run, by :func:`save_model`:
    ``model`` with the name, feature ``columns`` and ``target`` of ``data``, the run's data set, and
    the training rows' ``feature_mean`` / ``feature_std`` of ``scaling`` (default ``data``, for a data
    set that holds its own scaling); ``fields``: :func:`save_model`'s other keywords."""
    scaling = data if scaling is None else scaling
    return save_model(
        Path(run_dir) / FILE_NAME,
        model,
        feature_mean=scaling.feature_mean,
        feature_std=scaling.feature_std,
        columns=data.columns,
        target=data.target,
        data=data.name,
        layout=getattr(data, "layout", None),
        **fields,
    )


# ----------------------------------------------------------------------------- reading


def _problem(path, field: str, why: str) -> DataError:
    return DataError(f"{path} is not a usable cfbnn model file: {field} {why}; retrain, or save it with save_model")


def checked_mapping(value, path, field: str, problem, needed=()) -> dict:
    """``value``, a file's ``field``, if it is a mapping that holds every key in ``needed``; else
    the reader's ``problem(path, field, why)`` raised (a model or head file: the reader says which)."""
    if not isinstance(value, dict):
        raise problem(path, f"`{field}`", "is missing or not a mapping")
    absent = [key for key in needed if key not in value]
    if absent:
        raise problem(path, f"`{field}`", f"lacks {', '.join(absent)}")
    return value


SMALL_ENTRY = 64  # numbers an entry of a state dict beside the layers' may hold (a likelihood's precision)


def _tensor_problem(value: torch.Tensor) -> Optional[str]:
    """Why ``value`` cannot be a weight read from a file, or ``None``: it must be a dense tensor of
    real floating-point numbers with its values in the file, laid out densely (a crafted view of
    shape (10^6, 10^6) over one stored number would be materialized by the first operation on it)."""
    if value.device.type == "meta":
        return "holds no values (a meta tensor)"
    if value.layout != torch.strided:
        return f"is a {str(value.layout).replace('torch.', '')} tensor, not a dense one"
    if not value.is_floating_point():
        return f"holds {str(value.dtype).replace('torch.', '')} values, not real floating-point weights"
    if not value.is_contiguous():
        return f"is a view of shape {tuple(value.shape)} over fewer stored numbers (its strides are {value.stride()})"
    stored = value.untyped_storage().nbytes() // value.element_size()
    if value.storage_offset() + value.numel() > stored:
        return f"has shape {tuple(value.shape)} but only {stored:,} stored numbers"
    return None


def checked_weights(weights, path, problem, shapes: Optional[dict] = None) -> dict:
    """``weights``, a file's ``state_dict``, if it maps names to dense real floating-point tensors
    (:func:`_tensor_problem`) whose values are all finite and, with ``shapes`` (``{name: shape}``,
    :func:`~.footprint.layer_shapes`), whose layers have those shapes -- checked before any network
    is built, so a small file cannot make the reader allocate what its header claims; entries beside
    ``shapes`` may hold a few numbers only (:data:`SMALL_ENTRY`). Else the reader's ``problem(path,
    field, why)`` raised."""
    if not isinstance(weights, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()
    ):
        raise problem(path, "`state_dict`", "is not a mapping of names to tensors")
    for name, value in weights.items():
        why = _tensor_problem(value)
        if why is not None:
            raise problem(path, f"`state_dict` entry {clip(name, 60)!r}", why)
    misfit = "`state_dict`", "does not fit the recorded architecture"
    for name, shape in (shapes or {}).items():
        if name not in weights:
            raise problem(path, misfit[0], f"{misfit[1]}: it lacks {name!r}")
        if tuple(weights[name].shape) != tuple(shape):
            raise problem(
                path,
                misfit[0],
                f"{misfit[1]}: {name!r} has shape {tuple(weights[name].shape)}, the architecture gives it {tuple(shape)}",
            )
    if shapes is not None:
        extra = [name for name, value in weights.items() if name not in shapes and value.numel() > SMALL_ENTRY]
        if extra:
            raise problem(
                path, misfit[0], f"{misfit[1]}: it holds {clip(extra[0], 60)!r}, which the architecture has not"
            )
    if not all(torch.isfinite(v).all() for v in weights.values()):
        raise problem(path, "`state_dict`", "holds NaN or infinite weights")
    return weights


def _count(value, path, field, low=0, high=MAX_WIDTH) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _problem(path, field, f"is {str(value)[:40]!r}, not a whole number in [{low}, {high}]")
    return value


def _choice(value, allowed, path, field: str):
    if not isinstance(value, str) or value not in allowed:
        raise _problem(path, field, f"is {str(value)[:40]!r}, not one of {sorted(allowed)}")
    return value


def _checked_architecture(a, path) -> dict:
    needed = ("input_dim", "hidden_sizes", "output_dim", "activation", "covariance", "likelihood")
    checked_mapping(a, path, "architecture", _problem, needed)
    from ..moments import ACTIVATIONS

    _count(a["input_dim"], path, "architecture.input_dim", 1)
    _count(a["output_dim"], path, "architecture.output_dim", 1)
    sizes = a["hidden_sizes"]
    if not isinstance(sizes, list) or not 1 <= len(sizes) <= MAX_LAYERS:
        raise _problem(
            path, "architecture.hidden_sizes", f"is {str(sizes)[:40]!r}, not a list of 1 to {MAX_LAYERS} widths"
        )
    for width in sizes:
        _count(width, path, "architecture.hidden_sizes", 1)
    widths = [a["input_dim"]] + sizes + [a["output_dim"]]
    _choice(a["activation"], ACTIVATIONS, path, "architecture.activation")
    _choice(a["likelihood"], _LIKELIHOODS, path, "architecture.likelihood")
    covariance = a["covariance"]
    if not isinstance(covariance, list) or not all(isinstance(c, str) and c in _COVARIANCES for c in covariance):
        raise _problem(path, "architecture.covariance", f"is {str(covariance)[:40]!r}, not a list of {_COVARIANCES}")
    _count(a.get("point_layers", 0), path, "architecture.point_layers", 0, len(widths) - 1)
    _count(a.get("rank", 10), path, "architecture.rank", 1)
    _choice(a.get("objective", "approximation"), CLASSIFICATION_OBJECTIVES, path, "architecture.objective")
    for key in ("output_bias", "learn_precision"):
        if not isinstance(a.get(key, True), bool):
            raise _problem(path, f"architecture.{key}", "is not true/false")
    _choice(a.get("prior", "fixed"), ("fixed", "empirical_bayes"), path, "architecture.prior")
    scale = a.get("prior_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise _problem(path, "architecture.prior_scale", f"is {str(scale)[:40]!r}, not a positive number")
    if len(covariance) != len(widths) - 1 - a.get("point_layers", 0):
        raise _problem(path, "architecture.covariance", f"has {len(covariance)} entries, not one per Gaussian layer")
    count = parameter_count(*_network_shape(a))  # the covariance factors included
    if count > MAX_PARAMETERS:
        raise _problem(path, "architecture", f"asks for {count:,} parameters (more than {MAX_PARAMETERS:,})")
    return a


def _network_shape(a) -> tuple:
    """The arguments of :func:`~.footprint.layer_shapes` for a checked architecture."""
    return (
        a["input_dim"],
        a["hidden_sizes"],
        a["output_dim"],
        a["covariance"],
        a.get("rank", 10),
        a.get("point_layers", 0),
        a.get("output_bias", True),
    )


def _checked_scaling(scaling, path, dim: int) -> dict:
    checked_mapping(scaling, path, "scaling", _problem)
    for key in ("feature_mean", "feature_std"):
        value = scaling.get(key)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.numel() != dim or not torch.isfinite(value).all():
            raise _problem(path, f"scaling.{key}", f"is not {dim} finite numbers")
    if scaling.get("feature_std") is not None and not (scaling["feature_std"] > 0).all():
        raise _problem(path, "scaling.feature_std", "has a value <= 0")
    for key in ("target_mean", "target_std"):
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _problem(path, f"scaling.{key}", f"is {str(value)[:40]!r}, not a finite number")
    if not scaling["target_std"] > 0:
        raise _problem(path, "scaling.target_std", "is not > 0")
    return scaling


def _names(value, path, field: str, count: int) -> Optional[List[str]]:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != count or not all(isinstance(v, str) for v in value):
        raise _problem(path, field, f"is not a list of {count} names")
    if len(set(value)) != count:  # each names an output column (p_<class>) or a feature
        raise _problem(path, field, "names the same one twice")
    return value


def _layout(record, path, columns, target: str, input_dim: int) -> Optional[InputLayout]:
    """The file's layout (version 3), or, for a version-2 file, its numeric columns by name."""
    value = record.get("layout")
    if value is None:
        return InputLayout(list(columns), target) if columns is not None else None
    try:
        layout = InputLayout.from_record(value, input_dim)
    except ValueError as error:
        raise _problem(path, "`layout`", str(error).removeprefix("layout")) from None
    if columns is None or layout.features != list(columns):
        raise _problem(path, "`layout`", "does not give the file's `columns`")
    return layout


def _text(value) -> str:
    """A free-text field (a name), kept short; anything else is shown as empty."""
    return value[:200] if isinstance(value, str) else ""


def _likelihood(a):
    name = a["likelihood"]
    if name == "heteroscedastic":
        return HeteroscedasticNormalLikelihood()
    if name in ("softmax", "logistic"):
        return CategoricalLikelihood(a.get("objective", "approximation"), logistic=name == "logistic")
    return _Normal(1.0, bool(a.get("learn_precision", True)))  # the precision itself comes with the weights


@dataclass
class SavedModel:
    """A network read by :func:`load_model`, with its scaling and names; :meth:`predict` takes
    rows in original units."""

    network: BayesianNetwork
    task: str  # "regression" | "classification"
    feature_mean: Optional[torch.Tensor]
    feature_std: Optional[torch.Tensor]
    target_mean: float
    target_std: float
    columns: Optional[List[str]]
    target: str
    classes: Optional[List[str]]
    estimator: str
    method: str = ""
    data: str = ""
    layout: Optional[InputLayout] = None  # how it reads a table by name (None: features by position)

    @property
    def input_dim(self) -> int:
        return self.network.input_dim

    @property
    def inputs(self) -> Optional[List[str]]:
        """The columns the model reads, in its order (a categorical one stands for its levels'
        indicators among :attr:`columns`); ``None``: unnamed features, read by position."""
        return list(self.layout.columns) if self.layout is not None else None

    @property
    def target_transform(self) -> str:
        return self.layout.target_transform if self.layout is not None else "none"

    def standardized(self, x, *, unseen: Optional[str] = None) -> torch.Tensor:
        """``x`` in original units on the network's scale (its dtype and device): a DataFrame read
        by column name, or ``(N, len(inputs))`` rows (an array or tensor, any numeric dtype and
        strides) by position; see :mod:`cfbnn_cli.data.frames`."""
        parameter = next(self.network.parameters())
        features = model_features(x, self.layout, self.input_dim, unseen=unseen)
        x = torch.from_numpy(features)
        if self.feature_mean is not None:
            x = (x - self.feature_mean.cpu()) / self.feature_std.cpu()
        return x.to(dtype=parameter.dtype, device=parameter.device)

    @torch.no_grad()
    def predict(
        self, x, *, estimator: Optional[str] = None, num_samples: int = 64, generator=None, unseen: Optional[str] = None
    ):
        """Regression: the :class:`~cfbnn_cli.bnn.predictive.Predictive` in the target's units
        (float64; a model fitted on ``log(target)``: the
        :class:`~cfbnn_cli.bnn.target_units.LogNormalPredictive` it implies); classification: a
        ``torch.distributions.Categorical`` over :attr:`classes`. ``x``: a DataFrame (by column
        name) or rows by position (:meth:`standardized`); ``unseen``: ``"error"`` or ``"zeros"``
        for a categorical level not seen in training (default: the model's own). ``estimator``: by
        default the model's own where it integrates every layer, else ``deterministic`` (one pass:
        :func:`~cfbnn_cli.bnn.predictive.default_estimator`); ``num_samples`` draws where one samples."""
        estimator = estimator or default_estimator(self.network, self.estimator)  # as `cfbnn predict`
        prediction = self.network.predict(
            self.standardized(x, unseen=unseen),
            estimator=estimator,
            num_samples=num_samples,
            generator=generator,
        )
        if self.task == "classification":
            return prediction
        return in_target_units(prediction, self.target_mean, self.target_std, self.target_transform)

    __call__ = predict


def load_model(path, map_location="cpu") -> SavedModel:
    """The model in ``path`` (eval mode, on ``map_location``); a file that is not a cfbnn model,
    or whose fields do not hold together, is one :class:`~cfbnn_cli.runtime.errors.DataError`
    naming the file and the field."""
    path = Path(path)
    if not path.is_file():
        what = describe_file(path)  # a FIFO is named, never opened: it would block the reader
        what = "no such model file" if what == "no such file" else what
        raise DataError(f"{path}: {what} (a `cfbnn train` run writes model.pt; save_model writes one)")
    require_memory(path.stat().st_size, f"reading the model file {path}", "predict on a machine with more memory")
    try:
        record = load_checkpoint(path, map_location=map_location, what="model file")
    except CheckpointError as error:  # its message says what failed; here nothing is resumed, so no resume hint
        raise DataError(str(error).split("; nothing was run", 1)[0] + "; retrain, or point at another file") from None
    kind, version = record.get("format"), record.get("version")
    kind = kind if isinstance(kind, str) else None  # a damaged header may hold anything
    version = version if isinstance(version, int) and not isinstance(version, bool) else None
    if kind == LEGACY_FORMAT and version == 1:
        record = dict(record, task="regression", classes=None)
    elif kind != FORMAT:
        raise DataError(f"{path} is not a cfbnn model file (written by save_model or `cfbnn train`)")
    elif version not in READ_VERSIONS:
        raise DataError(
            f"{path} has model-file version {str(record.get('version'))[:20]!r}; this cfbnn reads "
            f"{' and '.join(map(str, READ_VERSIONS))}"
        )
    a = _checked_architecture(record.get("architecture"), path)
    task = record.get("task")
    if (
        not isinstance(task, str)
        or task not in ("regression", "classification")
        or (task == "classification") != (a["likelihood"] in ("softmax", "logistic"))
    ):
        raise _problem(path, "`task`", f"{str(task)[:40]!r} does not match its likelihood {a['likelihood']}")
    scaling = _checked_scaling(record.get("scaling"), path, a["input_dim"])
    weights = checked_weights(record.get("state_dict"), path, _problem, layer_shapes(*_network_shape(a)))
    if task == "classification" and not isinstance(record.get("classes"), list):
        raise _problem(path, "`classes`", "is missing: a classifier's file names its classes")
    require_memory(
        FLOAT32 * parameter_count(*_network_shape(a)) * 2,
        f"the network of {path} ({parameter_count(*_network_shape(a)):,} parameters)",
        "predict on a machine with more memory",
    )
    try:
        network = BayesianNetwork(
            a["input_dim"],
            list(a["hidden_sizes"]),
            a["output_dim"],
            a["activation"],
            list(a["covariance"]),
            a.get("rank", 10),
            prior_scale=float(a.get("prior_scale", 1.0)),
            likelihood=_likelihood(a),
            point_layers=a.get("point_layers", 0),
            output_bias=bool(a.get("output_bias", True)),
            prior=a.get("prior", "fixed"),
        )
        network.load_state_dict(weights)
    except (RuntimeError, ValueError, KeyError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise _problem(path, "`state_dict`", f"does not fit the recorded architecture ({reason[:160]})") from None
    network.to(map_location).eval()
    count = 2 if a["likelihood"] == "logistic" else a["output_dim"]
    estimator = _choice(record.get("estimator", "analytic"), ESTIMATORS, path, "`estimator`")
    columns = _names(record.get("columns"), path, "`columns`", a["input_dim"])
    target = _text(record.get("target", "y"))
    layout = _layout(record, path, columns, target, a["input_dim"])
    if layout is not None and layout.target_transform != "none" and task != "regression":
        raise _problem(path, "`layout`", "transforms the target of a classifier")
    return SavedModel(
        network=network,
        task=task,
        feature_mean=scaling.get("feature_mean"),
        feature_std=scaling.get("feature_std"),
        target_mean=float(scaling["target_mean"]),
        target_std=float(scaling["target_std"]),
        columns=columns,
        target=target,
        classes=_names(record.get("classes"), path, "`classes`", count) if task == "classification" else None,
        estimator=estimator,
        method=_text(record.get("method", "")),
        data=_text(record.get("data", "")),
        layout=layout,
    )
