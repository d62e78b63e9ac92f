"""Estimators of the ELBO: which of a network's Gaussian layers are integrated, which sampled.

An estimator is an object, chosen once (:func:`make_estimator`, at a command's config boundary)
and passed to the network's methods, as Pyro passes its ``Trace_ELBO`` / ``TraceMeanField_ELBO``.
The same parameters can be trained or measured under any of them (paper Table 1 compares two
at the same parameters). Each estimator computes its own objective: bound to a network
(:meth:`Estimator.bind`, once per network), it asks each fused node whether it fits the network
(:class:`.fused.FusedNode`: ``supports(network)``, and why not, logged at debug level) and keeps
the ELBO and expected log-likelihood that answer gives (:class:`Objective`); the layers' arithmetic
is in :mod:`.layers` and :mod:`.fused`.

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

import logging
from typing import Optional, Tuple

import torch

from ..moments.activations import family_of
from ..moments.bivariate import activation_covariance
from ..moments.gaussian import check_mean_std
from . import functional as F
from . import fused
from .functional import augment
from .likelihoods import NormalLikelihood

log = logging.getLogger(__name__)
_nodes = torch.ops.cfbnn


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

    # ------------------------------------------------------------------ the objective

    # whether the estimator carries each hidden unit's mean and variance (the nodes' moments); not
    # DeterministicPropagation(full_covariance=True)
    propagates_diagonal = True

    def bind(self, network, *, fused: bool = True) -> "Objective":
        """This estimator's objective on ``network`` (:class:`Objective`), decided once per network
        and kept there: which fused node computes it, or the layers one by one. ``fused=False``: the
        layers one by one whatever fits (the comparisons of the tests and benchmarks)."""
        bound = network.bound_objectives.get((self, fused))
        if bound is None:
            bound = network.bound_objectives[(self, fused)] = Objective(self, network, fused)
        return bound

    def expected_log_likelihood_per_point(self, network, x, y, **options):
        """``E_q[log p(y_n | x_n, W)]`` per data point ``(..., N)`` (summed over outputs): exact, or a
        one-sample estimate over the sampled layers (``noise=None`` draws it); :meth:`Objective.ell`."""
        return self.bind(network).ell(x, y, **options)

    def elbo(self, network, x, y, **options):
        """``(num_data / batch) ELL - KL`` (eq. (4)): an unbiased minibatch ELBO; :meth:`Objective.elbo`."""
        return self.bind(network).elbo(x, y, **options)


class ClosedForm(Estimator):
    """The paper's estimator: the last two Gaussian layers integrated, earlier ones sampled."""

    name = "analytic"
    closed_form_layers = 2
    integrates = "the last hidden layer and the output layer (eqs. (7)-(9))"
    samples = "every earlier Gaussian layer (none for one hidden layer)"


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
        self.propagates_diagonal = not self.full_covariance
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


