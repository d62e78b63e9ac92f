"""The network's weight layers: a Gaussian matrix (Bayesian) or a point estimate.

* :class:`GaussianMatrix` -- ``q(W) = prod_r N(W_r | loc_r, Sigma_r)`` over the rows (paper
  eq. (3)), covariance ``diagonal`` (mean field), ``full`` (a Cholesky factor per row) or
  ``lowrank`` (diagonal + rank-r factor); its pre-activation moments given exact inputs
  (eq. (12)) or propagated ones, and its KL to a ``N(0, s^2 I)`` prior;
* :class:`PointLinear` -- a point estimate (``nn.Linear``, no prior, no KL).

A bias enters through an input column of ones (paper footnote 1), counted in ``cols``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Optional, Tuple, Union

import torch
from torch import nn

from ..moments import elbo_reference as kl_reference
from ..moments.gaussian import is_transformed
from . import functional as F
from . import fused  # noqa: F401  (declares the layer nodes: cfbnn::diagonal_preactivation, ...)
from .functional import augment

_nodes = torch.ops.cfbnn

COVARIANCES = ("diagonal", "full", "lowrank")


# the open cached_weights() context's generation (0: none open, nothing cached)
_WEIGHT_CACHE = {"generation": 0}
_GENERATIONS = itertools.count(1)


@contextlib.contextmanager
def cached_weights():
    """Prediction with fixed weights over many batches: inside, each diagonal layer keeps its
    stacked means and variances (:meth:`GaussianMatrix.loc_and_variance`) between calls, about
    7 % of a prediction's time; outside, they are computed at each call.

    Opt-in, as ``torch.nn.utils.parametrize.cached()``: a cache keyed on the parameters' versions
    cannot see an edit through ``.data`` (``p.data.copy_(...)``, as some weight-averaging code
    does), which a cache left on would then silently ignore. Edit weights inside the context
    under ``torch.no_grad()`` (a new version), not through ``.data``. Each context starts empty."""
    previous = _WEIGHT_CACHE["generation"]
    _WEIGHT_CACHE["generation"] = next(_GENERATIONS)
    try:
        yield
    finally:
        _WEIGHT_CACHE["generation"] = previous


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

        Inside :func:`cached_weights` with autograd off, the value is kept between calls until a
        parameter changes (an optimizer step, ``load_state_dict`` or ``.to()`` gives it a new
        version or storage); elsewhere it is computed at each call.
        """
        variance_of = self.variance  # raises for non-diagonal q
        parameters = (self.loc, self.log_scale)
        generation = _WEIGHT_CACHE["generation"]
        if (
            not generation
            or torch.is_grad_enabled()
            or torch.compiler.is_compiling()
            or any(is_transformed(p) for p in parameters)  # (torch.func's wrappers have no version to key on)
        ):
            return torch.stack([self.loc, variance_of()])
        key = (generation,) + tuple((p._version, p.data_ptr(), p.device, p.dtype, p.shape) for p in parameters)
        if self._cached_loc_and_variance is None or self._cached_loc_and_variance[0] != key:
            self._cached_loc_and_variance = (key, torch.stack([self.loc, variance_of()]))
        return self._cached_loc_and_variance[1]

    def preactivation_moments(self, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(gamma, xi)`` of ``W [h, 1]`` under q (eq. (12)): each ``(..., N, rows)``."""
        if self.covariance == "diagonal":  # the layer node: analytic backward, no [h, 1] built
            return self._diagonal(h, False, None)[:2]
        return F.preactivation_moments(augment(h) if self.bias else h, self.loc, self.scale())

    def preactivation_mean_and_variance(self, h: torch.Tensor, moments=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(gamma, xi^2)``: :meth:`preactivation_moments` (``moments=None``) or
        :meth:`propagated_preactivation_moments` (``moments = (phi, variance, second_moment)``)
        with the variance in place of the standard deviation (a diagonal q takes no square root)."""
        if self.covariance == "diagonal":
            node = self._diagonal(h, True, None) if moments is None else self._propagated(moments, True, None)
            return node[:2]
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
        from the same node: for a diagonal q the KL comes from the pass that makes the variances,
        its gradient folded into the layer's (:mod:`.fused`). ``KL`` is ``None`` for another
        covariance or no prior; then :meth:`kl` as usual."""
        if self.covariance == "diagonal":
            prior_variance = None if prior_scale is None else float(prior_scale) ** 2
            if moments is None:
                gamma, xi, kl = self._diagonal(h, variance_output, prior_variance)
            else:
                gamma, xi, kl = self._propagated(moments, variance_output, prior_variance)
            return gamma, xi, (kl if prior_variance is not None else None)
        if variance_output:
            return (*self.preactivation_mean_and_variance(h, moments), None)
        return (*self._moments_from(h, moments), None)

    def _diagonal(self, h, variance_output: bool, prior_variance):
        """``cfbnn::diagonal_preactivation``: ``(gamma, xi or xi^2, KL or empty)``."""
        return _nodes.diagonal_preactivation(h, self.loc, self.log_scale, self.bias, variance_output, prior_variance)

    def _propagated(self, moments, variance_output: bool, prior_variance):
        """``cfbnn::propagated_preactivation`` of ``moments = (phi, variance, second_moment)``."""
        phi, variance, second_moment = moments
        return _nodes.propagated_preactivation(
            phi, variance, second_moment, self.loc, self.log_scale, self.bias, variance_output, prior_variance
        )

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
        if self.covariance == "diagonal":  # the layer node: analytic backward, three products
            return self._propagated((phi, variance, second_moment), False, None)[:2]
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
        mean, spread, own = self.propagated_covariance_parts(phi, covariance)
        return mean, spread + torch.diag_embed(own)

    def propagated_covariance_parts(self, phi, covariance):
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
        if self.covariance != "diagonal":
            return F.kl_normal_rows(self.loc, self.scale(), prior_scale)
        if isinstance(prior_scale, torch.Tensor):  # empirical Bayes: differentiable in the prior too
            return kl_reference.diagonal_kl(self.loc, self.log_scale, prior_scale * prior_scale)
        if not prior_scale > 0:
            raise ValueError(f"`prior_scale` must be > 0; got {prior_scale!r}")
        # a fixed prior: one pass over the matrix each way (cfbnn::diagonal_kl)
        return _nodes.diagonal_kl(self.loc, self.log_scale, float(prior_scale) ** 2)


class PointLinear(nn.Linear):
    """A point-estimate layer (``nn.Linear`` with its bias): no prior, no KL, no sampling."""


Layer = Union[GaussianMatrix, PointLinear]
