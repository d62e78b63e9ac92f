"""The closed form's fused nodes: ``cfbnn::`` operators (:mod:`.nodes` declares them) with written-out
backward passes, whose every elementwise step is itself a ``cfbnn::`` operator
(:mod:`cfbnn_cli.moments.elbo_ops`), so that torch's dispatcher picks each kernel by device (C++ on
the CPU, Triton on CUDA, the reference torch formulas elsewhere) and nothing here asks which.

The family, by the paper's structure:

* **a layer's pre-activation moments and KL** -- ``(gamma, xi)`` (or ``xi^2``) of ``W [h, 1]``
  under a diagonal q (eq. (12)) from exact inputs, or from propagated ones (mean and variance per
  unit: the ``deterministic`` estimator), with the layer's KL (eq. (4)) from the same pass
  (:mod:`.preactivation`);
* **the tail** -- the last hidden layer and the one Normal output of a ReLU-family network
  integrated from the pre-activations' moments, ``Phi``, ``Upsilon`` and ``Var`` never written
  (:mod:`.normal_elbo`); for any other activation or several outputs the output layer given the
  hidden units' moments in torch ops (:mod:`.normal_ell`);
* **the whole ELBO** -- the three in a row as one node where every layer is integrated
  (:mod:`.normal_elbo`): autograd's bookkeeping is paid once.

Which fits a network is answered once, when an estimator is bound to it
(:class:`.nodes.FusedNode`: ``supports(network)`` and its reasons). They compute what
:mod:`cfbnn_cli.bnn.functional` computes (``tests/bnn/test_fused.py`` and
``tests/bnn/test_operator_elbo.py`` check values and gradients against it, float64 and float32).
"""

from .nodes import TAIL, WHOLE_ELBO, FusedNode
from .normal_ell import normal_ell_given_hidden

__all__ = ["TAIL", "WHOLE_ELBO", "FusedNode", "normal_ell_given_hidden"]
