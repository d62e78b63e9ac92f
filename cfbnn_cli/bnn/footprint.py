"""What a network costs in memory, counted before it is built: its parameters (the covariance
factors included) and what training or predicting holds per row.

:func:`layer_shapes` and :func:`parameter_count` say what :class:`~.network.BayesianNetwork`
would allocate -- a full-covariance layer's ``(out, in + 1, in + 1)`` factors, a low-rank layer's
``(out, in + 1, rank)`` ones -- from its arguments alone (a network built on PyTorch's ``meta``
device would say the same, but its first random draw there imports torch's compiler: 4 s).
:func:`training_bytes` and :func:`prediction_bytes` turn that and the rows a step holds at once
into bytes, for :func:`~cfbnn_cli.runtime.memory.require_memory`.

The constants come from measurements (``cfbnn train classification`` on digits' 1,617 training
rows, 2-core CPU): peak memory grew by 1.46 GB at width 16,000 after 25 L-BFGS iterations
(estimated here: 1.28 GB), and by 3.1 GB at width 32,000 after only 5 (estimated with the whole
history: 2.6 GB); at widths of a few thousand the
allocator's fixed costs dominate (0.69 GB measured at 4,000, 0.32 GB estimated). The estimate
stays below what a run really takes, so a refusal means the run would not fit.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..runtime.memory import FLOAT32

# numbers per row and unit held while an objective and its gradient are computed (moments of the
# pre-activations and activations, their gradients; see the module docstring)
ACTIVATION_FLOATS = 8
PREDICTION_FLOATS = 4  # the same without gradients
PARAMETER_TEMPORARIES = 2  # parameter-sized tensors an objective builds beside them (a covariance's scale)
LBFGS_EXTRA = 5  # L-BFGS's copies beside its history: the gradient, flat gradients, the direction


def _widths(input_dim: int, hidden_sizes: Sequence[int], output_dim: int) -> list:
    return [int(input_dim), *[int(h) for h in hidden_sizes], int(output_dim)]


def _covariances(covariance: Union[str, Sequence[str]], layers: int, point_layers: int) -> List[Optional[str]]:
    """Each layer's covariance, ``None`` for a point layer (they come first)."""
    gaussian = layers - point_layers
    kinds = [covariance] * gaussian if isinstance(covariance, str) else list(covariance)
    return [None] * point_layers + kinds


def layer_shapes(
    input_dim: int,
    hidden_sizes: Sequence[int],
    output_dim: int = 1,
    covariance: Union[str, Sequence[str]] = "diagonal",
    rank: int = 10,
    point_layers: int = 0,
    output_bias: bool = True,
) -> Dict[str, Tuple[int, ...]]:
    """The shapes of the weights :class:`~.network.BayesianNetwork` gives its layers (the
    ``layers.*`` entries of its state dict, the covariance factors included), from its arguments
    alone: nothing is built or allocated. ``tests/bnn/test_footprint.py`` holds them to the network's own."""
    widths = _widths(input_dim, hidden_sizes, output_dim)
    layers = len(widths) - 1
    shapes: Dict[str, Tuple[int, ...]] = {}
    for index, ((inputs, outputs), kind) in enumerate(
        zip(zip(widths[:-1], widths[1:]), _covariances(covariance, layers, int(point_layers)))
    ):
        name = f"layers.{index}"
        if kind is None:
            shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (outputs, inputs), (outputs,)
            continue
        cols = inputs + int(bool(output_bias) or index < layers - 1)
        shapes[f"{name}.loc"] = shapes[f"{name}.log_scale"] = (outputs, cols)
        if kind == "full":
            shapes[f"{name}.off_diagonal"] = (outputs, cols, cols)
        elif kind == "lowrank":
            shapes[f"{name}.factor"] = (outputs, cols, int(rank))
    return shapes


def _product(shape: Sequence[int]) -> int:
    return math.prod(int(size) for size in shape)


