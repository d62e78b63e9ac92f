import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # for tests/reference.py


@pytest.fixture(autouse=True)
def _clear_hydra():
    """Hydra keeps global state between compose/initialize calls; reset it around each test."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
