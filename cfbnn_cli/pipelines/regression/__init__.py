"""`cfbnn train regression`: one pipeline, two protocols (``cfg.protocol``).

* ``gradient_variance`` (default): train the paper's 90-200-200-1 mean-field BNN and
  measure the gradient variance of the two estimators (paper Table 1) --
  :mod:`.gradient_variance_study`.
* ``uci`` (``experiment=uci``): the standard UCI regression protocol, the closed
  form side by side with local reparameterization, Pyro and a plain MLP --
  :mod:`.uci_protocol`.

``run(cfg, run_dir, values) -> dict`` (:mod:`.protocols`); no Hydra here.
"""

from .protocols import PROTOCOLS, run, supports_distributed, validate

__all__ = ["PROTOCOLS", "run", "supports_distributed", "validate"]
