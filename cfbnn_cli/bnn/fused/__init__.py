"""The closed form's hot path as autograd functions with analytic backward passes.

Written as ordinary torch code, one closed-form ELBO step of a mean-field layer is some
130 small operations forward and backward (each exp, square, cat, sum and their
autograd nodes), and on a CPU their overhead, not the arithmetic, is most of the
step. Here the same mathematics is a few functions whose backward passes are written
out, reusing what the forward computed:

* :func:`diagonal_preactivation` -- ``(gamma, xi)`` of ``W [h, 1]`` under a diagonal q,
  paper eq. (12), the bias column handled without building ``[h, 1]``;
* :func:`propagated_preactivation` -- the same when ``h`` is itself uncertain (mean and
  variance per unit, the ``deterministic`` estimator's moment propagation);
* :func:`diagonal_kl` -- ``KL(N(loc, diag exp(2 log_scale)) || N(0, s^2 I))``, the KL terms
  of eq. (4), straight from ``log_scale`` (no ``log(exp(.))``);
* :func:`normal_ell_given_hidden` -- the output layer integrated exactly and the Normal
  likelihood, eqs. (7)-(8), per data point, from the hidden units' ``Phi`` and ``Var``;
* :func:`normal_ell_given_preactivation` -- the same for one output straight from the last
  hidden layer's pre-activation means and *variances*, eqs. (7)-(9) in one C++ pass each way
  (``tail_pass`` in moments/csrc/cfbnn_moments.cpp): ``Phi``, ``Upsilon`` and ``Var`` of the
  ``(N, H)`` block never reach memory, and with :func:`diagonal_preactivation_variance` /
  :func:`propagated_preactivation_variance` neither the square root nor its derivative
  is a pass of its own.

* :func:`closed_form_normal_elbo` -- the whole ELBO of a network whose every layer is a
  diagonal Gaussian integrated in closed form (``deterministic``; ``analytic`` with one hidden
  layer), one Normal output, as ONE autograd node: the functions above run in a row on
  :class:`~.support.Tape` contexts and their backward passes in reverse, so autograd's bookkeeping
  (a node per function, per scalar operation of the ELBO's sum, zeros for unused outputs)
  is paid once. :meth:`~cfbnn_cli.bnn.estimators.Estimator.elbo` takes it for ReLU-family
  networks where the library's operators are not registered (elsewhere the same node on the
  operators, :mod:`.operator_elbo` and :mod:`.operator_deep_elbo`).

While an ELBO is evaluated, the layer's KL comes out of the same function
(:func:`diagonal_preactivation_and_kl`, :func:`propagated_preactivation_and_kl`,
:func:`normal_ell_given_preactivation_and_kl`). One kernel pass gives the KL's sums and
``exp(2 log_scale)``. Backward, one pass finishes the layer's gradient with the KL's
gradient folded in, so autograd has no second pair of parameter-sized gradients to add.

On a CPU each pass over an ``(N, H)`` block that has left the core's cache costs about what
its bytes take to move (~40 us per 400 kB array here), and every small torch operation
5-10 us of Python and dispatch: the functions count both. Outside torch.func transforms they
run as classic ``forward(ctx, ...)`` functions (no signature binding per call) and write
gradients in place; inside, out of place (:func:`~.support.transforms_active`).

They compute what :mod:`cfbnn_cli.bnn.functional` computes (``tests/bnn/test_fused.py`` checks values
and gradients against it and against the reference torch moments, float64 and float32,
and ``torch.autograd.gradcheck``), and all but the kernel tail support ``torch.func.vmap``
/ ``grad`` (``generate_vmap_rule``), which the gradient-variance measurement uses.

One module per job: :mod:`.preactivation`, :mod:`.kl`, :mod:`.normal_ell`, :mod:`.single_node`,
:mod:`.operator_elbo` (ReLU-family networks' ELBO on the ``cfbnn::`` operators, one implementation for the
CPU and CUDA), :mod:`.operator_deep_elbo` (the same for two or more hidden layers, every one integrated),
and :mod:`.support` (what they share).
"""

from .kl import diagonal_kl
from .normal_ell import (
    activation_kernels,
    layer_kernel_op,
    normal_ell_given_hidden,
    normal_ell_given_preactivation,
    normal_ell_given_preactivation_and_kl,
    normal_tail_op,
)
from .operator_deep_elbo import deep_normal_elbo as operator_deep_normal_elbo
from .operator_elbo import normal_elbo as operator_normal_elbo
from .operator_elbo import normal_ell as operator_normal_ell
from .operator_elbo import operators_apply, relu_operators_apply, tail_family
from .preactivation import (
    diagonal_preactivation,
    diagonal_preactivation_and_kl,
    diagonal_preactivation_variance,
    propagated_preactivation,
    propagated_preactivation_and_kl,
    propagated_preactivation_variance,
)
from .single_node import closed_form_normal_elbo
from .support import Tape

__all__ = [
    "Tape",
    "activation_kernels",
    "closed_form_normal_elbo",
    "diagonal_kl",
    "diagonal_preactivation",
    "diagonal_preactivation_and_kl",
    "diagonal_preactivation_variance",
    "layer_kernel_op",
    "normal_ell_given_hidden",
    "normal_ell_given_preactivation",
    "normal_ell_given_preactivation_and_kl",
    "normal_tail_op",
    "operator_deep_normal_elbo",
    "operator_normal_elbo",
    "operator_normal_ell",
    "operators_apply",
    "propagated_preactivation",
    "propagated_preactivation_and_kl",
    "propagated_preactivation_variance",
    "relu_operators_apply",
    "tail_family",
]
