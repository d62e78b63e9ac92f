"""Table 1's results schema, in one place: the metric keys the gradient-variance study writes,
how they are read back, and the table's layout (rows, column headings, cells).

The pipeline (``cfbnn train regression``, one run) and ``cfbnn report`` (runs grouped, mean ±
s.e. over seeds) both build Table 1 from these, so a key or a heading changes here or nowhere.

Keys (``results.json`` ``metrics``; ``metrics.csv`` columns):

* ``gradvar/<estimator>/epoch<E>/<layer>/<kind>``: the mean over a layer's parameters of the
  gradient variance under ``estimator`` (``analytic``, ``sampling``, ``deterministic``) at epoch
  ``E``; ``layer`` ``first``, ``second``, ..., ``final``; ``kind`` ``mean`` (the weight means) or
  ``scale`` (log σ);
* ``gradvar_ratio_sampling_over_analytic/epoch<E>/<layer>/<kind>``: sampling / analytic (``None``
  where the analytic variance is 0: nothing sampled).
"""

from __future__ import annotations

import re
from typing import Callable, Dict, Iterable, List, Optional, Tuple

# the paper's two rows, then the rows beyond the paper (every hidden layer's moments propagated:
# the deterministic estimator, whose gradient does not vary at all)
PAPER_ESTIMATORS = ("analytic", "sampling")
ESTIMATOR_LABELS = {"analytic": "Analytic", "sampling": "Sampling", "deterministic": "Deterministic (nothing sampled)"}
STUDY_ESTIMATORS = tuple(ESTIMATOR_LABELS)  # what the study measures
RATIO = "ratio"
RATIO_LABEL = "Ratio sampling / analytic"
KINDS = ("mean", "scale")
DIGITS = 2  # significant digits of a cell
_KEY = re.compile(r"gradvar/(?P<estimator>[^/]+)/epoch(?P<epoch>\d+)/(?P<layer>[^/]+)/(?P<kind>mean|scale)")


def gradvar_key(estimator: str, epoch: int, layer: str, kind: str) -> str:
    return f"gradvar/{estimator}/epoch{epoch}/{layer}/{kind}"


def ratio_key(epoch: int, layer: str, kind: str) -> str:
    return f"gradvar_ratio_sampling_over_analytic/epoch{epoch}/{layer}/{kind}"


def row_key(row: str, epoch: int, layer: str, kind: str) -> str:
    """The metric behind one cell half: an estimator's variance or (``row == "ratio"``) the ratio."""
    return ratio_key(epoch, layer, kind) if row == RATIO else gradvar_key(row, epoch, layer, kind)


def metrics_from_results(results: Dict[int, dict]) -> Dict[str, Optional[float]]:
    """``{epoch: {estimator: {layer: {kind: variance}}}}`` (the study's measurements) as metric keys,
    with the ratio sampling / analytic of each cell."""
    metrics: Dict[str, Optional[float]] = {}
    for epoch, by_estimator in results.items():
        for estimator, layers in by_estimator.items():
            for layer, kinds in layers.items():
                for kind, value in kinds.items():
                    metrics[gradvar_key(estimator, epoch, layer, kind)] = value
        for layer in by_estimator["analytic"]:
            for kind in KINDS:
                analytic, sampling = by_estimator["analytic"][layer][kind], by_estimator["sampling"][layer][kind]
                # nothing sampled (one hidden layer): no finite ratio to report
                metrics[ratio_key(epoch, layer, kind)] = sampling / analytic if analytic > 0 else None
    return metrics


def layout(metric_names: Iterable[str]) -> Tuple[List[int], List[str]]:
    """The epochs (sorted) and layers (first seen first, ``final`` last: the keys of a one-hidden-layer
    network, ``first`` and ``final``, may come before a deeper one's ``second``) that metric keys cover."""
    epochs, layers = set(), []
    for name in metric_names:
        match = _KEY.fullmatch(name)
        if match and match["estimator"] == "analytic" and match["kind"] == "mean":
            epochs.add(int(match["epoch"]))
            if match["layer"] not in layers:
                layers.append(match["layer"])
    return sorted(epochs), sorted(layers, key=lambda layer: (layer == "final", layers.index(layer)))


def epoch_heading(epoch: int, last_epoch: Optional[int], converged: Optional[float]) -> str:
    """A column group: at initialization, or the epoch with what it is. ``last_epoch``: the
    training's last (``None`` when runs differ); ``converged``: the share of runs whose training
    had converged there (``True``/``False`` for one run; ``None``: not judged)."""
    if epoch == 0:
        return "Upon initialization (epoch 0)"
    if epoch == last_epoch:
        state = (
            ""
            if converged is None
            else ", converged"
            if converged == 1
            else ", not converged"
            if converged == 0
            else ", converged in some runs"
        )
        return f"End of training (epoch {epoch}{state})"
    return f"Epoch {epoch}" if last_epoch is None else f"Epoch {epoch} of {last_epoch}"


def column_heading(when: str, layer: str) -> str:
    return f"{when}: {layer.capitalize()} Layer"


def table_rows(
    rows: Iterable[str],
    epochs: Iterable[int],
    layers: Iterable[str],
    heading: Callable[[int], str],
    cell: Callable[[str], str],
) -> List[Tuple[str, Dict[str, str]]]:
    """Table 1's body: for each row (an estimator or :data:`RATIO`) its label and ``{column
    heading: "weight means / log σ"}``, each half ``cell(metric key)``; a cell whose halves are both
    empty (a layer the network does not have) is empty."""
    epochs, layers = list(epochs), list(layers)
    body = []
    for row in rows:
        columns = {}
        for epoch in epochs:
            when = heading(epoch)
            for layer in layers:
                halves = [cell(row_key(row, epoch, layer, kind)) for kind in KINDS]
                columns[column_heading(when, layer)] = " / ".join(halves) if any(halves) else ""
        body.append((RATIO_LABEL if row == RATIO else ESTIMATOR_LABELS[row], columns))
    return body
