"""Estimators of the ELBO: which of a network's Gaussian layers are integrated, which sampled.

An estimator is an object, chosen once (:func:`make_estimator`, at a command's config boundary)
and passed to the network's methods, as Pyro passes its ``Trace_ELBO`` / ``TraceMeanField_ELBO``.
The same parameters can be trained or measured under any of them (paper Table 1 compares two
at the same parameters). This module is where each one's expected log-likelihood and ELBO are
computed (:meth:`Estimator.elbo`); the layers' arithmetic is in :mod:`.layers` and :mod:`.fused`.

==================================  =============  ==============================================
object                              name           integrates / samples
==================================  =============  ==============================================
:class:`ClosedForm`                 analytic       the last two Gaussian layers in closed form
                                                   (the hidden units' Phi and Var, eq. (9), then
                                                   the output layer, eqs. (7)-(8)); earlier ones
                                                   sampled (local reparameterization). One hidden
                                                   layer: nothing sampled. Any covariance of q
                                                   (diagonal, full, low rank).
:class:`IntegrateOutputLayer`       integrate_     the output layer exactly given sampled
                                    output_layer   activations (VAE "V2"); every other layer
                                                   sampled.
:class:`LocalReparameterization`    sampling       nothing: every Gaussian layer sampled through
                                                   its pre-activations (Kingma et al. 2015).
:class:`DeterministicPropagation`   deterministic  every layer, nothing sampled: the first
                                                   layer's pre-activations exactly (eq. (12)),
                                                   later layers' from the previous layer's
                                                   moments, units independent (diagonal DVI, Wu
                                                   et al. 2019); exact for one hidden layer.
``DeterministicPropagation(         deterministic  as above, each layer carrying its activations'
full_covariance=True)``             _full          covariance across units (DVI proper; bivariate
                                                   cross-moments, :mod:`..moments.bivariate`).
                                                   Mean-field q; cost ``N H^2`` per hidden layer.
==================================  =============  ==============================================

Noise for the sampled layers is an explicit argument (standard-normal tensors of
:meth:`Estimator.noise_shapes`), so ``torch.func.vmap`` can draw many gradient samples in one
call (Table 1).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..moments.activations import family_of
from ..moments.bivariate import activation_covariance
from ..moments.gaussian import check_mean_std
from . import functional as F
from . import fused
from .functional import augment
from .likelihoods import NormalLikelihood


class Estimator:
    """How a :class:`~cfbnn_cli.bnn.network.BayesianNetwork`'s Gaussian layers are treated.

    ``closed_form_layers`` trailing Gaussian layers are integrated in closed form, the rest
    sampled by local reparameterization; point layers are evaluated as they are. Stateless:
    two estimators of one class are equal, and ``str(estimator)`` is its config name.
    """

    name: str = ""
    closed_form_layers: int = 0
    integrates: str = ""
    samples: str = ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __str__(self) -> str:
        return self.name

    def __eq__(self, other) -> bool:
        return isinstance(other, Estimator) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    # ------------------------------------------------------------------ which layers

    def treatments(self, network) -> Tuple[str, ...]:
        """Per layer: ``point``, ``sampled`` or ``closed_form``."""
        count, points = len(network.layers), network.point_layers
        closed = min(self.closed_form_layers, count - points)
        return tuple(
            "point" if i < points else "closed_form" if i >= count - closed else "sampled" for i in range(count)
        )

    def noise_shapes(self, network, batch: int) -> Tuple[Tuple[int, ...], ...]:
        """Shapes of the standard-normal noise one evaluation consumes (one per sampled layer)."""
        return tuple(
            (batch, layer.out_features)
            for layer, treatment in zip(network.layers, self.treatments(network))
            if treatment == "sampled"
        )

    def sample_noise(self, network, batch: int, *, generator=None, num_samples: Optional[int] = None, lead=()):
        """The noise :meth:`noise_shapes` asks for, with leading dimensions ``lead`` and
        ``num_samples`` draws; ``()`` when nothing is sampled."""
        shapes = self.noise_shapes(network, batch)
        if not shapes:  # nothing sampled (the closed form's hot path: no parameter walk)
            return ()
        lead = tuple(lead) + (() if num_samples is None else (num_samples,))
        like = next(network.parameters())
        return tuple(
            torch.randn(lead + shape, generator=generator, dtype=like.dtype, device=like.device) for shape in shapes
        )

    # ------------------------------------------------------------------ forward

    def forward_to_tail(self, network, h, noise, *, variance_form: bool = False, kl_sink: Optional[dict] = None):
        """Run the layers that are not integrated (point and sampled ones) from the activations
        ``h`` after the point layers; returns what is left to integrate exactly: ``("outputs",
        z)`` when nothing is, ``("output_layer", h)`` when the output layer is integrated given
        activations ``h``, ``("hidden_and_output", (gamma, xi))`` when the last hidden layer
        (pre-activation moments) and the output layer are. ``variance_form``: the last hidden
        layer's moments as ``(gamma, xi^2)``. ``kl_sink``: a dict that collects, by layer index,
        the KL terms the layers' functions compute on the way (a fixed prior)."""
        if network.point_layers == len(network.layers):  # a plain network: h is already the output
            return "outputs", h
        treatments = self.treatments(network)
        sampled = treatments.count("sampled")
        if len(noise) != sampled:
            raise ValueError(
                f"`noise` must hold one tensor per sampled layer: estimator {self.name!r} samples {sampled} layer(s) "
                f"of this network; got {len(noise)} (noise=None draws it)"
            )
        noise = iter(noise)
        last = len(network.layers) - 1
        moments = None  # (mean, variance, second moment) of h once it is propagated rather than known
        for index in range(network.point_layers, len(network.layers)):
            treatment = treatments[index]
            if treatment == "closed_form":
                if index == last:  # only reached when no hidden layer was integrated before it
                    return "output_layer", h
                if index == last - 1:
                    return "hidden_and_output", _preactivation(network, index, h, moments, variance_form, kl_sink)
                # a hidden layer before the last (deterministic propagation): carry its moments on
                moments = _propagated_moments(network, index, h, moments, kl_sink)
                continue
            gamma, xi = _preactivation(network, index, h, None, False, kl_sink)
            z = gamma + xi * next(noise)
            if index == last:
                return "outputs", z
            h = network.activation(z)
        raise AssertionError("unreachable: the loop returns at the output layer")

    def output_moments(self, network, h, noise, *, kl_sink: Optional[dict] = None):
        """``(mean, var_from_penultimate, var_from_output_layer)``, each ``(..., N, O)``, of the
        outputs given the activations ``h`` after the point layers and the sampled layers' noise."""
        return integrate_tail(network, *self.forward_to_tail(network, h, noise, kl_sink=kl_sink))[:3]

    def mean_and_covariance(self, network, h, noise, *, kl_sink: Optional[dict] = None):
        """``(mean (..., N, O), covariance (..., N, O, O))`` of the outputs. The output layer's
        rows are independent under q, so outputs covary only through the shared hidden units:
        ``Cov(o_i, o_j) = sum_c loc_ic loc_jc Var[h_c]`` off the diagonal (heteroscedastic
        regression needs it between the mean and the log-variance)."""
        kind, value = self.forward_to_tail(network, h, noise, kl_sink=kl_sink)
        mean, var_a, var_b, hidden_variance = integrate_tail(network, kind, value)
        if kind == "full_moments":  # the outputs' covariance, computed whole
            return mean, hidden_variance
        if hidden_variance is None:  # given sampled activations the output rows are independent
            return mean, torch.diag_embed(var_a + var_b)
        output = network.layers[-1]
        loc = output.loc[..., :-1] if output.bias else output.loc
        shared = torch.einsum("...nc,ic,jc->...nij", hidden_variance, loc, loc)
        return mean, shared + torch.diag_embed(var_a + var_b - torch.diagonal(shared, dim1=-2, dim2=-1))

    # ------------------------------------------------------------------ objectives

    def expected_log_likelihood_per_point(
        self,
        network,
        x,
        y,
        *,
        noise=None,
        generator=None,
        num_samples: int = 1,
        objective: Optional[str] = None,
        kl_sink: Optional[dict] = None,
        summed: bool = False,
    ):
        """``E_q[log p(y_n | x_n, W)]`` per data point ``(..., N)`` (summed over outputs): exact,
        or a one-sample estimate over the sampled layers (``noise=None`` draws it). ``summed``: the
        caller only differentiates the points' sum (:meth:`elbo`), which lets the output layer's
        node take its backward pass ahead."""
        likelihood = network.likelihood
        h = network.point_features(x)
        if noise is None:
            noise = self.sample_noise(network, h.shape[-2], generator=generator, lead=h.shape[:-2])
        if getattr(likelihood, "needs_covariance", False):  # heteroscedastic: (mean, log-variance) covary
            return likelihood.expected_log_likelihood(y, *self.mean_and_covariance(network, h, noise, kl_sink=kl_sink))
        fused_ell = self._fused_normal_ell(network, h, y, noise, kl_sink, summed)
        if fused_ell is not None:
            return fused_ell
        mean = variance = samples = None
        if likelihood.needs_moments(objective):
            mean, var_a, var_b = network.squeeze_outputs(*self.output_moments(network, h, noise, kl_sink=kl_sink))
            variance = var_a + var_b
        if likelihood.needs_samples(objective):
            samples = network.sample_outputs(h, num_samples, generator=generator, after_point_layers=True)
        return likelihood.expected_log_likelihood(
            y, mean, variance, samples, objective=objective, multi_output=network.output_dim > 1
        )

    def elbo(
        self,
        network,
        x,
        y,
        *,
        num_data: Optional[int] = None,
        noise=None,
        generator=None,
        num_samples: int = 1,
        objective: Optional[str] = None,
    ):
        """``(num_data / batch) ELL - KL`` (eq. (4)): an unbiased minibatch ELBO, layer by layer
        (the estimators that integrate every layer first try the whole ELBO as one node:
        :meth:`ClosedForm.elbo`, :meth:`DeterministicPropagation.elbo`)."""
        # a fixed prior: the layers' functions hand their KL over on the way (one pass for both)
        sink = {} if network.prior != "empirical_bayes" else None
        ell = self.expected_log_likelihood_per_point(
            network,
            x,
            y,
            noise=noise,
            generator=generator,
            num_samples=num_samples,
            objective=objective,
            kl_sink=sink,
            summed=True,
        ).sum(-1)
        scale = 1.0 if num_data is None else num_data / x.shape[-2]
        return scale * ell - network.kl(folded=sink)

    def _fused_normal_ell(self, network, h, y, noise, kl_sink, summed: bool = False):
        """The Normal ELL per point through :mod:`.fused` (a diagonal output layer integrated
        exactly); ``None`` where that path does not apply."""
        output = network.layers[-1]
        if not isinstance(network.likelihood, NormalLikelihood) or getattr(output, "covariance", None) != "diagonal":
            return None
        target = y.unsqueeze(-1) if network.output_dim == 1 else y
        log_precision = network.likelihood.log_precision
        # one output of a ReLU-family network (ReLU, leaky ReLU, ReLU^2): the last hidden layer and
        # the output layer in one node on the cfbnn:: operators, from the pre-activations' variances
        on_operators = output.loc.shape[0] == 1 and fused.operators_apply(
            network.activation, output.loc, output.log_scale, target, log_precision
        )
        kind, value = self.forward_to_tail(network, h, noise, variance_form=on_operators, kl_sink=kl_sink)
        if kind in ("outputs", "full_moments"):
            return None
        if kind == "output_layer":
            phi, second_moment, variance = value, None, torch.zeros_like(value)
        elif on_operators:
            gamma, xi2 = value
            prior_variance = None if kl_sink is None else network.prior_scale**2
            rest = (output.loc, output.log_scale, target, log_precision, output.bias, prior_variance)
            family = family_of(network.activation)
            ell, kl = fused.operator_normal_ell(gamma, xi2, *rest, family=family, summed=summed)
            if kl is not None:
                kl_sink[len(network.layers) - 1] = kl
            return ell
        else:
            phi, second_moment, variance = network.activation.moments(*value, return_variance=True)
        return fused.normal_ell_given_hidden(
            phi, variance, output.loc, output.log_scale, target, log_precision, output.bias, second_moment
        )


