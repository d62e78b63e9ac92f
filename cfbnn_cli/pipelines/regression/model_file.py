"""``model.pt`` of a ``train regression`` run: the network with its data's scaling and names
(:func:`cfbnn_cli.bnn.model_file.save_model`; read by ``cfbnn predict`` and
:func:`cfbnn_cli.bnn.load_model`)."""

from __future__ import annotations

from pathlib import Path

from ...bnn.model_file import save_run_model
from ...data.regression import RegressionData


def save_regression_model(run_dir, model, data: RegressionData, estimator, method: str = "") -> Path:
    """``RUN_DIR/model.pt``: ``model`` trained on ``data`` (standardized by its training rows)."""
    return save_run_model(
        run_dir,
        model,
        data,
        target_mean=data.target_mean,
        target_std=data.target_std,
        estimator=str(estimator),
        method=method,
    )
