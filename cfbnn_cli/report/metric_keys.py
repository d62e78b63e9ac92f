"""The metric keys the pipelines write into ``results.json`` (and ``metrics.csv``), defined once for
the pipelines that write them and for ``cfbnn report``, which reads them back. Table 1's keys and
layout are in :mod:`.table1_schema`.

* ``uci/<method>/<name>``: the UCI protocol, per method (``test_ll_mean``, ``rmse_se``, ...), and
  ``uci/compare/<closed form>_vs_<peer>/...``;
* ``vae/<variant>/<name>``: Table 2, per variant ``v1``-``v3`` (``test_ll``, ...);
* ``monte_carlo/N<n>/<name>`` and ``deterministic/<name>``: Figure 1, Monte Carlo prediction with
  ``n`` inner samples (``top1_mean``, ...) and the deterministic prediction (``top1``, ...).
"""

from __future__ import annotations

import re
from typing import Iterable, List

_UCI = re.compile(r"uci/(?P<method>[^/]+)/test_ll_mean")
_VAE = re.compile(r"vae/(?P<variant>v\d)/test_ll")
_MONTE_CARLO = re.compile(r"monte_carlo/N(?P<n>\d+)/top1_mean")


def uci_key(method: str, name: str) -> str:
    return f"uci/{method}/{name}"


def vae_key(variant: str, name: str) -> str:
    return f"vae/{variant}/{name}"


def monte_carlo_key(inner_samples: int, name: str) -> str:
    return f"monte_carlo/N{inner_samples}/{name}"


def deterministic_key(name: str) -> str:
    return f"deterministic/{name}"


def uci_methods(metric_names: Iterable[str]) -> List[str]:
    """The UCI methods that metric keys report a test log-likelihood for, first seen first."""
    methods: List[str] = []
    for name in metric_names:
        match = _UCI.fullmatch(name)
        if match and match["method"] not in methods:
            methods.append(match["method"])
    return methods


def vae_variants(metric_names: Iterable[str]) -> List[str]:
    """The VAE variants that metric keys report a test log-likelihood for, sorted."""
    return sorted({match["variant"] for name in metric_names if (match := _VAE.fullmatch(name))})


def monte_carlo_sizes(metric_names: Iterable[str]) -> List[int]:
    """The Monte Carlo inner-sample counts that metric keys report a top-1 accuracy for, sorted."""
    return sorted({int(match["n"]) for name in metric_names if (match := _MONTE_CARLO.fullmatch(name))})
