"""`cfbnn train regression`'s three protocols: which one ``cfg.protocol`` names, and the pipeline's
``validate`` / ``supports_distributed`` / ``run`` handed to it."""

from __future__ import annotations

from omegaconf import DictConfig

from ...runtime.checks import require_choice

PROTOCOLS = ("gradient_variance", "uci", "fit")


def _protocol(cfg: DictConfig):
    protocol = require_choice(cfg, "protocol", PROTOCOLS)
    if protocol == "uci":
        from . import uci_protocol as module
    elif protocol == "fit":
        from . import fit as module
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
