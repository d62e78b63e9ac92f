"""The closed form's nodes: one family of autograd functions with written-out backward passes,
whose every kernel step is a ``cfbnn::`` operator (:mod:`cfbnn_cli.moments`), so that torch's
dispatcher picks the kernel by device (C++ on the CPU, Triton on CUDA, the reference torch ops
elsewhere) and nothing here asks which.

The family, by the paper's structure:

* **first layer and KL**, :func:`diagonal_preactivation_and_kl` -- ``(gamma, xi)`` (or ``xi^2``)
  of ``W [h, 1]`` under a diagonal q (eq. (12)), with the layer's KL (eq. (4)) from the same pass
  (``cfbnn::augment_pair``, ``cfbnn::diagonal_kl_pass``; backward ``cfbnn::finish_diagonal_gradients``
  folds the KL's gradient into the layer's);
* **propagated layers**, :func:`propagated_preactivation_and_kl` -- the same when ``h`` is itself
  uncertain (mean and variance per unit: the ``deterministic`` estimator's moment propagation);
* **tail and likelihood** -- the output layer integrated exactly with the Normal likelihood
  (eqs. (7)-(9)): for the ReLU family's one output straight from the last hidden layer's
  pre-activations, ``cfbnn::relu_tail`` (:class:`.operator_elbo.NormalELL`; ``Phi``, ``Upsilon``
  and ``Var`` of the ``(N, H)`` block never reach memory); for any other activation from its
  hidden units' moments, :func:`normal_ell_given_hidden`.

:class:`.operator_elbo.NormalELBO` and :class:`.operator_deep_elbo.DeepNormalELBO` run the three in a
row as one node (the whole ELBO of a ReLU-family network integrated in closed form, one Normal
output): autograd's bookkeeping is paid once.

On a CPU each pass over an ``(N, H)`` block that has left the core's cache costs about what
its bytes take to move, and every small torch operation 5-10 us of Python and dispatch: the
functions count both. Outside torch.func transforms they run as classic ``forward(ctx, ...)``
functions (no signature binding per call) and write gradients in place; inside, out of place
(:func:`~.support.transforms_active`), and the layer functions support ``torch.func.vmap`` /
``grad`` (``generate_vmap_rule``), which the gradient-variance measurement uses.

They compute what :mod:`cfbnn_cli.bnn.functional` computes (``tests/bnn/test_fused.py`` and
``tests/bnn/test_operator_elbo.py`` check values and gradients against it, float64 and float32).
"""

from .normal_ell import normal_ell_given_hidden
from .operator_deep_elbo import deep_normal_elbo as operator_deep_normal_elbo
from .operator_elbo import normal_elbo as operator_normal_elbo
from .operator_elbo import normal_ell as operator_normal_ell
from .operator_elbo import operators_apply
from .preactivation import (
    diagonal_preactivation,
    diagonal_preactivation_and_kl,
    diagonal_preactivation_variance,
    propagated_preactivation,
    propagated_preactivation_and_kl,
    propagated_preactivation_variance,
)

__all__ = [
    "diagonal_preactivation",
    "diagonal_preactivation_and_kl",
    "diagonal_preactivation_variance",
    "normal_ell_given_hidden",
    "operator_deep_normal_elbo",
    "operator_normal_elbo",
    "operator_normal_ell",
    "operators_apply",
    "propagated_preactivation",
    "propagated_preactivation_and_kl",
    "propagated_preactivation_variance",
]