class Objective:
    """An estimator's ELBO and expected log-likelihood on one network (Pyro's ``TraceMeanField_ELBO``:
    the estimator owns its objective), made once by :meth:`Estimator.bind`: the fused nodes that fit
    the network (:data:`.fused.WHOLE_ELBO` where every layer is integrated, else :data:`.fused.TAIL`
    for the last hidden layer and the output layer) are asked once, their answer kept in
    :attr:`route` and logged at debug level, and :meth:`elbo` and :meth:`ell` are the ones it gives."""

    def __init__(self, estimator: Estimator, network, fused_nodes: bool = True):
        self.estimator, self.network = estimator, network
        treatments = estimator.treatments(network)
        every_layer = estimator.propagates_diagonal and all(t == "closed_form" for t in treatments)
        tail_layers = len(treatments) >= 2 and treatments[-2:] == ("closed_form", "closed_form")
        reasons = []
        if not fused_nodes:
            reasons.append("the layers one by one were asked for (fused=False)")
        elif not every_layer:
            reasons.append(f"cfbnn::normal_elbo: {estimator.name} samples a layer of this network")
        else:
            reasons += [f"cfbnn::normal_elbo: {r}" for r in fused.WHOLE_ELBO.not_supported_reasons(network)]
        whole = not reasons
        tail_reasons = [] if fused_nodes else ["fused=False"]
        if not (tail_layers and estimator.propagates_diagonal):
            tail_reasons.append(f"{estimator.name} does not integrate this network's last hidden layer")
        tail_reasons += fused.TAIL.not_supported_reasons(network)
        tail = not tail_reasons
        family = family_of(network.activation)
        self.family = None if family is None else (int(family[0]), float(family[1]))
        likelihood = network.likelihood
        # what is left to integrate after the sampled and propagated layers (Estimator.forward_to_tail)
        integrated_output = network.point_layers < len(treatments) and treatments[-1] == "closed_form"
        if getattr(likelihood, "needs_covariance", False):  # heteroscedastic: (mean, log-variance) covary
            self.ell = self._ell_from_covariance
        elif tail:
            self.ell = self._ell_on_tail
        elif (
            isinstance(likelihood, NormalLikelihood)
            and getattr(network.layers[-1], "covariance", None) == "diagonal"
            and integrated_output
            and estimator.propagates_diagonal
        ):
            self.ell = self._ell_given_hidden
        else:
            self.ell = self._ell_from_moments
        if whole:
            self.elbo = self._whole_elbo_one_hidden if len(network.layers) == 2 else self._whole_elbo_deep
            self.route = "cfbnn::normal_elbo: the whole ELBO as one node"
        else:
            self.elbo = self._elbo_from_ell
            why = "; ".join(reasons + ([] if tail else [f"cfbnn::normal_ell: {r}" for r in tail_reasons]))
            self.route = f"layer by layer{', the tail as one node (cfbnn::normal_ell)' if tail else ''}: {why}"
        log.debug("estimator %s on this network: %s", estimator.name, self.route)

    def __repr__(self) -> str:
        return f"Objective({self.estimator!r}: {self.route})"

    # ------------------------------------------------------------------ the ELBO

    def _scale(self, num_data, x) -> float:
        return 1.0 if num_data is None else num_data / x.shape[-2]

    def _whole_elbo_one_hidden(self, x, y, *, num_data=None, noise=None, **_):
        """``cfbnn::normal_elbo``: nothing is sampled (``noise`` empty)."""
        network = self.network
        hidden, output = network.layers
        return _each_batch(x, y, noise, lambda x, y: _nodes.normal_elbo(
            x, y, network.likelihood.log_precision, hidden.loc, hidden.log_scale, output.loc, output.log_scale,
            hidden.bias, output.bias, network.prior_scale**2, self._scale(num_data, x), *self.family,
        ))  # fmt: skip

    def _whole_elbo_deep(self, x, y, *, num_data=None, noise=None, **_):
        """``cfbnn::deep_normal_elbo``: every layer propagated."""
        network = self.network
        parameters = [tensor for layer in network.layers for tensor in (layer.loc, layer.log_scale)]
        biases = [layer.bias for layer in network.layers]
        return _each_batch(x, y, noise, lambda x, y: _nodes.deep_normal_elbo(
            x, y, network.likelihood.log_precision, parameters, biases, network.prior_scale**2,
            self._scale(num_data, x), *self.family,
        ))  # fmt: skip

    def _elbo_from_ell(self, x, y, *, num_data=None, noise=None, generator=None, num_samples=1, objective=None):
        """``(num_data / batch) ELL - KL``, the ELL summed over the points at once (the tail node then
        takes its backward ahead); a fixed prior's KL terms handed over by the layers on the way."""
        network = self.network
        sink = {} if network.prior != "empirical_bayes" else None
        ell = self.ell(
            x,
            y,
            noise=noise,
            generator=generator,
            num_samples=num_samples,
            objective=objective,
            kl_sink=sink,
            summed=True,
        ).sum(-1)
        return self._scale(num_data, x) * ell - network.kl(folded=sink)

    # ------------------------------------------------------------------ the expected log-likelihood

    def _after_point_layers(self, x, noise, generator):
        network = self.network
        h = network.point_features(x)
        if noise is None:
            noise = self.estimator.sample_noise(network, h.shape[-2], generator=generator, lead=h.shape[:-2])
        return h, noise

    def _target(self, y):
        return y.unsqueeze(-1) if self.network.output_dim == 1 else y

    def _ell_on_tail(self, x, y, *, noise=None, generator=None, kl_sink=None, summed=False, **_):
        """The layers before the last hidden one sampled or propagated, then ``cfbnn::normal_ell``
        (the last hidden layer from its pre-activations' variances, the output layer, the Normal
        likelihood; the output layer's KL folded in where ``kl_sink`` collects the KL terms)."""
        network, output = self.network, self.network.layers[-1]
        h, noise = self._after_point_layers(x, noise, generator)
        _, (gamma, xi2) = self.estimator.forward_to_tail(network, h, noise, variance_form=True, kl_sink=kl_sink)
        prior_variance = None if kl_sink is None else network.prior_scale**2
        gamma, xi2 = check_mean_std(gamma, xi2, names=("gamma", "xi2"))  # the checks activation.moments makes
        gamma, xi2 = torch.broadcast_tensors(gamma, xi2)
        lead, width = gamma.shape[:-1], gamma.shape[-1]
        target = torch.broadcast_to(y.unsqueeze(-1), lead + (1,)).reshape(-1)
        summed = bool(summed) and len(lead) == 1  # one upstream gradient for every row
        ell, kl = _nodes.normal_ell(
            gamma.reshape(-1, width), xi2.reshape(-1, width), output.loc, output.log_scale, target,
            network.likelihood.log_precision, output.bias, prior_variance, *self.family, summed,
        )  # fmt: skip
        if prior_variance is not None:
            kl_sink[len(network.layers) - 1] = kl
        return ell.reshape(lead)

    def _ell_given_hidden(self, x, y, *, noise=None, generator=None, kl_sink=None, **_):
        """A Normal likelihood and a mean-field output layer: the output layer integrated exactly
        given the hidden units' moments (:func:`.fused.normal_ell_given_hidden`), or the outputs'."""
        network, output = self.network, self.network.layers[-1]
        h, noise = self._after_point_layers(x, noise, generator)
        kind, value = self.estimator.forward_to_tail(network, h, noise, kl_sink=kl_sink)
        if kind == "output_layer":
            phi, second_moment, variance = value, None, torch.zeros_like(value)
        else:
            phi, second_moment, variance = network.activation.moments(*value, return_variance=True)
        log_precision = network.likelihood.log_precision
        return fused.normal_ell_given_hidden(
            phi, variance, output.loc, output.log_scale, self._target(y), log_precision, output.bias, second_moment
        )

    def _ell_from_covariance(self, x, y, *, noise=None, generator=None, kl_sink=None, **_):
        """A likelihood that needs the outputs' covariance (the heteroscedastic Normal's mean and
        log-variance covary)."""
        h, noise = self._after_point_layers(x, noise, generator)
        moments = self.estimator.mean_and_covariance(self.network, h, noise, kl_sink=kl_sink)
        return self.network.likelihood.expected_log_likelihood(y, *moments)

    def _ell_from_moments(self, x, y, *, noise=None, generator=None, num_samples=1, objective=None, kl_sink=None, **_):
        """Any likelihood from the outputs' moments and/or samples, as its objective asks."""
        network, likelihood = self.network, self.network.likelihood
        h, noise = self._after_point_layers(x, noise, generator)
        mean = variance = samples = None
        if likelihood.needs_moments(objective):
            moments = self.estimator.output_moments(network, h, noise, kl_sink=kl_sink)
            mean, var_a, var_b = network.squeeze_outputs(*moments)
            variance = var_a + var_b
        if likelihood.needs_samples(objective):
            sampling = LocalReparameterization()
            draws = sampling.sample_noise(network, h.shape[-2], generator=generator, num_samples=num_samples)
            samples = network.squeeze_outputs(*sampling.output_moments(network, h, draws))[0]
        return likelihood.expected_log_likelihood(
            y, mean, variance, samples, objective=objective, multi_output=network.output_dim > 1
        )


