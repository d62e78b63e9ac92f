"""Training checkpoints that let a killed run resume where it stopped.

One file holds the model, the optimizer, the epoch, every random generator's state,
the fingerprint of the config that wrote it and whatever the pipeline adds (its
history, its best epoch...); it is written atomically, so a crash mid-write leaves
the previous checkpoint intact.

Loading never runs code: :func:`load_checkpoint` uses ``torch.load(weights_only=True)``,
which unpickles only tensors and plain containers, so a crafted file fails to load
instead of executing. Every failure (truncated, corrupt, foreign, malicious) becomes
one :class:`~cfbnn_cli.runtime.errors.CheckpointError` naming the file and the way out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import torch

from .errors import CheckpointError
from .io import atomic_torch_save
from .rundir import refuse_other_config


def load_checkpoint(path, map_location="cpu", what: str = "checkpoint") -> dict:
    """``torch.load(path, weights_only=True)``; any failure is a one-line :class:`CheckpointError`."""
    path = Path(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # noqa: BLE001 - truncated zip, bad pickle, forbidden global...: all mean "unusable"
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"cannot load the {what} {path} ({type(error).__name__}: {reason[:200]}); nothing was run from it. "
            "Delete the file to start that part afresh, or start a fresh run dir"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path} is not a cfbnn {what} (a {type(state).__name__}, not a dict); delete it or start a fresh run dir"
        )
    return state


def load_model_weights(model, path, map_location="cpu", what: str = "checkpoint", hint: str = "") -> dict:
    """Load the ``model`` entry of the checkpoint ``path`` into ``model``; a file without one, or
    with weights of other shapes, is a one-line :class:`CheckpointError` (``hint`` says what
    the shapes depend on). Returns the whole checkpoint."""
    path = Path(path)
    state = load_checkpoint(path, map_location=map_location, what=what)
    weights = state.get("model")
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise CheckpointError(
            f"{path} is not a cfbnn {what} (no model weights in it); delete it or point at another file"
        )
    try:
        model.load_state_dict(weights)
    except (RuntimeError, ValueError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path} does not fit this model ({reason[:200]}){hint}") from None
    return state


def training_state_problem(state: dict) -> Optional[str]:
    """Why a loaded ``last.pt`` cannot be a training state written by :func:`save_training_state`
    (wrong types, a negative epoch, a missing field), or ``None``."""
    epoch = state.get("epoch")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        return f"its epoch is {epoch!r:.40}, not a count of finished epochs"
    for key in ("model", "optimizer", "generators"):
        if not isinstance(state.get(key), dict):
            return f"its {key} is {'missing' if key not in state else 'a ' + type(state[key]).__name__}, not a dict"
    if not all(isinstance(value, torch.Tensor) for value in state["model"].values()):
        return "its model holds values that are not tensors"
    if not all(torch.isfinite(value).all() for value in state["model"].values() if value.is_floating_point()):
        return "its model holds NaN or infinite weights: a diverged state, which training never saves"
    if not all(
        isinstance(value, torch.Tensor) and value.dtype == torch.uint8 for value in state["generators"].values()
    ):
        return "its generator states are not byte tensors"
    return None


_LAST_SAVED: list = []  # the last checkpoint this process wrote (a path), for the Ctrl-C message


def note_saved(path) -> None:
    """Remember ``path`` as the last checkpoint this process wrote (a training state, or a
    protocol's progress record): what an interrupted command can name as kept."""
    _LAST_SAVED[:] = [Path(path)]


def last_saved() -> Optional[Path]:
    """The last checkpoint this process wrote (:func:`note_saved`), ``None`` before the first."""
    return _LAST_SAVED[0] if _LAST_SAVED else None


def save_training_state(
    path,
    model,
    optimizer,
    epoch: int,
    generators: Dict[str, torch.Generator],
    fingerprint: Optional[str] = None,
    **extra,
) -> Path:
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "generators": {name: g.get_state() for name, g in generators.items()},
        "config_fingerprint": fingerprint,
        **extra,
    }
    written = atomic_torch_save(state, Path(path))
    note_saved(written)
    return written


def restore_training_state(
    path, model, optimizer, generators: Dict[str, torch.Generator], device, fingerprint: Optional[str] = None
) -> Optional[dict]:
    """Load ``path`` into ``model``, ``optimizer`` and ``generators``; ``None`` if it does not exist.

    With ``fingerprint``, a checkpoint written by another configuration is refused
    (:class:`~cfbnn_cli.runtime.errors.ConfigError`). Returns the whole state
    (``epoch`` and the pipeline's extra fields).
    """
    path = Path(path)
    if not path.exists():
        return None
    state = load_checkpoint(path, map_location=device, what="training checkpoint")
    if fingerprint is not None:
        refuse_other_config(str(path), state.get("config_fingerprint"), fingerprint)
    problem = training_state_problem(state)
    if problem is not None:
        raise CheckpointError(
            f"{path} is not a cfbnn training checkpoint ({problem}); delete it or start a fresh run dir"
        )
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        for name, generator in generators.items():
            # a CUDA generator's state is a CPU byte tensor; keep it where the generator wants it
            generator.set_state(state["generators"][name].to(generator.get_state().device))
    except (KeyError, RuntimeError, ValueError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"{path} does not fit this model ({reason[:200]}); delete it or start a fresh run dir"
        ) from None
    return state
