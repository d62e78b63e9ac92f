"""``model.pt``: a trained regression network with what it takes to predict on new rows.

Written atomically by ``cfbnn train regression`` when a run finishes, read by ``cfbnn predict``.
It holds plain tensors, numbers, strings and lists only, so it loads with
``torch.load(weights_only=True)`` (no pickle of arbitrary objects):

* ``architecture``: the keyword arguments that rebuild the :class:`~cfbnn_cli.bnn.BayesianNetwork`;
* ``state_dict``: its weights (CPU);
* ``scaling``: the training rows' feature means and standard deviations and the target's mean and
  standard deviation (the network sees standardized values; predictions are given in original units);
* ``columns`` / ``target``: the feature names and the target's name (``None`` for generated data,
  whose features are read by position);
* ``estimator``: the estimator the run trained with (the default for predicting).
"""

from __future__ import annotations

from pathlib import Path
from typing import Tuple

import torch

from ...bnn import BayesianNetwork, NormalLikelihood
from ...bnn.likelihoods import HeteroscedasticNormalLikelihood
from ...runtime.checkpoints import load_checkpoint
from ...runtime.errors import DataError
from ...runtime.io import atomic_torch_save

FORMAT = "cfbnn.regression_model"
VERSION = 1
FILE_NAME = "model.pt"


def save_regression_model(run_dir, model: BayesianNetwork, cfg, data) -> Path:
    heteroscedastic = isinstance(model.likelihood, HeteroscedasticNormalLikelihood)
    record = {
        "format": FORMAT,
        "version": VERSION,
        "architecture": {
            "input_dim": int(data.input_dim),
            "hidden_sizes": [int(h) for h in cfg.model.hidden_sizes],
            "output_dim": 2 if heteroscedastic else 1,
            "activation": str(cfg.model.activation),
            "prior_scale": float(cfg.model.prior_scale),
            "init_scale": float(cfg.model.init_scale),
            "prior": str(cfg.model.prior),
            "likelihood": "heteroscedastic" if heteroscedastic else "normal",
            "precision": float(cfg.model.precision),
            "learn_precision": bool(cfg.model.learn_precision),
        },
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "scaling": {
            "feature_mean": torch.as_tensor(data.feature_mean, dtype=torch.float64),
            "feature_std": torch.as_tensor(data.feature_std, dtype=torch.float64),
            "target_mean": float(data.target_mean),
            "target_std": float(data.target_std),
        },
        "columns": list(data.columns) if data.columns is not None else None,
        "target": str(data.target),
        "data": str(data.name),
        "estimator": str(cfg.estimator),
    }
    return atomic_torch_save(record, Path(run_dir) / FILE_NAME)


def load_regression_model(path) -> Tuple[BayesianNetwork, dict]:
    """``(model in eval mode, the record without its weights)``; a file that is not a cfbnn
    regression model is one :class:`DataError` naming it."""
    record = load_checkpoint(path, what="model file")
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise DataError(f"{path} is not a cfbnn regression model file (written by `cfbnn train regression`)")
    if record.get("version") != VERSION:
        raise DataError(f"{path} has model-file version {record.get('version')!r}; this cfbnn reads {VERSION}")
    a = record["architecture"]
    likelihood = (
        HeteroscedasticNormalLikelihood()
        if a["likelihood"] == "heteroscedastic"
        else NormalLikelihood(a["precision"], a["learn_precision"])
    )
    model = BayesianNetwork(
        a["input_dim"],
        list(a["hidden_sizes"]),
        a["output_dim"],
        a["activation"],
        prior_scale=a["prior_scale"],
        init_scale=a["init_scale"],
        likelihood=likelihood,
        prior=a["prior"],
    )
    try:
        model.load_state_dict(record["state_dict"])
    except (RuntimeError, KeyError) as error:
        raise DataError(f"{path}: the weights do not fit the recorded architecture ({error})") from None
    model.eval()
    info = {key: value for key, value in record.items() if key != "state_dict"}
    return model, info
