"""`cfbnn train regression`: one pipeline, two protocols (``cfg.protocol``).

* ``gradient_variance`` (default): train the paper's 90-200-200-1 mean-field BNN and
  measure the gradient variance of the two estimators (paper Table 1) --
  :mod:`.gradient_variance_study`.
* ``uci`` (``experiment=uci``): the standard UCI regression protocol, the closed
  form side by side with local reparameterization, Pyro and a plain MLP --
  :mod:`.uci_protocol`.

``run(cfg, run_dir) -> dict``; no Hydra here.
"""

from __future__ import annotations

from omegaconf import DictConfig

from ...runtime.checks import require_choice

PROTOCOLS = ("gradient_variance", "uci")


def _protocol(cfg: DictConfig):
    protocol = require_choice(cfg, "protocol", PROTOCOLS)
    if protocol == "uci":
        from . import uci_protocol as module
    else:
        from . import gradient_variance_study as module
    return module


def validate(cfg: DictConfig) -> None:
    """Every check of the chosen protocol that needs no data."""
    _protocol(cfg).validate(cfg)


def supports_distributed(cfg: DictConfig) -> bool:
    """Table 1's training runs under torchrun (``distributed.nproc``); the UCI protocol's small splits do not."""
    return cfg.protocol == "gradient_variance"


def run(cfg: DictConfig, run_dir, values=None) -> dict:
    """The protocol's run; ``values``: the config's typed values (:mod:`cfbnn_cli.run_values`)."""
    return _protocol(cfg).run(cfg, run_dir, values)


__all__ = ["PROTOCOLS", "run", "supports_distributed", "validate"]
