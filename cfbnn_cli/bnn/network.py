"""The paper's network, in one place: a stack of weight layers, each with its treatment.

``x -> W_1 -> g -> W_2 -> g -> ... -> W_L -> outputs``, biases through an input column
of ones on every layer (paper footnote 1; ``output_bias=False`` drops it on the last
layer). Every weight matrix is one layer object:

* :class:`GaussianMatrix` -- Bayesian: ``q(W) = prod_r N(W_r | loc_r, Sigma_r)`` over
  the rows (paper eq. (3)), covariance ``diagonal`` (mean field), ``full`` (a Cholesky
  factor per row) or ``lowrank`` (diagonal + rank-r factor), prior ``N(0, s^2 I)`` with
  ``s`` fixed or, ``prior="empirical_bayes"``, at its ELBO optimum per layer;
* :class:`PointLinear` -- a point estimate (``nn.Linear``, no prior, no KL): the
  maximum-likelihood layer of the Figure 1 head, the decoder of VAE variant V1 and
  the plain-MLP baseline (all layers point).

Point layers come first (``point_layers`` of them), Gaussian layers after. How each
Gaussian layer is treated is the *estimator*, chosen per call, so that one set of
parameters can be trained or measured with any of them (paper Table 1 compares two
at the same parameters):

======================  =====================================================
``analytic``            the last two Gaussian layers integrated out in closed form
                        (the hidden units' Phi and Var, eq. (9), then the output
                        layer exactly, eqs. (7)-(8)); earlier ones sampled by local
                        reparameterization. One hidden layer: nothing is sampled.
``integrate_output_layer``  every Gaussian layer sampled but the output layer, which is
                        integrated exactly given the sampled activations (VAE "V2").
``sampling``            every Gaussian layer sampled (local reparameterization).
``deterministic``       nothing sampled at any depth: the first Gaussian layer's
                        pre-activations exactly (eq. (12)), every later hidden
                        layer's from the previous layer's output moments and its
                        q (:meth:`GaussianMatrix.propagated_preactivation_moments`,
                        mean and variance per unit, units treated as independent:
                        the diagonal moment propagation of deterministic VI, Wu et
                        al. 2019), the output layer exactly given those moments.
                        Exact for one hidden layer (there it equals ``analytic``);
                        an approximation for deeper networks, whose bias
                        ``tests/bnn/test_deterministic.py`` measures against Monte Carlo.
``deterministic_full``  as ``deterministic``, but each layer carries the full
                        covariance of its activations across units (DVI proper):
                        ``Cov[g(u_i), g(u_j)]`` from the exact bivariate cross-moments
                        (:mod:`cfbnn_cli.moments.bivariate`; ReLU, leaky ReLU,
                        identity), the next layer's pre-activation covariance
                        ``W C W^T + diag(E[h^2]^T Var W)``. Mean-field q only; cost
                        ``N H^2`` per hidden layer.
======================  =====================================================

The likelihood is a separate object (:mod:`.likelihoods`), passed in.
:class:`ClosedFormBNN` is the paper's one-hidden-layer network ``x -> A x -> g(A x)
-> B g(A x)`` with the constructor of the paper's notation (``a_covariance``,
``b_covariance``, ``likelihood``).

Noise for the sampled layers is an explicit argument (standard-normal tensors of
:meth:`BayesianNetwork.noise_shapes`), so ``torch.func.vmap`` can draw many gradient
samples in one call (Table 1).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..moments import fast as fast_moments
from ..moments import get_activation
from ..moments.gaussian import check_mean_std, is_transformed
from . import functional as F
from . import fused
from .functional import augment
from .likelihoods import LIKELIHOODS, CategoricalLikelihood, NormalLikelihood, make_likelihood
from .predictive import Predictive, predictive

COVARIANCES = ("diagonal", "full", "lowrank")
ESTIMATORS = ("analytic", "integrate_output_layer", "sampling", "deterministic", "deterministic_full")
PRIORS = ("fixed", "empirical_bayes")
_CLOSED_FORM_LAYERS = {
    "analytic": 2,
    "integrate_output_layer": 1,
    "sampling": 0,
    "deterministic": 1 << 30,
    "deterministic_full": 1 << 30,
}
_ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth")


class GaussianMatrix(nn.Module):
    """``q`` over a ``(rows, cols)`` weight matrix with independent rows (eq. (3)).

    Scales are parametrized by their logarithm (the paper's "log root variances"), so
    gradient variances are reported with respect to ``log_scale``.
    """

    def __init__(
        self,
        rows: int,
        cols: int,
        covariance: str = "diagonal",
        rank: int = 10,
        init_scale: float = 1e-2,
        init_loc_std: Optional[float] = None,
        generator: Optional[torch.Generator] = None,
        bias: bool = True,
    ):
        super().__init__()
        if covariance not in COVARIANCES:
            raise ValueError(f"`covariance` must be one of {COVARIANCES}; got {covariance!r}")
        if rows < 1 or cols < 1:
            raise ValueError(f"`rows` and `cols` must be >= 1; got {rows}, {cols}")
        if not init_scale > 0:
            raise ValueError(f"`init_scale` must be > 0; got {init_scale!r}")
        self.covariance = covariance
        self.bias = bool(bias)  # whether its input carries the column of ones (cols counts it)
        self._cached_loc_and_variance = None  # (parameter version key, value): see loc_and_variance()
        std = init_loc_std if init_loc_std is not None else 1.0 / math.sqrt(cols)
        self.loc = nn.Parameter(torch.randn(rows, cols, generator=generator) * std)
        self.log_scale = nn.Parameter(torch.full((rows, cols), math.log(init_scale)))
        if covariance == "full":
            self.off_diagonal = nn.Parameter(torch.zeros(rows, cols, cols))
            self.register_buffer("_strict_lower", torch.ones(cols, cols).tril(-1), persistent=False)
        elif covariance == "lowrank":
            if rank < 1:
                raise ValueError(f"`rank` must be >= 1 for lowrank covariance; got {rank}")
            self.factor = nn.Parameter(
                torch.randn(rows, cols, rank, generator=generator) * init_scale / math.sqrt(rank)
            )

    @property
    def out_features(self) -> int:
        return self.loc.shape[0]

    def scale(self):
        """Standard deviations ``(R, C)``, Cholesky factors ``(R, C, C)`` or a LowRankScale."""
        diagonal = self.log_scale.exp()
        if self.covariance == "diagonal":
            return diagonal
        if self.covariance == "full":
            return self.off_diagonal * self._strict_lower + torch.diag_embed(diagonal)
        return F.LowRankScale(diagonal, self.factor)

    def variance(self):
        """Elementwise variances ``(R, C)`` of a diagonal q (``scale() ** 2``)."""
        if self.covariance != "diagonal":
            raise ValueError(f"`variance()` is for diagonal covariance; this matrix has {self.covariance!r}")
        return self.log_scale.mul(2.0).exp()

    def loc_and_variance(self):
        """``(2, R, C)``: the means and the variances of a diagonal q, stacked for one batched
        product (:func:`~cfbnn_cli.bnn.functional.diagonal_preactivation_moments`).

        Prediction asks for them once per batch while the weights stay fixed, so with
        autograd off the value is kept until a parameter changes (an optimizer step,
        ``load_state_dict`` or ``.to()`` gives it a new version or storage).
        """
        variance_of = self.variance  # raises for non-diagonal q
        parameters = (self.loc, self.log_scale)
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or any(is_transformed(p) for p in parameters):
            return torch.stack([self.loc, variance_of()])
        key = tuple((p._version, p.data_ptr(), p.device, p.dtype, p.shape) for p in parameters)
        if self._cached_loc_and_variance is None or self._cached_loc_and_variance[0] != key:
            self._cached_loc_and_variance = (key, torch.stack([self.loc, variance_of()]))
        return self._cached_loc_and_variance[1]

    def preactivation_moments(self, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(gamma, xi)`` of ``W [h, 1]`` under q (eq. (12)): each ``(..., N, rows)``."""
        if self.covariance == "diagonal":  # the fused path: analytic backward, no [h, 1] built
            return fused.diagonal_preactivation(h, self.loc, self.log_scale, self.bias)
        return F.preactivation_moments(augment(h) if self.bias else h, self.loc, self.scale())

    def preactivation_mean_and_variance(self, h: torch.Tensor, moments=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(gamma, xi^2)``: :meth:`preactivation_moments` (``moments=None``) or
        :meth:`propagated_preactivation_moments` (``moments = (phi, variance, second_moment)``)
        with the variance in place of the standard deviation (a diagonal q takes no square root)."""
        if self.covariance == "diagonal":
            if moments is None:
                return fused.diagonal_preactivation_variance(h, self.loc, self.log_scale, self.bias)
            phi, variance, second_moment = moments
            return fused.propagated_preactivation_variance(
                phi, variance, self.loc, self.log_scale, self.bias, second_moment
            )
        gamma, xi = self._moments_from(h, moments)
        return gamma, xi.square()

    def _moments_from(self, h: torch.Tensor, moments=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(gamma, xi)`` from exact inputs ``h`` or, ``moments = (phi, variance, second_moment)``,
        from propagated ones."""
        return self.preactivation_moments(h) if moments is None else self.propagated_preactivation_moments(*moments)

    def preactivation_and_kl(
        self, h: torch.Tensor, moments=None, variance_output: bool = False, prior_scale: Optional[float] = None
    ):
        """``(gamma, xi or xi^2, KL or None)``: the pre-activation moments from exact inputs ``h``
        or, ``moments = (phi, variance, second_moment)``, from propagated ones (the variance with
        ``variance_output``), and with a ``prior_scale`` this matrix's ``KL(q || N(0, s^2 I))``
        from the same function: for a diagonal q the kernels compute the KL in the pass that
        makes the variances, and fold its gradient into the layer's (:mod:`.fused`). ``KL`` is
        ``None`` where that does not apply; then :meth:`kl` as usual."""
        if prior_scale is not None and self.covariance == "diagonal":
            prior_variance = prior_scale * prior_scale
            if moments is None:
                return fused.diagonal_preactivation_and_kl(
                    h, self.loc, self.log_scale, self.bias, variance_output, prior_variance
                )
            phi, variance, second_moment = moments
            return fused.propagated_preactivation_and_kl(
                phi, variance, self.loc, self.log_scale, self.bias, second_moment, variance_output, prior_variance
            )
        if variance_output:
            return (*self.preactivation_mean_and_variance(h, moments), None)
        return (*self._moments_from(h, moments), None)

    def elementwise_variance(self) -> torch.Tensor:
        """``Var_q[W_rc]`` as an ``(R, C)`` matrix: the diagonal of each row's covariance."""
        if self.covariance == "diagonal":
            return self.log_scale.mul(2.0).exp()
        scale = self.scale()
        if self.covariance == "full":
            return scale.square().sum(-1)  # diag(L L^T)_c = sum_k L_ck^2
        return scale.diag.square() + scale.factor.square().sum(-1)

    def propagated_preactivation_moments(
        self, phi: torch.Tensor, variance: torch.Tensor, second_moment: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(gamma, xi)`` (mean, standard deviation) of ``W [h, 1]`` when the inputs ``h``
        are themselves uncertain: independent across units with means ``phi`` and
        variances ``variance``, and independent of W (the ``deterministic`` estimator).

        ``Var[sum_c W_rc h_c] = phi^T Sigma_r phi + sum_c (loc_rc^2 + Var W_rc) variance_c``:
        the first term is the exact weight-uncertainty variance at ``h = phi`` (eq. (12)),
        the second what the inputs' spread adds. The bias column (``h = 1``) adds no
        variance of its own. ``xi`` never reaches 0 where q has any spread, so its square
        root has a finite gradient. ``second_moment``, ``E[h^2]`` when the caller has it
        (the activation's Upsilon), spares the diagonal path forming ``phi^2 + variance``.
        """
        if self.covariance == "diagonal":  # the fused path: analytic backward, three products
            return fused.propagated_preactivation(phi, variance, self.loc, self.log_scale, self.bias, second_moment)
        gamma, xi = self.preactivation_moments(phi)
        weights = self.loc.square() + self.elementwise_variance()
        if self.bias:
            weights = weights[..., :-1]
        spread = variance @ weights.transpose(-1, -2)
        return gamma, (xi.square() + spread).sqrt()

    def propagated_preactivation_covariance(
        self, phi: torch.Tensor, covariance: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Mean ``(..., N, rows)`` and covariance ``(..., N, rows, rows)`` of ``W [h, 1]`` for
        inputs ``h`` of mean ``phi`` and covariance ``covariance`` ``(..., N, C, C)`` across units,
        independent of W (``deterministic_full``; a mean-field q).

        ``Cov[a_r, a_s] = loc_r^T C loc_s + delta_rs sum_c Var W_rc E[h_c^2]``: the inputs'
        covariance seen through the mean weights, plus each row's own weight variance (rows
        are independent under q, so it adds to the diagonal only).
        """
        mean, spread, own = self._propagated_covariance_parts(phi, covariance)
        return mean, spread + torch.diag_embed(own)

    def _propagated_covariance_parts(self, phi, covariance):
        """``(mean, loc C loc^T, sum_c Var W_rc E[h_c^2])``: the two parts of
        :meth:`propagated_preactivation_covariance` (the output layer reports them apart)."""
        if self.covariance != "diagonal":
            raise ValueError(
                f"full-covariance propagation needs a mean-field (diagonal) q; this layer has {self.covariance!r}"
            )
        width = phi.shape[-1]
        loc, weight_variance = self.loc[:, :width], self.log_scale[:, :width].mul(2.0).exp()
        mean = phi @ loc.mT
        spread = loc @ covariance @ loc.mT
        second = phi.square() + torch.diagonal(covariance, dim1=-2, dim2=-1)
        own = second @ weight_variance.mT
        if self.bias:
            mean = mean + self.loc[:, width]
            own = own + self.log_scale[:, width].mul(2.0).exp()
        return mean, spread, own

    def second_moment(self) -> torch.Tensor:
        """``E_q[W_rc^2]`` averaged over the matrix: ``(sum_r tr Sigma_r + |loc|^2) / (R C)``."""
        if self.covariance == "diagonal":
            trace = self.log_scale.mul(2.0).exp().sum()
        elif self.covariance == "full":
            trace = self.scale().square().sum()
        else:
            scale = self.scale()
            trace = scale.diag.square().sum() + scale.factor.square().sum()
        return (trace + self.loc.square().sum()) / self.loc.numel()

    def empirical_bayes_prior_scale(self) -> torch.Tensor:
        """The prior scale ``s`` that maximizes the ELBO given q: ``KL(q || N(0, s^2 I))`` is
        minimal at ``s^2 = E_q[W^2]`` averaged over the matrix (type-II maximum likelihood
        of a per-layer prior variance, as DVI, Wu et al. 2019). Differentiable: by the
        envelope theorem the gradient of the KL at the optimum is the gradient at fixed s."""
        return self.second_moment().sqrt()

    def kl(self, prior_scale=1.0) -> torch.Tensor:
        """``KL(q || N(0, prior_scale^2 I))`` in closed form; ``prior_scale=None``: at the
        empirical-Bayes optimum (:meth:`empirical_bayes_prior_scale`)."""
        if prior_scale is None:
            prior_scale = self.empirical_bayes_prior_scale()
        if self.covariance == "diagonal":
            return fused.diagonal_kl(self.loc, self.log_scale, prior_scale * prior_scale)
        return F.kl_normal_rows(self.loc, self.scale(), prior_scale)


class PointLinear(nn.Linear):
    """A point-estimate layer (``nn.Linear`` with its bias): no prior, no KL, no sampling."""


Layer = Union[GaussianMatrix, PointLinear]


def _check_estimator(estimator: str) -> str:
    if estimator not in ESTIMATORS:
        raise ValueError(f"`estimator` must be one of {ESTIMATORS}; got {estimator!r}")
    return estimator


class BayesianNetwork(nn.Module):
    """``D -> H_1 -> ... -> H_L -> O``: ``point_layers`` point layers, then Gaussian layers.

    Outputs are ``(..., N)`` for ``output_dim = 1`` and ``(..., N, O)`` otherwise.
    ``covariance`` is one name for every Gaussian layer or a list with one per Gaussian
    layer; the output layer's must be ``diagonal`` or ``full``.
    """

    def __init__(
        self,
        input_dim: int,
        hidden_sizes: Sequence[int],
        output_dim: int = 1,
        activation="relu",
        covariance: Union[str, Sequence[str]] = "diagonal",
        rank: int = 10,
        prior_scale: float = 1.0,
        init_scale: float = 1e-2,
        likelihood: Optional[nn.Module] = None,
        point_layers: int = 0,
        output_bias: bool = True,
        generator: Optional[torch.Generator] = None,
        prior: str = "fixed",
    ):
        super().__init__()
        if prior not in PRIORS:
            raise ValueError(f"`prior` must be one of {PRIORS}; got {prior!r}")
        hidden_sizes = [int(h) for h in hidden_sizes]
        if any(h < 1 for h in hidden_sizes):
            raise ValueError(f"`hidden_sizes` must be positive widths; got {hidden_sizes}")
        if int(output_dim) < 1 or int(input_dim) < 1:
            raise ValueError(f"`input_dim` and `output_dim` must be >= 1; got {input_dim}, {output_dim}")
        if not prior_scale > 0:
            raise ValueError(f"`prior_scale` must be > 0; got {prior_scale!r}")
        widths = [int(input_dim)] + hidden_sizes + [int(output_dim)]
        n_layers = len(widths) - 1
        if not 0 <= point_layers <= n_layers:
            raise ValueError(f"`point_layers` must be between 0 and the {n_layers} layers; got {point_layers}")
        n_gaussian = n_layers - point_layers
        covariances = [covariance] * n_gaussian if isinstance(covariance, str) else list(covariance)
        if len(covariances) != n_gaussian:
            raise ValueError(f"`covariance` needs one entry per Gaussian layer ({n_gaussian}); got {covariances}")
        if n_gaussian and covariances[-1] not in ("diagonal", "full"):
            raise ValueError(f"the output layer's covariance must be 'diagonal' or 'full'; got {covariances[-1]!r}")
        self.activation = get_activation(activation)
        self.output_dim = int(output_dim)
        self.point_layers = int(point_layers)
        self.prior_scale = float(prior_scale)
        self.prior = prior
        self.likelihood = likelihood if likelihood is not None else NormalLikelihood()
        layers: List[nn.Module] = []
        for index, (inp, out) in enumerate(zip(widths[:-1], widths[1:])):
            if index < point_layers:
                layers.append(PointLinear(inp, out))
            else:
                bias = output_bias or index < n_layers - 1
                layers.append(
                    GaussianMatrix(
                        out,
                        inp + bias,
                        covariances[index - point_layers],
                        rank,
                        init_scale,
                        generator=generator,
                        bias=bias,
                    )
                )
        self.layers = nn.ModuleList(layers)
        # {layer index: KL} collected while an ELBO is evaluated: a layer's KL comes out of its
        # pre-activation function, its gradient folded into the layer's (see elbo())
        self._kl_sink: Optional[dict] = None

    # ------------------------------------------------------------------ structure

    @property
    def gaussian_layers(self) -> List[GaussianMatrix]:
        return [layer for layer in self.layers if isinstance(layer, GaussianMatrix)]

    def prior_scales(self) -> List[float]:
        """The prior standard deviation of each Gaussian layer (learned under empirical Bayes)."""
        return [
            float(layer.empirical_bayes_prior_scale().detach()) if self.prior == "empirical_bayes" else self.prior_scale
            for layer in self.gaussian_layers
        ]

    @property
    def precision(self) -> torch.Tensor:
        """The Normal likelihood's precision beta."""
        return self.likelihood.precision

    def layer_names(self) -> List[str]:
        """Names of the Gaussian layers for tables: ``first``, ``second``, ..., ``final``."""
        count = len(self.gaussian_layers)
        return [
            (_ORDINALS[i] if i < len(_ORDINALS) else f"layer {i + 1}") if i < count - 1 else "final"
            for i in range(count)
        ]

    def treatments(self, estimator: str) -> Tuple[str, ...]:
        """Per layer: ``point``, ``sampled`` or ``closed_form`` under ``estimator``."""
        n = len(self.layers)
        key = (estimator, n, self.point_layers)
        cache = self.__dict__.setdefault("_treatments_cache", {})  # asked several times per step
        if key not in cache:
            closed = min(_CLOSED_FORM_LAYERS[_check_estimator(estimator)], n - self.point_layers)
            cache[key] = tuple(
                "point" if i < self.point_layers else "closed_form" if i >= n - closed else "sampled" for i in range(n)
            )
        return cache[key]

    def noise_shapes(self, batch: int, estimator: str) -> Tuple[Tuple[int, ...], ...]:
        """Shapes of the standard-normal noise one evaluation consumes (one per sampled layer)."""
        return tuple(
            (batch, layer.out_features)
            for layer, treatment in zip(self.layers, self.treatments(estimator))
            if treatment == "sampled"
        )

    def sample_noise(self, batch: int, estimator: str, generator=None, num_samples: Optional[int] = None, lead=()):
        lead = tuple(lead) + (() if num_samples is None else (num_samples,))
        shapes = self.noise_shapes(batch, estimator)
        if not shapes:  # nothing sampled (the closed form's hot path: no parameter walk)
            return ()
        like = next(self.parameters())
        return tuple(
            torch.randn(lead + shape, generator=generator, dtype=like.dtype, device=like.device) for shape in shapes
        )

    def kl(self, folded: Optional[dict] = None) -> torch.Tensor:
        """``KL(q || p)`` of every Gaussian layer, in closed form; with ``prior="empirical_bayes"``
        each layer's prior variance is at its ELBO-optimal value given q. ``folded``: KL terms
        already computed, by layer index (:meth:`elbo`)."""
        prior_scale = None if self.prior == "empirical_bayes" else self.prior_scale
        folded = folded or {}
        terms = [
            folded[index] if index in folded else layer.kl(prior_scale)
            for index, layer in enumerate(self.layers)
            if isinstance(layer, GaussianMatrix)
        ]
        if not terms:  # every layer a point estimate
            first = self.layers[0].weight
            return torch.zeros((), dtype=first.dtype, device=first.device)
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        return total

    # ------------------------------------------------------------------ outputs

    def point_features(self, x: torch.Tensor) -> torch.Tensor:
        """The activations after the point layers (``x`` itself when there are none; the
        outputs when every layer is a point layer)."""
        if not self.point_layers:  # (slicing a ModuleList builds a new module: not on the hot path)
            return x
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers[: self.point_layers]):
            x = layer(x) if index == last else self.activation(layer(x))  # no activation on the outputs
        return x

    def _forward_to_tail(self, h, estimator: str, noise, variance_form: bool = False):
        """Run the layers that are not integrated (point and sampled ones); returns what is
        left to integrate exactly: ``("outputs", z)`` when nothing is (every output sampled
        or a point estimate), ``("output_layer", h)`` when the output layer is integrated
        given activations ``h``, ``("hidden_and_output", (gamma, xi))`` when the last
        hidden layer (pre-activation moments ``gamma``, ``xi``) and the output layer are, or
        ``("full_moments", (phi, covariance))``, the last hidden layer's activations' mean
        and covariance across units (``deterministic_full``). ``variance_form``: the last
        hidden layer's moments as ``(gamma, xi^2)``."""
        if self.point_layers == len(self.layers):  # a plain network: h is already the output
            return "outputs", h
        if estimator == "deterministic_full":
            return "full_moments", self._full_covariance_hidden(h)
        treatments = self.treatments(estimator)
        noise = iter(noise)
        last = len(self.layers) - 1
        moments = None  # (mean, variance) of h once it is propagated rather than known
        for index in range(self.point_layers, len(self.layers)):
            layer, treatment = self.layers[index], treatments[index]
            if treatment == "closed_form":
                if index == last:  # only reached when no hidden layer was integrated before it
                    return "output_layer", h
                if index == last - 1:
                    return "hidden_and_output", self._preactivation(index, h, moments, variance_form)
                # a hidden layer before the last (the deterministic estimator): carry its moments on
                op = self._variance_form_op(layer, h if moments is None else moments[0])
                if op is not None:  # the kernel takes the variances: no square root, forward or backward
                    gamma, xi2 = self._preactivation(index, h, moments, variance_output=True)
                    check_mean_std(gamma, xi2, names=("gamma", "xi2"))  # the checks activation.moments makes
                    phi, second_moment, variance = fast_moments.moments_from_variance(op, gamma, xi2)
                else:
                    pre = self._preactivation(index, h, moments)
                    phi, second_moment, variance = self.activation.moments(*pre, return_variance=True)
                moments = (phi, variance, second_moment)
                continue
            gamma, xi = self._preactivation(index, h)
            z = gamma + xi * next(noise)
            if index == last:
                return "outputs", z
            h = self.activation(z)
        raise AssertionError("unreachable: the loop returns at the output layer")

    def _preactivation(self, index: int, h, moments=None, variance_output: bool = False):
        """``(gamma, xi)`` (``xi^2`` with ``variance_output``) of layer ``index``
        (:meth:`GaussianMatrix.preactivation_and_kl`). While an ELBO is evaluated the layer's KL
        comes out of the same function and goes to ``self._kl_sink``."""
        sink = self._kl_sink
        gamma, xi, kl = self.layers[index].preactivation_and_kl(
            h, moments, variance_output, None if sink is None else self.prior_scale
        )
        if kl is not None:
            sink[index] = kl
        return gamma, xi

    def _variance_form_op(self, layer, inputs: torch.Tensor):
        """The activation's kernels when a hidden layer's moments can be taken from its
        pre-activations' variances (:func:`~cfbnn_cli.moments.fast.moments_from_variance`)."""
        if layer.covariance != "diagonal" or inputs.dtype != layer.loc.dtype or inputs.device.type != "cpu":
            return None
        return fused.layer_kernel_op(self.activation, layer.loc, layer.log_scale)

    def _full_covariance_hidden(self, h):
        """``(mean (..., N, H), covariance (..., N, H, H))`` of the last hidden layer's activations,
        each hidden layer's covariance across units carried (``deterministic_full``)."""
        from ..moments.bivariate import activation_covariance

        phi = covariance = None
        for layer in self.layers[self.point_layers : -1]:
            if layer.covariance != "diagonal":
                raise ValueError(
                    f"estimator='deterministic_full' needs mean-field (diagonal) q on every layer; "
                    f"got {layer.covariance!r}"
                )
            if phi is None:  # the first layer's units are independent given x: a diagonal covariance
                gamma, xi = layer.preactivation_moments(h)
                phi, _, variance = self.activation.moments(gamma, xi, return_variance=True)
                covariance = torch.diag_embed(variance)
            else:
                phi, covariance = activation_covariance(
                    self.activation, *layer.propagated_preactivation_covariance(phi, covariance)
                )
        if phi is None:
            raise ValueError("estimator='deterministic_full' needs at least one Gaussian hidden layer")
        return phi, covariance

    def _propagate(self, h, estimator: str, noise):
        """``(mean, var_from_penultimate, var_from_output_layer)``, each ``(..., N, O)``, from
        the activations ``h`` after the point layers."""
        return self._integrate_tail(*self._forward_to_tail(h, estimator, noise))[:3]

    def _integrate_tail(self, kind, value):
        """What :meth:`_forward_to_tail` left, integrated: ``(mean, var_A, var_B,
        hidden_variance)``, the last the hidden units' variances ``(..., N, H)`` when a hidden
        layer was integrated (``None`` otherwise; for ``full_moments`` the outputs' covariance
        ``(..., N, O, O)``)."""
        if kind == "outputs":
            return value, torch.zeros_like(value), torch.zeros_like(value), None
        output = self.layers[-1]
        if kind == "full_moments":
            # var_A: the hidden units' (co)variance through the mean weights; var_B: the output
            # weights' own variance at E[h^2]; the fourth value is the outputs' whole covariance
            mean, spread, own = output._propagated_covariance_parts(*value)
            return mean, torch.diagonal(spread, dim1=-2, dim2=-1), own, spread + torch.diag_embed(own)
        if kind == "output_layer":  # the output layer exactly, given (possibly sampled) activations
            mean, xi = output.preactivation_moments(value)
            return mean, torch.zeros_like(mean), xi.square(), None
        # the last hidden layer's moments, then the output layer exactly (eqs. (7)-(9))
        phi, _, hidden_variance = self.activation.moments(*value, return_variance=True)
        variance = hidden_variance
        if output.bias:  # the bias acts on a constant "hidden unit": Phi = 1, Var = 0
            phi = augment(phi)
            variance = torch.cat([variance, torch.zeros_like(variance[..., :1])], -1)
        return (*F.output_moments_given_hidden(phi, variance, output.loc, output.scale()), hidden_variance)

    def _mean_and_covariance(self, h, estimator: str, noise):
        """``(mean (..., N, O), covariance (..., N, O, O))`` of the outputs from the activations
        ``h`` after the point layers. The output layer's rows are independent under q, so
        outputs covary only through the shared hidden units: ``Cov(o_i, o_j) = sum_c
        loc_ic loc_jc Var[h_c]`` off the diagonal (heteroscedastic regression needs it
        between the mean and the log-variance)."""
        kind, value = self._forward_to_tail(h, estimator, noise)
        mean, var_a, var_b, hidden_variance = self._integrate_tail(kind, value)
        if kind == "full_moments":  # the outputs' covariance, computed whole
            return mean, hidden_variance
        if hidden_variance is None:  # given sampled activations the output rows are independent
            return mean, torch.diag_embed(var_a + var_b)
        output = self.layers[-1]
        loc = output.loc[..., :-1] if output.bias else output.loc
        shared = torch.einsum("...nc,ic,jc->...nij", hidden_variance, loc, loc)
        return mean, shared + torch.diag_embed(var_a + var_b - torch.diagonal(shared, dim1=-2, dim2=-1))

    def _fused_normal_ell(self, h, y, estimator: str, noise):
        """The Normal ELL per point through :mod:`.fused` (a diagonal output layer integrated
        exactly); ``None`` where that path does not apply."""
        output = self.layers[-1]
        if not isinstance(self.likelihood, NormalLikelihood) or getattr(output, "covariance", None) != "diagonal":
            return None
        target = y.unsqueeze(-1) if self.output_dim == 1 else y
        # one output and a kernel for the activation: the last hidden layer and the output layer
        # in one pass each way, from the pre-activations' variances
        tail = fused.normal_tail_op(self.activation, output.loc, output.log_scale, target)
        kind, value = self._forward_to_tail(h, estimator, noise, variance_form=tail is not None)
        if kind in ("outputs", "full_moments"):
            return None
        if kind == "output_layer":
            phi, second_moment, variance = value, None, torch.zeros_like(value)
        elif tail is not None:
            sink = self._kl_sink
            ell, kl = fused.normal_ell_given_preactivation_and_kl(
                *value,
                tail,
                output.loc,
                output.log_scale,
                target,
                self.likelihood.log_precision,
                output.bias,
                None if sink is None else self.prior_scale**2,
            )
            if kl is not None:
                sink[len(self.layers) - 1] = kl
            return ell
        else:
            phi, second_moment, variance = self.activation.moments(*value, return_variance=True)
        return fused.normal_ell_given_hidden(
            phi,
            variance,
            output.loc,
            output.log_scale,
            target,
            self.likelihood.log_precision,
            output.bias,
            second_moment,
        )

    def _squeeze(self, *values):
        return tuple(v[..., 0] for v in values) if self.output_dim == 1 else values

    def output_moments(
        self,
        x,
        estimator: str = "analytic",
        noise=None,
        generator=None,
        after_point_layers: bool = False,
        split_variance: bool = False,
    ):
        """Mean and variance of the outputs under q, given the noise of the sampled layers.

        ``(mean, variance)``, or ``(mean, var_A, var_B)`` with ``split_variance`` (the
        paper's remark 2, eq. (44): the variance from the last hidden layer's weights and
        from the output layer's). Under ``sampling`` the output is the sample itself
        (variance 0). ``noise=None`` draws it from ``generator``; ``after_point_layers``
        says ``x`` is already :meth:`point_features`.
        """
        h = x if after_point_layers else self.point_features(x)
        if noise is None:
            noise = self.sample_noise(h.shape[-2], estimator, generator, lead=h.shape[:-2])
        mean, var_a, var_b = self._squeeze(*self._propagate(h, estimator, noise))
        return (mean, var_a, var_b) if split_variance else (mean, var_a + var_b)

    @torch.no_grad()
    def output_mean(self, x):
        """The exact mean of the outputs ``y_hat`` under ``analytic`` (no variance; the
        deterministic prediction ``argmax y_hat``, eq. (42), needs nothing more).

        For a diagonal last hidden layer it takes a leaner path: the stacked means and
        variances of that layer (cached while the weights stay put) in one product, and
        the mean-only moments of the activation.
        """
        treatments = self.treatments("analytic")
        hidden_index = len(self.layers) - 2
        if (
            hidden_index < 0
            or treatments[hidden_index] != "closed_form"
            or self.layers[hidden_index].covariance != "diagonal"
            or "sampled" in treatments
        ):
            return self.output_moments(x, "analytic", ())[0]
        hidden, output = self.layers[hidden_index], self.layers[-1]
        h = self.point_features(x)
        gamma, xi = F.diagonal_preactivation_moments(augment(h) if hidden.bias else h, hidden.loc_and_variance())
        phi = self.activation.mean(gamma, xi)
        mean = (augment(phi) if output.bias else phi) @ output.loc.transpose(-1, -2)
        return mean[..., 0] if self.output_dim == 1 else mean

    def sample_outputs(self, x, num_samples: int, generator=None, after_point_layers: bool = False):
        """``(S, ..., N[, O])`` outputs with every Gaussian layer sampled (local
        reparameterization), all samples in one batched computation."""
        h = x if after_point_layers else self.point_features(x)
        noise = self.sample_noise(h.shape[-2], "sampling", generator, num_samples=num_samples, lead=())
        return self.output_moments(h, "sampling", noise, after_point_layers=True)[0]

    @torch.no_grad()
    def predictive_components(
        self, x, estimator: str = "analytic", num_samples: int = 32, generator=None, chunk: int = 8, num_nodes: int = 64
    ):
        """The predictive density of ``y`` as a mixture of Normals, ``(means, variances,
        log_weights)`` each ``(K, N)``, for a one-output Normal or a heteroscedastic likelihood
        (:func:`mixture_log_likelihood` scores it).

        Normal: ``N(mean_s, var_s + 1/beta)``, equal weights over the draws of the sampled
        layers (one exact component when ``estimator`` samples nothing). Heteroscedastic:
        the likelihood's Gauss-Hermite mixture
        (:meth:`~.likelihoods.HeteroscedasticNormalLikelihood.predictive_mixture`) given the
        propagated (mean, log-variance) moments, for each draw of the sampled layers.
        """
        h = self.point_features(x)
        heteroscedastic = getattr(self.likelihood, "needs_covariance", False)
        sampled = bool(self.noise_shapes(h.shape[-2], estimator))
        num_draws = num_samples if sampled else 1  # each draw's components share 1 / num_draws
        draws = (
            [()]
            if not sampled
            else [
                self.sample_noise(h.shape[-2], estimator, generator, num_samples=min(chunk, num_samples - start))
                for start in range(0, num_samples, chunk)
            ]
        )  # chunks bound memory; draws within one are batched
        means, variances, log_weights = [], [], []
        for noise in draws:
            if heteroscedastic:
                mean, covariance = self._mean_and_covariance(h, estimator, noise)
                mean, variance, log_weight = (
                    v.flatten(0, -2) for v in self.likelihood.predictive_mixture(mean, covariance, num_nodes)
                )
            else:
                mean, variance = self.output_moments(h, estimator, noise, after_point_layers=True)
                variance = variance + 1.0 / self.precision
                if not noise:
                    mean, variance = mean.unsqueeze(0), variance.unsqueeze(0)
                log_weight = torch.zeros_like(mean)
            means.append(mean)
            variances.append(variance)
            log_weights.append(log_weight - math.log(num_draws))
        return torch.cat(means), torch.cat(variances), torch.cat(log_weights)

    # ------------------------------------------------------------------ objectives

    def expected_log_likelihood_per_point(
        self,
        x,
        y,
        estimator: str = "analytic",
        noise=None,
        generator=None,
        num_samples: int = 1,
        objective: Optional[str] = None,
    ):
        """``E_q[log p(y_n | x_n, W)]`` per data point ``(..., N)`` (summed over outputs):
        exact, or a one-sample estimate over the sampled layers."""
        likelihood = self.likelihood
        h = self.point_features(x)
        if noise is None:
            noise = self.sample_noise(h.shape[-2], estimator, generator, lead=h.shape[:-2])
        if getattr(likelihood, "needs_covariance", False):  # heteroscedastic: (mean, log-variance) covary
            return likelihood.expected_log_likelihood(y, *self._mean_and_covariance(h, estimator, noise))
        fused_ell = self._fused_normal_ell(h, y, estimator, noise)
        if fused_ell is not None:
            return fused_ell
        mean = variance = samples = None
        if likelihood.needs_moments(objective):
            mean, variance = self.output_moments(h, estimator, noise, generator, after_point_layers=True)
        if likelihood.needs_samples(objective):
            samples = self.sample_outputs(h, num_samples, generator, after_point_layers=True)
        return likelihood.expected_log_likelihood(
            y, mean, variance, samples, objective=objective, multi_output=self.output_dim > 1
        )

    def expected_log_likelihood(
        self,
        x,
        y,
        estimator: str = "analytic",
        noise=None,
        generator=None,
        num_samples: int = 1,
        objective: Optional[str] = None,
    ):
        """The summed ``E_q[sum_n log p(y_n | x_n, W)]`` (eq. (7) for the Normal likelihood)."""
        return self.expected_log_likelihood_per_point(x, y, estimator, noise, generator, num_samples, objective).sum(-1)

    def elbo(
        self,
        x,
        y,
        num_data: Optional[int] = None,
        estimator: str = "analytic",
        noise=None,
        generator=None,
        num_samples: int = 1,
        objective: Optional[str] = None,
    ):
        """``(num_data / batch) ELL - KL`` (eq. (4)): an unbiased minibatch ELBO."""
        single = self._single_node_elbo(x, y, num_data, estimator, noise)
        if single is not None:
            return single
        return self._elbo(
            lambda: self.expected_log_likelihood(x, y, estimator, noise, generator, num_samples, objective), x, num_data
        )

    def _single_node_elbo(self, x, y, num_data: Optional[int], estimator: str, noise):
        """The ELBO as one autograd node (:func:`.fused.closed_form_normal_elbo`) where every layer
        is a diagonal Gaussian integrated in closed form under ``estimator`` (``deterministic``;
        ``analytic`` for one hidden layer), with one Normal output, a fixed prior and tensors the
        kernels take; else ``None`` (then :meth:`_elbo`). Same value and gradients, less autograd
        bookkeeping (``tests/bnn/test_fused.py`` compares the two)."""
        # (deterministic_full carries the activations' covariance across units: not this route)
        if noise or estimator == "deterministic_full" or x.dim() != 2 or y.shape != x.shape[:1] or x.requires_grad:
            return None
        likelihood, layers = self.likelihood, self.layers
        # what the network's structure says, once per estimator (this runs every training step)
        key = (estimator, self.prior, self.point_layers, len(layers), type(likelihood))
        plans = self.__dict__.setdefault("_single_node_plans", {})
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = self._single_node_plan(estimator, layers)
        if not plan:
            return None
        op = plan[0]
        target = y.unsqueeze(-1)
        log_precision = likelihood.log_precision
        parameters = [tensor for layer in layers for tensor in (layer.loc, layer.log_scale)]
        if not fast_moments.layer_kernels_apply(op, x, target, log_precision, *parameters):
            return None
        scale = 1.0 if num_data is None else num_data / x.shape[-2]
        return fused.closed_form_normal_elbo(
            x, target, log_precision, op, parameters, [layer.bias for layer in layers], self.prior_scale**2, scale
        )

    def _single_node_plan(self, estimator: str, layers):
        """``(the activation's kernels,)`` when the structure allows the single-node ELBO under
        ``estimator`` (whether the kernels take the tensors is asked per call), else ``()``."""
        if (
            self.point_layers
            or self.prior == "empirical_bayes"
            or self.output_dim != 1
            or len(layers) < 2
            or self.treatments(estimator)[0] != "closed_form"
            or type(self.likelihood) is not NormalLikelihood
            or any(getattr(layer, "covariance", None) != "diagonal" for layer in layers)
        ):
            return ()
        return (fused.activation_kernels(self.activation),)

    def _elbo(self, expected_log_likelihood, x, num_data: Optional[int]):
        """``(num_data / batch) ELL - KL`` with the KL terms the ELL's evaluation folded in
        collected on the way (a fixed prior; the layers the kernels take), the others added."""
        # (through __dict__: nn.Module.__setattr__ costs ~5 us a call on the hot path)
        self.__dict__["_kl_sink"] = {} if self.prior != "empirical_bayes" else None
        try:
            ell = expected_log_likelihood()
            folded = self._kl_sink
        finally:
            self.__dict__["_kl_sink"] = None
        scale = 1.0 if num_data is None else num_data / x.shape[-2]
        return scale * ell - self.kl(folded)

    def predict(self, x, estimator: str = "analytic", num_samples: int = 64, generator=None) -> Predictive:
        """``p(y | x)`` as a :class:`~cfbnn_cli.bnn.predictive.Predictive` (mean, variance and its
        parts, a Normal, intervals); one-output Normal likelihoods."""
        return predictive(self, x, estimator, num_samples, generator)

    def forward(
        self,
        x,
        y=None,
        estimator: str = "analytic",
        noise=None,
        generator=None,
        num_samples: int = 1,
        objective: Optional[str] = None,
    ):
        """``model(x)``: the predictive distribution (:meth:`predict`). ``model(x, y, ...)``: the
        summed expected log-likelihood (what ``torch.func.functional_call`` and
        ``DistributedDataParallel`` evaluate in training)."""
        if y is None:
            return self.predict(x, estimator, generator=generator)
        # by keyword: ClosedFormBNN orders its expected_log_likelihood's arguments differently
        return self.expected_log_likelihood(
            x, y, estimator=estimator, noise=noise, generator=generator, num_samples=num_samples, objective=objective
        )


class ClosedFormBNN(BayesianNetwork):
    """The paper's network ``x -> A x -> g(A x) -> B g(A x)``, both matrices integrated out.

    ``input_dim`` excludes the bias column (added here). ``likelihood``: a likelihood object
    (:class:`~cfbnn_cli.bnn.likelihoods.NormalLikelihood`, the exact ELBO, or
    :class:`~cfbnn_cli.bnn.likelihoods.CategoricalLikelihood`, whose objective -- see
    :data:`~cfbnn_cli.bnn.likelihoods.CLASSIFICATION_OBJECTIVES` -- is also selectable per
    call), as everywhere in the library; its name (``"normal"``, ``"softmax"``,
    ``"logistic"``, with ``precision``, ``learn_precision`` and ``objective``) is the
    shorthand a config passes.
    """

    def __init__(
        self,
        input_dim: int,
        hidden_dim: int,
        output_dim: int = 1,
        activation="relu",
        a_covariance: str = "diagonal",
        b_covariance: str = "diagonal",
        rank: int = 10,
        prior_scale: float = 1.0,
        likelihood="normal",
        precision: float = 1.0,
        learn_precision: bool = True,
        init_scale: float = 1e-2,
        generator: Optional[torch.Generator] = None,
        output_bias: bool = True,
        objective: str = "approximation",
    ):
        if isinstance(likelihood, str):
            if likelihood not in LIKELIHOODS:
                raise ValueError(
                    f"`likelihood` must be one of {LIKELIHOODS} or a likelihood object; got {likelihood!r}"
                )
            likelihood = make_likelihood(likelihood, precision, learn_precision, objective)
        elif not isinstance(likelihood, (NormalLikelihood, CategoricalLikelihood)):
            raise ValueError(
                f"`likelihood` must be a NormalLikelihood or CategoricalLikelihood (or its name); got {likelihood!r}"
            )
        if b_covariance not in ("diagonal", "full"):
            raise ValueError(f"`b_covariance` must be 'diagonal' or 'full'; got {b_covariance!r}")
        if getattr(likelihood, "logistic", False) and output_dim != 1:
            raise ValueError(f"`output_dim` must be 1 for the logistic likelihood; got {output_dim}")
        super().__init__(
            input_dim,
            [hidden_dim],
            output_dim,
            activation,
            [a_covariance, b_covariance],
            rank,
            prior_scale,
            init_scale,
            likelihood,
            output_bias=output_bias,
            generator=generator,
        )

    @property
    def a(self) -> GaussianMatrix:
        return self.layers[0]

    @property
    def b(self) -> GaussianMatrix:
        return self.layers[1]

    def predictive(self, x):
        """``(mean, var_from_A, var_from_B, observation_noise)`` at ``x``, no sampling (eq. (44));
        the noise ``1/beta`` is ``None`` for a categorical likelihood (its logits have none)."""
        mean, var_a, var_b = self.output_moments(x, "analytic", (), split_variance=True)
        noise = 1.0 / self.precision if isinstance(self.likelihood, NormalLikelihood) else None
        return mean, var_a, var_b, noise

    def expected_log_likelihood(
        self,
        x,
        y,
        objective: Optional[str] = None,
        num_samples: int = 1,
        generator=None,
        estimator: str = "analytic",
        noise=None,
    ):
        """Summed ``E_q[log p(y | x, A, B)]`` over the batch (exact for the Normal likelihood)."""
        return super().expected_log_likelihood(x, y, estimator, noise, generator, num_samples, objective)

    def elbo(
        self,
        x,
        y,
        num_data: Optional[int] = None,
        objective: Optional[str] = None,
        num_samples: int = 1,
        generator=None,
        estimator: str = "analytic",
        noise=None,
    ):
        """``(num_data / batch) ELL - KL(A) - KL(B)``: an unbiased minibatch ELBO (exact for Normal)."""
        single = self._single_node_elbo(x, y, num_data, estimator, noise)
        if single is not None:
            return single
        return self._elbo(
            lambda: self.expected_log_likelihood(x, y, objective, num_samples, generator, estimator, noise), x, num_data
        )


def mixture_log_likelihood(y, means, variances, log_weights=None):
    """``log sum_s w_s N(y | mean_s, var_s)`` per data point ``(N,)``; equal weights ``1/S``
    unless ``log_weights`` (``(S, N)``, summing to one over ``S``) are given."""
    log_probs = -0.5 * ((y - means).square() / variances + torch.log(2 * math.pi * variances))
    if log_weights is None:
        return torch.logsumexp(log_probs, 0) - math.log(means.shape[0])
    return torch.logsumexp(log_probs + log_weights, 0)


def mixture_mean(means, log_weights=None):
    """The mean of the mixture: the (weighted) average of its components' means."""
    return means.mean(0) if log_weights is None else (means * log_weights.exp()).sum(0)


def bayesian_head(
    feature_dim: int,
    hidden_sizes: Sequence[int],
    num_classes: int,
    activation="relu",
    prior_scale: float = 1.0,
    init_scale: float = 1e-2,
    generator: Optional[torch.Generator] = None,
    objective: str = "approximation",
) -> BayesianNetwork:
    """The Figure 1 head on frozen features (paper "Fast Prediction"):
    ``features -> Linear (point estimate) -> g -> [Gaussian] -> g -> [Gaussian] -> logits``.

    Under ``analytic`` the logits' mean and variance are exact given the point layer's
    activations (nothing sampled); ``argmax`` of :meth:`BayesianNetwork.output_mean` is the
    deterministic prediction, eq. (42).
    """
    from .likelihoods import CategoricalLikelihood

    hidden_sizes = list(hidden_sizes)
    if len(hidden_sizes) != 2 or any(int(h) < 1 for h in hidden_sizes):
        raise ValueError(
            f"`hidden_sizes` must be two positive widths [point layer, Bayesian hidden layer]; got {hidden_sizes}"
        )
    if int(num_classes) < 2:
        raise ValueError(f"`num_classes` must be >= 2; got {num_classes}")
    return BayesianNetwork(
        feature_dim,
        hidden_sizes,
        num_classes,
        activation,
        "diagonal",
        prior_scale=prior_scale,
        init_scale=init_scale,
        likelihood=CategoricalLikelihood(objective),
        point_layers=1,
        generator=generator,
    )
