"""`cfbnn train regression`: one pipeline, two protocols (``cfg.protocol``).

* ``gradient_variance`` (default): train the paper's 90-200-200-1 mean-field BNN and
  measure the gradient variance of the two estimators (paper Table 1) --
  :mod:`.gradient_variance_study`.
* ``uci`` (``+experiment=uci``): the standard UCI regression protocol, the closed
  form side by side with local reparameterization, Pyro and a plain MLP --
  :mod:`.uci_protocol`.

``run(cfg, run_dir) -> dict``; no Hydra here.
"""

from __future__ import annotations

from omegaconf import DictConfig

from ...runtime.checks import require_choice

PROTOCOLS = ("gradient_variance", "uci")


def run(cfg: DictConfig, run_dir) -> dict:
    protocol = require_choice(cfg, "protocol", PROTOCOLS)
    if protocol == "uci":
        from .uci_protocol import run as run_protocol
    else:
        from .gradient_variance_study import run as run_protocol
    return run_protocol(cfg, run_dir)


__all__ = ["PROTOCOLS", "run"]
