"""Seeding: one call seeds Python, NumPy and torch; explicit generators for sampling."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> torch.Generator:
    """Seed the global RNGs and return a CPU ``torch.Generator`` seeded with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator
