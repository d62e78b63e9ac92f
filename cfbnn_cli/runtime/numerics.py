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
