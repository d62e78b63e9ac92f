"""Cheap NaN/Inf detection for training loops."""

from __future__ import annotations

import torch

from .errors import CfbnnError


class NonFiniteLossError(CfbnnError):
    """The objective became NaN or infinite; the message names epoch and step."""

    exit_code = 1


def ensure_finite(loss: torch.Tensor, *, epoch: int = None, step: int = None, what: str = "loss") -> None:
    """Raise :class:`NonFiniteLossError` if ``loss`` is NaN/Inf (one scalar check).

    On CUDA this synchronizes once; call it every step or every few steps.
    """
    if not bool(torch.isfinite(loss.detach()).all()):
        where = ", ".join(f"{k} {v}" for k, v in (("epoch", epoch), ("step", step)) if v is not None)
        raise NonFiniteLossError(
            f"the {what} became {loss.detach().flatten()[0].item()} at {where or 'this step'}; "
            "lower trainer.lr or check the data for extreme values (the last good checkpoint is kept)"
        )


# Evaluation works on chunks of rows so that its peak memory is bounded by this many
# elements per intermediate (samples x rows x hidden units), not by the test-set size.
EVALUATION_CHUNK_ELEMENTS = 1 << 24  # 64 MB of float32


def rows_per_chunk(elements_per_row: int, budget: int = EVALUATION_CHUNK_ELEMENTS) -> int:
    """How many rows fit in one evaluation chunk when each costs ``elements_per_row``."""
    return max(1, budget // max(1, int(elements_per_row)))


def map_row_chunks(function, x: torch.Tensor, chunk_rows: int, dim: int = -1):
    """``function`` on consecutive chunks of ``chunk_rows`` rows of ``x``, outputs concatenated
    along ``dim`` (the row dimension of the outputs); a tuple of outputs stays a tuple."""
    outputs = [function(x[start : start + chunk_rows]) for start in range(0, x.shape[0], chunk_rows)]
    if isinstance(outputs[0], tuple):
        return tuple(torch.cat(parts, dim=dim) for parts in zip(*outputs))
    return torch.cat(outputs, dim=dim)