def _each_batch(x, y, noise, node):
    """The whole-ELBO node (``node(x, y)``, ``x`` ``(N, D)``) on each batch of rows of ``x``
    ``(..., N, D)``: one ELBO per leading index, as the layer-by-layer ELBO gives. ``noise`` must be
    empty (the node samples nothing)."""
    if noise:
        raise ValueError(
            f"`noise` must be empty: this estimator samples no layer of this network; got {len(noise)} tensor(s)"
        )
    if x.dim() == 2:
        return node(x, y)
    lead, rows = x.shape[:-2], x.shape[-2]
    xs, ys = x.reshape(-1, *x.shape[-2:]), torch.broadcast_to(y, (*lead, rows)).reshape(-1, rows)
    return torch.stack([node(a, b) for a, b in zip(xs, ys)]).reshape(lead)


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
    """``(phi, variance, second_moment)`` of hidden layer ``index``'s activations, its inputs exact
    (``moments=None``) or propagated: a ReLU-family member's moments from the pre-activations'
    variances (no square root either way), any other activation's from their standard deviations."""
    family = family_of(network.activation)
    if network.layers[index].covariance == "diagonal" and family is not None:
        gamma, xi2 = _preactivation(network, index, h, moments, True, kl_sink)
        check_mean_std(gamma, xi2, names=("gamma", "xi2"))  # the checks activation.moments makes
        phi, second_moment, variance = _nodes.relu_family_moments(gamma, xi2, *family, True)
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
