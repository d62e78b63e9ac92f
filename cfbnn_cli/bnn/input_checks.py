"""The shapes, dtypes and devices a :class:`~cfbnn_cli.bnn.network.BayesianNetwork` takes, checked
where a user's tensors enter it (``elbo``, ``expected_log_likelihood*``, ``predict``,
``output_moments``, ``model(x)``), so that a wrong one is a ``ValueError`` naming the argument, its
shape and the fix, instead of a matrix-product or broadcasting error from deep inside a kernel.

Inputs ``x`` are ``(..., N, D)``: a float tensor of the parameters' dtype, on their device, ``D``
the network's ``input_dim``. Targets are the likelihood's business (its ``check_targets``): a
Normal likelihood takes ``(..., N)`` or ``(..., N, 1)`` for one output (the column that
``nn.Linear``-style code and ``MSELoss`` use is accepted and squeezed) and ``(..., N, O)`` for
``O`` outputs, cast to the inputs' dtype; a categorical one integer class indices ``(..., N)``
(or ``(..., N, 1)``) in ``[0, num_classes)``.
"""

from __future__ import annotations

import torch
from torch import nn


def _shape(t) -> tuple:
    return tuple(t.shape)


def check_inputs(network, x) -> None:
    """Raise ``ValueError`` unless ``x`` is a ``(..., N, input_dim)`` float tensor on the
    parameters' device and of their dtype."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"`x` must be a torch.Tensor of shape (N, {network.input_dim}); got {type(x).__name__}")
    if x.dim() < 2 or x.shape[-1] != network.input_dim:
        raise ValueError(
            f"`x` must have shape (..., N, {network.input_dim}) (the network's input_dim={network.input_dim}); "
            f"got {_shape(x)}" + ("; for one point pass x.unsqueeze(0)" if x.dim() == 1 else "")
        )
    first = network.layers[0]
    reference = first.weight if isinstance(first, nn.Linear) else first.loc  # (parameters() costs ~4 us)
    if x.dtype != reference.dtype:
        raise ValueError(
            f"`x` is {x.dtype} but the network's parameters are {reference.dtype}; pass x.to({reference.dtype}) "
            f"or convert the network with network.to({x.dtype})"
            if x.is_floating_point()
            else f"`x` must be a float tensor ({reference.dtype}, the parameters' dtype); got {x.dtype}"
        )
    if x.device != reference.device:
        raise ValueError(
            f"`x` is on {x.device} but the network's parameters are on {reference.device}; "
            f"move one to the other (x.to({str(reference.device)!r}) or network.to({str(x.device)!r}))"
        )


def rows_matching(y, rows: int, columns: int, what: str, expected: str, x_shape: tuple):
    """``y`` as ``(..., rows)`` (``columns == 0``) or ``(..., rows, columns)``; a trailing column of
    one is dropped where ``columns == 0``. ``ValueError`` naming ``expected`` otherwise."""
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"`{what}` must be a torch.Tensor of shape {expected}; got {type(y).__name__}")
    if columns == 0 and y.dim() >= 2 and y.shape[-1] == 1 and y.shape[-2] == rows:
        y = y[..., 0]
    trailing = (rows,) if columns == 0 else (rows, columns)
    lead_dims = len(x_shape) - 2
    if y.dim() < len(trailing) or _shape(y)[-len(trailing) :] != trailing or y.dim() > lead_dims + len(trailing):
        raise ValueError(f"`{what}` must have shape {expected} to match x of shape {x_shape}; got {_shape(y)}")
    return y


def float_targets(y, x, columns: int, expected: str):
    """Regression targets for inputs ``x``: :func:`rows_matching` (``columns`` 0 for one per row),
    on ``x``'s device, cast to its dtype."""
    y = rows_matching(y, x.shape[-2], columns, "y", expected, tuple(x.shape))
    check_device(y, x, "y")
    return y if y.dtype == x.dtype else y.to(x.dtype)


def check_device(y, x, what: str) -> None:
    if y.device != x.device:
        raise ValueError(f"`{what}` is on {y.device} but `x` is on {x.device}; move both to one device")


def check_count(value, name: str, minimum: int = 1) -> int:
    """``value`` as an int of at least ``minimum`` (a sample count, a chunk size); ``ValueError``
    naming ``name`` otherwise (a bool, a fraction, ``0``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}; got {value!r}")
    return int(value)


def check_num_data(num_data, batch: int):
    """``num_data`` of an ELBO (the data set's size, which scales the minibatch's likelihood):
    ``None`` or an integer >= 1, and a non-empty batch to scale from."""
    if num_data is None:
        return None
    if isinstance(num_data, torch.Tensor) and num_data.numel() == 1:
        num_data = num_data.item()
    num_data = check_count(num_data, "num_data")
    if batch == 0:
        raise ValueError(f"num_data={num_data} scales a minibatch's likelihood by num_data / batch; the batch is empty")
    return num_data
