"""The closed form's fused nodes as ``cfbnn::`` operators, each declared once here
(:mod:`cfbnn_cli.moments.operators`: schema, default kernel, fake, autograd, vmap rule), and what
each answers about a network: whether it fits, and why not (:class:`FusedNode`).

``cfbnn::diagonal_preactivation(Tensor h, Tensor loc, Tensor log_scale, bool bias, bool variance_output, float? prior_variance) -> (Tensor gamma, Tensor xi, Tensor kl)``
``cfbnn::propagated_preactivation(Tensor phi, Tensor variance, Tensor? second_moment, Tensor loc, Tensor log_scale, bool bias, bool variance_output, float? prior_variance) -> (Tensor gamma, Tensor xi, Tensor kl)``
    a layer's pre-activation moments (``xi^2`` with ``variance_output``) from exact or propagated
    inputs (any leading dimensions), with its KL where a prior variance is given (else ``kl`` is an
    empty tensor): :mod:`.preactivation`.
``cfbnn::normal_ell(Tensor gamma, Tensor xi2, Tensor loc, Tensor log_scale, Tensor y, Tensor log_precision, bool bias, float? prior_variance, int activation, float negative_slope, bool summed) -> (Tensor ell, Tensor kl)``
    the last hidden layer and a one-output layer integrated with the Normal likelihood, per row of
    ``(rows, H)``: :mod:`.normal_elbo`.
``cfbnn::normal_elbo(Tensor x, Tensor y, Tensor log_precision, Tensor hidden_loc, Tensor hidden_log_scale, Tensor output_loc, Tensor output_log_scale, bool hidden_bias, bool output_bias, float prior_variance, float scale, int activation, float negative_slope) -> Tensor``
``cfbnn::deep_normal_elbo(Tensor x, Tensor y, Tensor log_precision, Tensor[] parameters, bool[] biases, float prior_variance, float scale, int activation, float negative_slope) -> Tensor``
    the whole ELBO of a network whose every layer is integrated: one hidden layer, or any number
    (``parameters``: each layer's ``loc``, ``log_scale``): :mod:`.normal_elbo`.
``cfbnn::first_order(Tensor gradient, str node) -> Tensor``
    a node's gradient as it is, differentiable no further: differentiating it (``create_graph=True``,
    nested ``torch.func.grad``) raises, naming the node (its backward pass is written from what the
    forward kept, and carries no graph of it).

Their kernel is the same on every device (``CompositeExplicitAutograd``): it calls the step
operators, whose kernels the dispatcher picks. Autograd: the node's body with the autograd context
(:class:`~cfbnn_cli.moments.operators.OperatorAutograd`), so that ``torch.func`` (Table 1's
``vmap(grad(...))`` over noise draws) reaches the same bodies; vmap: the layers' and the tail's over
their inputs' leading dimension.
"""

from __future__ import annotations

from typing import List

import torch

from ...moments.activations import family_of
from ...moments.operators import Operator, batch_first, define
from . import normal_elbo, preactivation

__all__ = ["FusedNode", "TAIL", "WHOLE_ELBO"]

# ----------------------------------------------------------------------------- first derivatives only


def _refuse_second_order(ctx, grad):
    raise RuntimeError(
        f"cfbnn::{ctx.node}, a node of the closed-form ELBO, has first derivatives only: second derivatives "
        "(create_graph=True, nested torch.func.grad, gradient penalties, Hessian-vector products) are not "
        "supported; differentiate the gradients numerically (finite differences) where a second order is needed"
    )


def _remember_node(ctx, inputs, output):
    ctx.node = inputs[1]


first_order = define(
    Operator(
        "first_order(Tensor gradient, str node) -> Tensor",
        lambda gradient, node: gradient.clone(),
        lambda gradient, node: torch.empty_like(gradient),
        setup_context=_remember_node,
        backward=_refuse_second_order,
        vmap=lambda info, in_dims, gradient, node: (first_order(gradient, node), in_dims[0]),
    )
)


def _first_order_only(name: str, backward):
    """``backward`` whose gradients, where autograd records the backward pass, pass through
    ``cfbnn::first_order`` (a plain backward records nothing: they are returned as they are)."""

    def guarded(ctx, *grads):
        result = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return result
        return tuple(g if g is None else first_order(g, name) for g in result)

    return guarded


