"""The ``fit.*`` keys both own-data commands share (``train regression`` with ``protocol: fit``,
``train classification``): whether to refit on every row, and the stopping rules of full-batch
L-BFGS (:mod:`.full_batch`) and of minibatch Adam with validation stopping (:mod:`.loop`)."""

from __future__ import annotations

from omegaconf import DictConfig

from ..runtime.checks import require_bool, require_fraction, require_int, require_positive_float


def validate_fit_settings(cfg: DictConfig) -> None:
    """Check ``fit.refit``, ``fit.full_batch_max_rows``, ``fit.max_iterations``, ``fit.evaluate_every``,
    ``fit.patience``, ``fit.rtol`` and ``fit.validation_fraction``; each error names the key."""
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
