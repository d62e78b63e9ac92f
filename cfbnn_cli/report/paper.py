"""The paper's own numbers, for ``cfbnn report --paper`` (the reproduction table).

Copied from ``closed_form_bnn.tex`` (arXiv:1811.00686): Table 1 is the ``\\lay...``
macros above ``table:varred`` (``\\layonemeanearlyanal`` = first layer, weight means,
upon initialization, analytic; "scale" = the (log root) variances, i.e. log σ), Table
2 the row "Test LL" of ``table:vae``. Figure 1 has no numbers in the source: its claim
is qualitative ("a large number of samples must be drawn before the MC estimator
reaches the performance of the deterministic approximation. Indeed even with 512
samples the deterministic approximation outperforms MC on top-5 accuracy").
"""

from __future__ import annotations

# (when, layer, kind) -> {estimator: mean gradient variance}; when: "init" | "late" (after 50 epochs on MSD)
TABLE1 = {
    ("init", "first", "mean"): {"analytic": 8.6, "sampling": 19.7},
    ("init", "first", "scale"): {"analytic": 6e-4, "sampling": 7e-4},
    ("init", "second", "mean"): {"analytic": 3.2, "sampling": 10.1},
    ("init", "second", "scale"): {"analytic": 2e-6, "sampling": 2e-4},
    ("init", "final", "mean"): {"analytic": 227.0, "sampling": 704.0},
    ("init", "final", "scale"): {"analytic": 1e-5, "sampling": 0.03},
    ("late", "first", "mean"): {"analytic": 1.75, "sampling": 2.6},
    ("late", "first", "scale"): {"analytic": 1e-4, "sampling": 1e-4},
    ("late", "second", "mean"): {"analytic": 0.2, "sampling": 0.4},
    ("late", "second", "scale"): {"analytic": 2e-6, "sampling": 1e-4},
    ("late", "final", "mean"): {"analytic": 259.0, "sampling": 518.0},
    ("late", "final", "scale"): {"analytic": 3e-8, "sampling": 3e-3},
}
TABLE1_DATA = "YearPredictionMSD, 90-200-200-1, 10^4 gradient draws, batch 500"

# test log-likelihood per point (nats), YearPredictionMSD features, K=100, T=500
TABLE2 = {"v1": -107.16, "v2": -107.20, "v3": -107.10}
TABLE2_DATA = "YearPredictionMSD features"

FIGURE1_DATA = "ImageNet, ResNet50 features, 2048-1000-1000-1000 head"
FIGURE1_CLAIM = (
    "MC needs a large number of samples to reach the deterministic prediction; even with N_inner = 512 the "
    "deterministic prediction is better on top-5 (qualitative: no numbers in the paper)"
)


def table1_ratio(when: str, layer: str, kind: str) -> float:
    """The paper's sampling / analytic ratio of one Table 1 cell."""
    cell = TABLE1[(when, layer, kind)]
    return cell["sampling"] / cell["analytic"]