class ClosedForm(Estimator):
    """The paper's estimator: the last two Gaussian layers integrated, earlier ones sampled."""

    name = "analytic"
    closed_form_layers = 2
    integrates = "the last hidden layer and the output layer (eqs. (7)-(9))"
    samples = "every earlier Gaussian layer (none for one hidden layer)"

    def elbo(self, network, x, y, *, num_data=None, noise=None, generator=None, **kwargs):
        """The paper's ELBO (eq. (4)) where the operators take the network: with one hidden layer
        (nothing sampled) the whole ELBO as one node (:func:`one_node_elbo`); deeper, the earlier
        layers sampled and the last two integrated as one node (:func:`sampled_then_tail_elbo`).
        Otherwise layer by layer (:meth:`Estimator.elbo`), with the same value."""
        if len(network.layers) == 2:
            whole = one_node_elbo(network, x, y, num_data, noise)
        else:
            whole = sampled_then_tail_elbo(self, network, x, y, num_data, noise, generator)
        if whole is not None:
            return whole
        return super().elbo(network, x, y, num_data=num_data, noise=noise, generator=generator, **kwargs)


class IntegrateOutputLayer(Estimator):
    """The output layer exactly given sampled activations; every other layer sampled."""

    name = "integrate_output_layer"
    closed_form_layers = 1
    integrates = "the output layer given the activations (eqs. (7)-(8))"
    samples = "every hidden Gaussian layer"