# ----------------------------------------------------------------------------- the layers


def _layer_vmap(name: str, tensors: int):
    """A layer node's vmap rule: its first ``tensors`` inputs (the layer's inputs) with the vmapped
    dimension first, one call (the node takes any leading dimensions); the weights unbatched."""

    def rule(info, in_dims, *inputs):
        if any(d is not None for d in in_dims[tensors:]):
            raise NotImplementedError(f"cfbnn::{name}: vmap over the layer's weights is not supported")
        moved = [None if t is None else batch_first(info, (d,), t)[0] for t, d in zip(inputs[:tensors], in_dims)]
        gamma, xi, kl = getattr(torch.ops.cfbnn, name)(*moved, *inputs[tensors:])
        return (gamma, xi, kl), (0, 0, None)

    return rule


def _layer_fake(rows_of):
    def fake(first, *inputs):
        loc, prior_variance = rows_of(inputs)
        shape = (*first.shape[:-1], loc.shape[0])
        kl = first.new_empty(()) if prior_variance is not None else first.new_empty(0)
        return first.new_empty(shape), first.new_empty(shape), kl

    return fake


diagonal_preactivation = define(
    Operator(
        "diagonal_preactivation(Tensor h, Tensor loc, Tensor log_scale, bool bias, bool variance_output,"
        " float? prior_variance) -> (Tensor, Tensor, Tensor)",
        lambda *inputs: preactivation.diagonal_forward(None, *inputs),
        _layer_fake(lambda inputs: (inputs[0], inputs[4])),
        forward=preactivation.diagonal_forward,
        backward=_first_order_only("diagonal_preactivation", preactivation.diagonal_backward),
        vmap=_layer_vmap("diagonal_preactivation", 1),
    )
)
propagated_preactivation = define(
    Operator(
        "propagated_preactivation(Tensor phi, Tensor variance, Tensor? second_moment, Tensor loc, Tensor log_scale,"
        " bool bias, bool variance_output, float? prior_variance) -> (Tensor, Tensor, Tensor)",
        lambda *inputs: preactivation.propagated_forward(None, *inputs),
        _layer_fake(lambda inputs: (inputs[2], inputs[6])),
        forward=preactivation.propagated_forward,
        backward=_first_order_only("propagated_preactivation", preactivation.propagated_backward),
        vmap=_layer_vmap("propagated_preactivation", 3),
    )
)

# ----------------------------------------------------------------------------- the tail and the whole ELBO


def _ell_fake(gamma, xi2, loc, log_scale, y, log_precision, bias, prior_variance, *_):
    return gamma.new_empty(gamma.shape[:1]), gamma.new_empty(() if prior_variance is not None else (0,))


def _ell_vmap(info, in_dims, gamma, xi2, loc, log_scale, y, log_precision, *numbers):
    """The tail over a batch of rows (the output layer shared): the batch's rows are rows of one call."""
    if any(d is not None for d in in_dims[2:4] + in_dims[5:6]):
        raise NotImplementedError("cfbnn::normal_ell: vmap over the output layer is not supported")
    gamma, xi2, y = batch_first(info, in_dims[:2] + in_dims[4:5], gamma, xi2, y)
    batch, rows, width = gamma.shape
    ell, kl = normal_ell(
        gamma.reshape(-1, width), xi2.reshape(-1, width), loc, log_scale, y.reshape(-1), log_precision, *numbers
    )
    return (ell.reshape(batch, rows), kl), (0, None)


normal_ell = define(
    Operator(
        "normal_ell(Tensor gamma, Tensor xi2, Tensor loc, Tensor log_scale, Tensor y, Tensor log_precision, bool bias,"
        " float? prior_variance, int activation, float negative_slope, bool summed) -> (Tensor, Tensor)",
        lambda *inputs: normal_elbo.ell_forward(None, *inputs),
        _ell_fake,
        forward=normal_elbo.ell_forward,
        backward=_first_order_only("normal_ell", normal_elbo.ell_backward),
        vmap=_ell_vmap,
    )
)


def _one_hidden_forward(ctx, x, y, lp, hidden_loc, hidden_log_scale, output_loc, output_log_scale, *numbers):
    hidden_bias, output_bias, prior_variance, scale, activation, slope = numbers
    parameters = (hidden_loc, hidden_log_scale, output_loc, output_log_scale)
    biases = (hidden_bias, output_bias)
    return normal_elbo.elbo_forward(ctx, x, y, lp, parameters, biases, prior_variance, scale, (activation, slope))


