"""The keys both own-data commands share (``train regression`` with ``protocol: fit``, ``train
classification``): the held-out share, the network's widths, activation and scales, the epochs,
whether to refit on every row, and the stopping rules of full-batch L-BFGS (:mod:`.full_batch`)
and of minibatch Adam with validation stopping (:mod:`.loop`)."""

from __future__ import annotations

from omegaconf import DictConfig

from ..moments import ACTIVATIONS
from ..runtime.checks import (
    require_bool,
    require_choice,
    require_fraction,
    require_int,
    require_positive_float,
    require_widths,
)


def validate_fit_settings(cfg: DictConfig) -> None:
    """Check ``data.test_fraction``, ``model.hidden_sizes``, ``model.activation``, ``model.init_scale``,
    ``model.prior_scale``, ``fit.refit``, ``fit.full_batch_max_rows``, ``fit.max_iterations``,
    ``fit.evaluate_every``, ``fit.patience``, ``fit.rtol``, ``fit.validation_fraction`` and
    ``trainer.epochs``; each error names the key."""
    require_fraction(cfg, "data.test_fraction", 1.0, "the held-out share (e.g. 0.1)")
    require_widths(cfg, "model.hidden_sizes", example="[50]")
    require_choice(cfg, "model.activation", sorted(ACTIVATIONS))
    require_positive_float(cfg, "model.init_scale")
    require_positive_float(cfg, "model.prior_scale")
    require_bool(cfg, "fit.refit")
    for key in ("full_batch_max_rows", "max_iterations", "evaluate_every", "patience"):
        require_int(cfg, f"fit.{key}", minimum=1)
    require_positive_float(cfg, "fit.rtol")
    require_fraction(
        cfg,
        "fit.validation_fraction",
        0.5,
        "the share of the training rows that decides when minibatch training stops (e.g. 0.1)",
    )
    require_int(cfg, "trainer.epochs", minimum=1)