class LocalReparameterization(Estimator):
    """Every Gaussian layer sampled through its pre-activations (the Monte Carlo baseline)."""

    name = "sampling"  # (closed_form_layers: 0, the base's)
    integrates = "nothing"
    samples = "every Gaussian layer's pre-activations"


class DeterministicPropagation(Estimator):
    """Nothing sampled at any depth: moments propagated layer to layer.

    ``full_covariance=False`` carries each hidden unit's mean and variance (units independent);
    ``True`` carries the activations' covariance across units (mean-field q only).
    """

    closed_form_layers = 1 << 30
    samples = "nothing"

    def __init__(self, full_covariance: bool = False):
        self.full_covariance = bool(full_covariance)
        self.name = "deterministic_full" if self.full_covariance else "deterministic"
        self.integrates = (
            "every layer, the activations' covariance across units carried"
            if self.full_covariance
            else "every layer, each hidden unit's mean and variance carried"
        )

    def __repr__(self) -> str:
        return f"DeterministicPropagation(full_covariance={self.full_covariance})"

    def forward_to_tail(self, network, h, noise, *, variance_form: bool = False, kl_sink: Optional[dict] = None):
        """As :meth:`Estimator.forward_to_tail`; with ``full_covariance``, ``("full_moments", (phi,
        covariance))``: the last hidden layer's activations' mean and covariance across units."""
        if not self.full_covariance or network.point_layers == len(network.layers):
            return super().forward_to_tail(network, h, noise, variance_form=variance_form, kl_sink=kl_sink)
        return "full_moments", _full_covariance_hidden(network, h)

    def elbo(self, network, x, y, *, num_data=None, noise=None, **kwargs):
        """:meth:`Estimator.elbo`; the whole ELBO as one node where :func:`one_node_elbo` takes the
        network (not with ``full_covariance``: the covariance across units is not what it propagates)."""
        whole = None if self.full_covariance else one_node_elbo(network, x, y, num_data, noise)
        if whole is not None:
            return whole
        return super().elbo(network, x, y, num_data=num_data, noise=noise, **kwargs)


