"""The metric keys the pipelines write into ``results.json`` (and ``metrics.csv``), defined once for
the pipelines that write them and for ``cfbnn report``, which reads them back. Table 1's keys and
layout are in :mod:`.table1_schema`.

* ``uci/<method>/<name>``: the UCI protocol, per method (``test_ll_mean``, ``rmse_se``, ...), and
  ``uci/compare/<closed form>_vs_<peer>/...``;
* ``vae/<variant>/<name>``: Table 2, per variant ``v1``-``v3`` (``test_ll``, ...);
* ``monte_carlo/N<n>/<name>`` and ``deterministic/<name>``: Figure 1, Monte Carlo prediction with
  ``n`` inner samples (``top1_mean``, ...) and the deterministic prediction (``top1``, ...);
* ``fit/<name>``: a fit to one's own data, ``train regression`` with ``protocol: fit``
  (:data:`FIT_REGRESSION_KEYS`) and ``train classification`` (:data:`FIT_CLASSIFICATION_KEYS`);
* ``final_<name>`` and ``calibration/coverage_<percent>``: Table 1's runs (``protocol:
  gradient_variance``), the training loop's last evaluation (``final_test_rmse``,
  ``final_test_ll_closed_form``, ...) and the share of test targets inside the predictive's central
  intervals.

:data:`REGRESSION_HEADLINES` and :data:`CLASSIFICATION_HEADLINES` name the headline metrics
``cfbnn report`` tabulates and draws for such runs, each with the keys that hold it, first found
first.
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


def fit_key(name: str) -> str:
    """``fit/<name>``: a metric of a fit to one's own data (regression or classification)."""
    return f"fit/{name}"


FIT_REGRESSION_KEYS = tuple(
    fit_key(name)
    for name in (
        "test_rmse",  # in the target's units
        "mean_rmse",  # of predicting the training rows' mean for every held-out row (a fit must beat it)
        "test_ll",  # mean log-likelihood per held-out row, in the target's units
        "reference_ll",  # a deep network's: one hidden layer's test_ll on the same rows (fit.reference), or None
        "coverage_90",  # share of held-out targets inside the central 90 % predictive interval
        "coverage_50",
        "noise_sd",  # the learned noise's standard deviation, in the target's units
        "train_rows",
        "test_rows",
        "validation_ll",  # may be None (no validation split)
        "train_seconds",
        "iterations",
        "converged",  # 1 or 0
    )
)
FIT_CLASSIFICATION_KEYS = tuple(
    fit_key(name)
    for name in (
        "test_accuracy",
        "test_nll",  # mean negative log-likelihood per held-out row
        "baseline_accuracy",  # scikit-learn's logistic regression on the same split (fit.baseline)
        "baseline_nll",
        "frequency_nll",  # of predicting the training rows' class frequencies (a fit must beat it)
        "train_rows",
        "test_rows",
        "classes",
        "train_seconds",
        "iterations",
        "converged",
    )
)


def final_key(name: str) -> str:
    """``final_<name>``: the training loop's last evaluation in a Table 1 run (``final_test_rmse``)."""
    return f"final_{name}"


def coverage_key(percent: int) -> str:
    """``calibration/coverage_<percent>``: a Table 1 run's share of test targets inside the central
    ``percent`` % predictive interval."""
    return f"calibration/coverage_{percent}"


# headline metric -> the keys that hold it, the first one present in a run's metrics is read
REGRESSION_HEADLINES = {
    "test_rmse": (fit_key("test_rmse"), final_key("test_rmse")),
    "test_ll": (fit_key("test_ll"), final_key("test_ll_closed_form")),
    "coverage_90": (fit_key("coverage_90"), coverage_key(90)),
}
CLASSIFICATION_HEADLINES = {
    "test_accuracy": (fit_key("test_accuracy"),),
    "test_nll": (fit_key("test_nll"),),
    "baseline_accuracy": (fit_key("baseline_accuracy"),),
    "baseline_nll": (fit_key("baseline_nll"),),
}
CONVERGED_KEYS = (fit_key("converged"), "train/converged")  # 1 converged, 0 not


def headline_value(metrics, keys):
    """The value of the first of ``keys`` that ``metrics`` holds (``None`` where none is)."""
    for key in keys:
        if key in metrics:
            return metrics[key]
    return None


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