def _one_hidden_backward(ctx, grad):
    return (*normal_elbo.elbo_backward(ctx, grad), None, None, None, None, None, None)


def _deep_forward(ctx, x, y, lp, parameters, biases, prior_variance, scale, activation, slope):
    return normal_elbo.elbo_forward(ctx, x, y, lp, parameters, biases, prior_variance, scale, (activation, slope))


def _deep_backward(ctx, grad):
    grads = normal_elbo.elbo_backward(ctx, grad)
    return (*grads, *(None,) * (len(ctx.biases) + 4))  # (the flattened biases and numbers)


normal_elbo_op = define(
    Operator(
        "normal_elbo(Tensor x, Tensor y, Tensor log_precision, Tensor hidden_loc, Tensor hidden_log_scale,"
        " Tensor output_loc, Tensor output_log_scale, bool hidden_bias, bool output_bias, float prior_variance,"
        " float scale, int activation, float negative_slope) -> Tensor",
        lambda *inputs: _one_hidden_forward(None, *inputs),
        lambda x, *_: x.new_empty(()),
        forward=_one_hidden_forward,
        backward=_first_order_only("normal_elbo", _one_hidden_backward),
    )
)
deep_normal_elbo = define(
    Operator(
        "deep_normal_elbo(Tensor x, Tensor y, Tensor log_precision, Tensor[] parameters, bool[] biases,"
        " float prior_variance, float scale, int activation, float negative_slope) -> Tensor",
        lambda *inputs: _deep_forward(None, *inputs),
        lambda x, *_: x.new_empty(()),
        forward=_deep_forward,
        backward=_first_order_only("deep_normal_elbo", _deep_backward),
    )
)

# ----------------------------------------------------------------------------- which networks they fit


class FusedNode:
    """A fused node as an estimator sees it when it is bound to a network: whether the node fits the
    network, and why not (xformers' ``not_supported_reasons``), answered once."""

    name = ""

    def not_supported_reasons(self, network) -> List[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def supports(self, network) -> bool:
        return not self.not_supported_reasons(network)


def _normal_one_output_reasons(network) -> List[str]:
    from ..likelihoods import NormalLikelihood  # (the likelihoods import nothing of the nodes)

    reasons = []
    if family_of(network.activation) is None:
        reasons.append(
            f"the activation {network.activation!r} is not one of the ReLU family (relu, leaky_relu, relu_squared)"
        )
    if network.output_dim != 1:
        reasons.append(f"it has {network.output_dim} outputs, not one")
    if type(network.likelihood) is not NormalLikelihood:
        reasons.append(f"its likelihood is {type(network.likelihood).__name__}, not NormalLikelihood")
    output = network.layers[-1]
    if getattr(output, "covariance", None) != "diagonal":
        reasons.append("its output layer's q is not mean-field (diagonal)")
    return reasons


class Tail(FusedNode):
    """``cfbnn::normal_ell``: the last hidden layer's moments and a one-output layer with the Normal
    likelihood, from the last hidden layer's pre-activation moments (any layers before it)."""

    name = "normal_ell"

    def not_supported_reasons(self, network) -> List[str]:
        reasons = _normal_one_output_reasons(network)
        if len(network.layers) - network.point_layers < 2:
            reasons.append("it has no Gaussian hidden layer")
        return reasons


class WholeELBO(FusedNode):
    """``cfbnn::normal_elbo`` / ``cfbnn::deep_normal_elbo``: the whole ELBO, every layer integrated,
    a fixed prior."""

    name = "normal_elbo"

    def not_supported_reasons(self, network) -> List[str]:
        reasons = _normal_one_output_reasons(network)
        if network.point_layers:
            reasons.append("it has point layers")
        if len(network.layers) < 2:
            reasons.append("it has no hidden layer")
        if network.prior == "empirical_bayes":
            reasons.append("its prior is empirical Bayes (a KL differentiable in the prior)")
        if any(getattr(layer, "covariance", None) != "diagonal" for layer in network.layers[:-1]):
            reasons.append("a hidden layer's q is not mean-field (diagonal)")
        return reasons


TAIL, WHOLE_ELBO = Tail(), WholeELBO()