def one_node_elbo(network, x, y, num_data: Optional[int], noise):
    """The whole ELBO as one node where every layer is integrated in closed form, else ``None``:
    a ReLU-family network (ReLU, leaky ReLU, ReLU^2) whose layers are all mean-field Gaussians,
    one Normal output, a fixed prior and one batch of plain inputs, on the ``cfbnn::`` operators
    (:class:`.fused.operator_elbo.NormalELBO` for one hidden layer, :class:`.fused.operator_deep_elbo.DeepNormalELBO`
    for more): same value and gradients as layer by layer, less autograd bookkeeping
    (``tests/bnn/test_operator_elbo.py``, ``tests/bnn/test_fused.py``)."""
    if noise or x.dim() != 2 or y.shape != x.shape[:1] or x.requires_grad:
        return None
    layers = network.layers
    if (
        network.point_layers
        or network.prior == "empirical_bayes"
        or network.output_dim != 1
        or len(layers) < 2
        or type(network.likelihood) is not NormalLikelihood
        or any(getattr(layer, "covariance", None) != "diagonal" for layer in layers)
    ):
        return None
    log_precision = network.likelihood.log_precision
    parameters = [tensor for layer in layers for tensor in (layer.loc, layer.log_scale)]
    if not fused.operators_apply(network.activation, x, y, log_precision, *parameters):
        return None
    family = family_of(network.activation)
    scale = 1.0 if num_data is None else num_data / x.shape[-2]
    if len(layers) == 2:
        return fused.operator_normal_elbo(x, y, log_precision, *layers, network.prior_scale**2, scale, family)
    return fused.operator_deep_normal_elbo(x, y, log_precision, layers, network.prior_scale**2, scale, family)


