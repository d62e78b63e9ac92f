"""`cfbnn imagenet-predict` (paper Figure 1): the stages and ``run`` in :mod:`.pipeline`, the
feature cache in :mod:`.features`, the evaluation (Monte Carlo against the deterministic
prediction) in :mod:`.prediction`."""

from .pipeline import compute_features, run, supports_distributed, validate
from .prediction import expected_calibration_error, monte_carlo_accuracy, top_k_correct

__all__ = [
    "compute_features",
    "expected_calibration_error",
    "monte_carlo_accuracy",
    "run",
    "supports_distributed",
    "top_k_correct",
    "validate",
]
