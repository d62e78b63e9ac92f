"""Whether an own-data fit learned anything: a fit that did not is reported as failed.

A fit can end without an error and still be useless: its held-out error worse than predicting
the training rows' mean, or (regression) a learned noise about as large as the target's own spread
(the features explain less than 5 % of its variance: :data:`NOISE_SHARE_LIMIT`),
or (classification) held-out log-likelihood worse than predicting the training rows' class
frequencies. :func:`regression_problems` and :func:`classification_problems` name what went
wrong; the pipelines then write their tables saying so and raise :class:`FitFailedError`: the
run is recorded as failed (``results.json`` ``status: "failed"``, with its metrics; no ``done``,
no ``model.pt``), the reason and a suggestion go to stderr in one line, and the exit status is 1.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from ..report.numbers import format_value
from ..runtime.errors import CfbnnError

# a regression fit's learned noise variance must stay below this share of the target's variance (its
# features explain more than the rest): a network whose posterior stayed at its prior (a deep network on
# a small table) predicts the mean with a noise of the target's whole spread (measured: 0.99-1.01 of its
# s.d.), where fits that learn leave 0.3-0.8 of it
NOISE_SHARE_LIMIT = 0.95


# a deep network's fit must come within this many nats per held-out row of one hidden layer's on the
# same rows (the simpler recipe; fit.reference): worse than that, the depth cost more than it gave
REFERENCE_MARGIN = 0.1
REFERENCE_SIZES = [50]  # the one-hidden-layer recipe a deep fit is compared with


class FitFailedError(CfbnnError):
    """A fit finished but learned nothing useful; ``metrics`` are its measured numbers, ``tables`` the
    tables it wrote (recorded in ``results.json`` with ``status: "failed"``)."""

    exit_code = 1

    def __init__(self, message: str, metrics: Dict[str, float], tables: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.metrics, self.tables = metrics, dict(tables or {})


def regression_problems(rmse: float, mean_rmse: float, noise_sd: float, target_sd: float) -> List[str]:
    """What makes a regression fit useless (``[]``: nothing): ``rmse`` the held-out RMSE, ``mean_rmse``
    that of predicting the training rows' mean for every held-out row, ``noise_sd`` the learned
    noise's and ``target_sd`` the training target's standard deviation (all in the target's units)."""
    problems = []
    if not rmse <= mean_rmse:
        problems.append(
            f"its held-out RMSE {format_value(rmse)} is worse than predicting the training rows' mean "
            f"({format_value(mean_rmse)})"
        )
    if not noise_sd * noise_sd < NOISE_SHARE_LIMIT * target_sd * target_sd:
        problems.append(
            f"its learned noise s.d. {format_value(noise_sd)} is about the target's own spread "
            f"({format_value(target_sd)}) or more: the features explain less than "
            f"{100 * (1 - NOISE_SHARE_LIMIT):g} % of the target's variance"
        )
    return problems


def reference_problems(test_ll: float, reference_ll: float) -> List[str]:
    """What makes a deep fit worse than its reference (``[]``: nothing): its held-out log-likelihood
    per row ``test_ll`` more than :data:`REFERENCE_MARGIN` below ``reference_ll``, one hidden layer's
    (:data:`REFERENCE_SIZES`) on the same rows."""
    if test_ll >= reference_ll - REFERENCE_MARGIN:
        return []
    return [
        f"its held-out log-likelihood per row {format_value(test_ll)} is more than {REFERENCE_MARGIN:g} below "
        f"that of one hidden layer of {REFERENCE_SIZES[0]} units on the same rows ({format_value(reference_ll)})"
    ]


def classification_problems(nll: float, frequency_nll: float) -> List[str]:
    """What makes a classifier useless (``[]``: nothing): held-out negative log-likelihood per row
    ``nll`` worse than ``frequency_nll``, that of predicting the training rows' class frequencies."""
    if nll <= frequency_nll:
        return []
    return [
        f"its held-out log-likelihood per row {format_value(-nll)} is worse than predicting the training rows' "
        f"class frequencies ({format_value(-frequency_nll)})"
    ]


def suggestion(hidden_sizes: Sequence[int], input_dim: int, outputs: int, rows: int, converged: bool) -> str:
    """What to try instead, for a network of ``hidden_sizes`` fitted to ``rows`` training rows."""
    widths = [int(input_dim), *[int(h) for h in hidden_sizes], int(outputs)]
    weights = sum((a + 1) * b for a, b in zip(widths[:-1], widths[1:]))
    if len(hidden_sizes) > 1 or weights > 10 * rows:
        return (
            f"a mean-field posterior over {weights:,} weights ({len(hidden_sizes)} hidden layers "
            f"{list(hidden_sizes)}) fitted to {rows:,} rows underfits: the KL term of that many weights outweighs "
            "what the rows tell (at worst the posterior stays at its prior and predicts the mean); use one hidden "
            "layer of 50 units (model.hidden_sizes=[50], the default) or narrower layers, or more rows"
        )
    if not converged:
        return "training did not converge: raise fit.max_iterations (L-BFGS) or trainer.epochs (Adam)"
    return "check that the feature columns carry information about the target (data.features, data.drop)"


def failure_message(what: str, problems: Sequence[str], advice: str, run_dir) -> str:
    """The one line a failed fit prints."""
    return (
        f"the fit failed: {what} {'; '.join(problems)}. {advice[0].upper()}{advice[1:]}. "
        f'{run_dir} records it (status "failed"; no model.pt)'
    )