def sampled_then_tail_elbo(estimator, network, x, y, num_data: Optional[int], noise, generator):
    """:class:`ClosedForm`'s ELBO of a deeper network where the operators take its tail, else
    ``None``: the layers before the last two sampled (``noise``, drawn with ``generator`` when
    ``None``), then the last hidden layer and the one Normal output integrated as one node
    (:class:`.fused.operator_elbo.NormalELL`, its rows summed at once), a fixed prior's KL folded in
    on the way. The same draws, value and gradients as :meth:`Estimator.elbo` (tests/bnn/test_estimators_tail_node.py)."""
    output = network.layers[-1]
    if (
        type(network.likelihood) is not NormalLikelihood
        or network.output_dim != 1
        or network.prior == "empirical_bayes"
        or getattr(output, "covariance", None) != "diagonal"
        or estimator.treatments(network)[-2:] != ("closed_form", "closed_form")
    ):
        return None
    target, log_precision = y.unsqueeze(-1), network.likelihood.log_precision
    if not fused.operators_apply(network.activation, output.loc, output.log_scale, target, log_precision):
        return None
    h = network.point_features(x)
    if noise is None:
        noise = estimator.sample_noise(network, h.shape[-2], generator=generator, lead=h.shape[:-2])
    sink = {}  # the KL terms the layers compute on the way
    _, (gamma, xi2) = estimator.forward_to_tail(network, h, noise, variance_form=True, kl_sink=sink)
    prior_variance = network.prior_scale**2
    family = family_of(network.activation)
    rest = (output.loc, output.log_scale, target, log_precision, output.bias, prior_variance)
    ell, sink[len(network.layers) - 1] = fused.operator_normal_ell(gamma, xi2, *rest, family=family, summed=True)
    scale = 1.0 if num_data is None else num_data / x.shape[-2]
    return scale * ell.sum(-1) - network.kl(folded=sink)


_BY_NAME = {
    "analytic": ClosedForm,
    "integrate_output_layer": IntegrateOutputLayer,
    "sampling": LocalReparameterization,
    "deterministic": DeterministicPropagation,
    "deterministic_full": lambda: DeterministicPropagation(full_covariance=True),
}
ESTIMATORS = tuple(_BY_NAME)  # the config names, in this order


def make_estimator(estimator) -> Estimator:
    """An :class:`Estimator` from itself or its name (one of :data:`ESTIMATORS`)."""
    if isinstance(estimator, Estimator):
        return estimator
    if isinstance(estimator, str) and estimator in _BY_NAME:
        return _BY_NAME[estimator]()
    raise ValueError(f"`estimator` must be one of {ESTIMATORS} or an Estimator object; got {estimator!r}")


# ---------------------------------------------------------------------- the tail, exactly


