"""A record of the software and hardware a run used (for results.json)."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path


def git_commit(path=None):
    """The current git commit of the source tree, or None outside a checkout."""
    try:
        root = Path(path or Path(__file__).resolve().parents[2])
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment_record(device=None) -> dict:
    import torch

    import cfbnn_cli

    try:
        import pyro

        pyro_version = pyro.__version__
    except ImportError:  # pragma: no cover
        pyro_version = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyro": pyro_version,
        "cfbnn": cfbnn_cli.__version__,
        "device": str(device) if device is not None else None,
        "cuda_device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        # in effect while the run went on (runtime.matmul_precision): "high" lets CUDA use TF32
        "matmul_precision": torch.get_float32_matmul_precision(),
        "platform": platform.platform(),
        "git_commit": git_commit(),
    }
