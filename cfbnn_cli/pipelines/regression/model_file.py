"""``model.pt``: a trained regression network with what it takes to predict on new rows.

It holds plain tensors, numbers, strings and lists only, so it loads with
``torch.load(weights_only=True)`` (no pickle of arbitrary objects):

* ``architecture``: the keyword arguments that rebuild the :class:`~cfbnn_cli.bnn.BayesianNetwork`
  (:func:`architecture_of`);
* ``state_dict``: its weights (CPU);
* ``scaling``: the training rows' feature means and standard deviations and the target's mean and
  standard deviation (the network sees standardized values; predictions are given in original units);
* ``columns`` / ``target``: the feature names and the target's name (``None`` for generated data,
  whose features are read by position);
* ``estimator``: the estimator the run trained with (the default for predicting); ``method``:
  the UCI protocol's method it is (empty for a ``train regression`` run).

Written atomically by ``cfbnn train regression`` when a run finishes (and by the UCI protocol
for ``uci.save_model=<method>``: that method refit on every row), read by ``cfbnn predict``.
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


def architecture_of(model: BayesianNetwork) -> dict:
    """The keyword arguments that rebuild ``model`` (its weights then come from its state dict)."""
    layers = list(model.layers)
    gaussian = model.gaussian_layers
    heteroscedastic = isinstance(model.likelihood, HeteroscedasticNormalLikelihood)
    ranks = [layer.factor.shape[-1] for layer in gaussian if layer.covariance == "lowrank"]
    first = layers[0]
    input_dim = first.in_features if isinstance(first, torch.nn.Linear) else first.loc.shape[1] - int(first.bias)
    return {
        "input_dim": int(input_dim),
        "hidden_sizes": [int(layer.out_features) for layer in layers[:-1]],
        "output_dim": int(model.output_dim),
        "activation": str(model.activation.name),
        "covariance": [str(layer.covariance) for layer in gaussian],
        "rank": int(ranks[0]) if ranks else 10,
        "prior_scale": float(model.prior_scale),
        "prior": str(model.prior),
        "point_layers": int(model.point_layers),
        "output_bias": bool(getattr(layers[-1], "bias", True) is not False),
        "likelihood": "heteroscedastic" if heteroscedastic else "normal",
        "learn_precision": isinstance(getattr(model.likelihood, "log_precision", None), torch.nn.Parameter),
    }


def save_regression_model(run_dir, model: BayesianNetwork, data, estimator, method: str = "") -> Path:
    record = {
        "format": FORMAT,
        "version": VERSION,
        "architecture": architecture_of(model),
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
        "estimator": str(estimator),
        "method": str(method),
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
        else NormalLikelihood(1.0, a["learn_precision"])  # the precision itself comes with the weights
    )
    model = BayesianNetwork(
        a["input_dim"],
        list(a["hidden_sizes"]),
        a["output_dim"],
        a["activation"],
        list(a["covariance"]),
        a["rank"],
        prior_scale=a["prior_scale"],
        likelihood=likelihood,
        point_layers=a["point_layers"],
        output_bias=a["output_bias"],
        prior=a["prior"],
    )
    try:
        model.load_state_dict(record["state_dict"])
    except (RuntimeError, KeyError) as error:
        raise DataError(f"{path}: the weights do not fit the recorded architecture ({error})") from None
    model.eval()
    info = {key: value for key, value in record.items() if key != "state_dict"}
    return model, info