def integrate_tail(network, kind, value):
    """What :meth:`Estimator.forward_to_tail` left, integrated: ``(mean, var_A, var_B,
    hidden_variance)``, the last the hidden units' variances ``(..., N, H)`` when a hidden layer
    was integrated (``None`` otherwise; for ``full_moments`` the outputs' covariance ``(..., N,
    O, O)``)."""
    if kind == "outputs":
        return value, torch.zeros_like(value), torch.zeros_like(value), None
    output = network.layers[-1]
    if kind == "full_moments":
        # var_A: the hidden units' (co)variance through the mean weights; var_B: the output
        # weights' own variance at E[h^2]; the fourth value is the outputs' whole covariance
        mean, spread, own = output.propagated_covariance_parts(*value)
        return mean, torch.diagonal(spread, dim1=-2, dim2=-1), own, spread + torch.diag_embed(own)
    if kind == "output_layer":  # the output layer exactly, given (possibly sampled) activations
        mean, xi = output.preactivation_moments(value)
        return mean, torch.zeros_like(mean), xi.square(), None
    # the last hidden layer's moments, then the output layer exactly (eqs. (7)-(9))
    phi, _, hidden_variance = network.activation.moments(*value, return_variance=True)
    variance = hidden_variance
    if output.bias:  # the bias acts on a constant "hidden unit": Phi = 1, Var = 0
        phi = augment(phi)
        variance = torch.cat([variance, torch.zeros_like(variance[..., :1])], -1)
    return (*F.output_moments_given_hidden(phi, variance, output.loc, output.scale()), hidden_variance)


def _preactivation(network, index: int, h, moments, variance_output: bool, kl_sink: Optional[dict]):
    """``(gamma, xi)`` (``xi^2`` with ``variance_output``) of layer ``index``
    (:meth:`~.layers.GaussianMatrix.preactivation_and_kl`); its KL, where the layer's function
    computes it, goes to ``kl_sink``."""
    gamma, xi, kl = network.layers[index].preactivation_and_kl(
        h, moments, variance_output, None if kl_sink is None else network.prior_scale
    )
    if kl is not None:
        kl_sink[index] = kl
    return gamma, xi


def _propagated_moments(network, index: int, h, moments, kl_sink: Optional[dict]):
    """``(phi, variance, second_moment)`` of hidden layer ``index``'s activations, its inputs
    exact (``moments=None``) or propagated."""
    layer = network.layers[index]
    inputs = h if moments is None else moments[0]
    family = family_of(network.activation)
    if layer.covariance == "diagonal" and family is not None:
        if fused.operators_apply(network.activation, inputs, layer.loc):
            # the family's moments from the pre-activations' variances: no square root, either way
            gamma, xi2 = _preactivation(network, index, h, moments, True, kl_sink)
            check_mean_std(gamma, xi2, names=("gamma", "xi2"))  # the checks activation.moments makes
            phi, second_moment, variance = torch.ops.cfbnn.relu_family_moments(gamma, xi2, *family, True)
            return phi, variance, second_moment
    pre = _preactivation(network, index, h, moments, False, kl_sink)
    phi, second_moment, variance = network.activation.moments(*pre, return_variance=True)
    return phi, variance, second_moment


def _full_covariance_hidden(network, h):
    """``(mean (..., N, H), covariance (..., N, H, H))`` of the last hidden layer's activations,
    each hidden layer's covariance across units carried (``deterministic_full``)."""
    phi = covariance = None
    for layer in network.layers[network.point_layers : -1]:
        if layer.covariance != "diagonal":
            raise ValueError(
                f"estimator='deterministic_full' needs mean-field (diagonal) q on every layer; got {layer.covariance!r}"
            )
        if phi is None:  # the first layer's units are independent given x: a diagonal covariance
            gamma, xi = layer.preactivation_moments(h)
            phi, _, variance = network.activation.moments(gamma, xi, return_variance=True)
            covariance = torch.diag_embed(variance)
        else:
            phi, covariance = activation_covariance(
                network.activation, *layer.propagated_preactivation_covariance(phi, covariance)
            )
    if phi is None:
        raise ValueError("estimator='deterministic_full' needs at least one Gaussian hidden layer")
    return phi, covariance