def parameter_count(
    input_dim: int,
    hidden_sizes: Sequence[int],
    output_dim: int = 1,
    covariance: Union[str, Sequence[str]] = "diagonal",
    rank: int = 10,
    point_layers: int = 0,
    output_bias: bool = True,
) -> int:
    """The numbers the layers of :class:`~.network.BayesianNetwork` with these arguments hold: their
    weights (:func:`layer_shapes`, the covariance factors included) and a full-covariance layer's
    ``(in + 1, in + 1)`` mask. Counted, not built."""
    shapes = layer_shapes(input_dim, hidden_sizes, output_dim, covariance, rank, point_layers, output_bias)
    masks = sum(shape[1] * shape[2] for name, shape in shapes.items() if name.endswith(".off_diagonal"))
    return sum(_product(shape) for shape in shapes.values()) + masks


def per_row_floats(
    input_dim: int,
    hidden_sizes: Sequence[int],
    output_dim: int,
    covariance: Union[str, Sequence[str]] = "diagonal",
    rank: int = 10,
) -> int:
    """Units a row passes through (every hidden and output unit), and for a full-covariance or
    low-rank layer the ``in + 1`` or ``rank`` numbers per unit its variance takes per row."""
    widths = _widths(input_dim, hidden_sizes, output_dim)
    layers = len(widths) - 1
    kinds = [covariance] * layers if isinstance(covariance, str) else list(covariance)
    total = 0
    for (inputs, outputs), kind in zip(zip(widths[:-1], widths[1:]), ["diagonal"] * (layers - len(kinds)) + kinds):
        total += outputs * (1 + (inputs + 1 if kind == "full" else rank if kind == "lowrank" else 0))
    return total


def training_bytes(parameters: int, rows: int, row_floats: int, optimizer: str = "lbfgs", history: int = 20) -> int:
    """Bytes a fit holds at once: the parameters with their gradients, temporaries and optimizer
    state (``lbfgs``: ``2 * history`` past steps; ``adam``: two moments), and ``rows`` rows'
    activations with their gradients."""
    copies = 2 * history + LBFGS_EXTRA if optimizer == "lbfgs" else 4
    return FLOAT32 * (parameters * (copies + PARAMETER_TEMPORARIES) + rows * row_floats * ACTIVATION_FLOATS)


def prediction_bytes(parameters: int, rows: int, row_floats: int) -> int:
    """Bytes a prediction of ``rows`` rows at once holds (no gradients)."""
    return FLOAT32 * (parameters * (1 + PARAMETER_TEMPORARIES) + rows * row_floats * PREDICTION_FLOATS)


def rows_at_once(train_rows: int, full_batch_max_rows: int, batch_size: int, refit_rows: int = 0) -> Tuple[int, str]:
    """``(rows, optimizer)`` of an own-data fit (``train regression`` with ``protocol=fit``, ``train
    classification``) and its refit on all ``refit_rows``: every row at once for L-BFGS up to
    ``full_batch_max_rows``, else Adam's minibatches of ``batch_size``."""
    fits = [int(r) for r in (train_rows, refit_rows) if int(r) > 0]
    full = [r for r in fits if r <= int(full_batch_max_rows)]
    rows = max(full + [min(int(batch_size), r) for r in fits if r > int(full_batch_max_rows)] + [0])
    return rows, "lbfgs" if full else "adam"


def require_fit_memory(
    setting: str,
    input_dim: int,
    hidden_sizes: Sequence[int],
    output_dim: int,
    *,
    rows: int,
    optimizer: str = "lbfgs",
    prediction_rows: int = 0,
    covariance: Union[str, Sequence[str]] = "diagonal",
    rank: int = 10,
    fix: str,
) -> None:
    """Refuse (one line naming ``setting`` and ``fix``) a fit whose network and ``rows`` at once --
    or ``prediction_rows`` predicted at once -- would take more memory than this process has
    (:func:`~cfbnn_cli.runtime.memory.require_memory`); before anything is allocated."""
    from ..runtime.memory import require_memory

    parameters = parameter_count(input_dim, hidden_sizes, output_dim, covariance, rank)
    floats = per_row_floats(input_dim, hidden_sizes, output_dim, covariance, rank)
    needed = max(
        training_bytes(parameters, rows, floats, optimizer), prediction_bytes(parameters, prediction_rows, floats)
    )
    kinds = {covariance} if isinstance(covariance, str) else set(covariance)
    factors = ", the covariance factors included" if kinds - {"diagonal"} else ""
    require_memory(
        needed, f"{setting} ({parameters:,} parameters{factors}) with {max(rows, prediction_rows):,} rows at once", fix
    )
