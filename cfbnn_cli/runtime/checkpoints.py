"""Training checkpoints that let a killed run resume where it stopped.

One file holds the model, the optimizer, the epoch, every random generator's state
and whatever the pipeline adds (its history, its best epoch...); it is written
atomically, so a crash mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import torch

from .io import atomic_torch_save


def save_training_state(path, model, optimizer, epoch: int, generators: Dict[str, torch.Generator], **extra) -> Path:
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
             "generators": {name: g.get_state() for name, g in generators.items()}, **extra}
    return atomic_torch_save(state, Path(path))


def restore_training_state(path, model, optimizer, generators: Dict[str, torch.Generator], device) -> Optional[dict]:
    """Load ``path`` into ``model``, ``optimizer`` and ``generators``; ``None`` if it does not exist.

    Returns the whole state (``epoch`` and the pipeline's extra fields).
    """
    path = Path(path)
    if not path.exists():
        return None
    state = torch.load(path, map_location=device, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    for name, generator in generators.items():
        # a CUDA generator's state is a CPU byte tensor; keep it where the generator wants it
        generator.set_state(state["generators"][name].to(generator.get_state().device))
    return state
