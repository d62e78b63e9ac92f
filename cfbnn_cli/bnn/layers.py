"""Variational families and the closed-form one-hidden-layer BNN as torch modules.

:class:`GaussianMatrix` is ``q(W) = prod_r N(W_r | loc_r, Sigma_r)`` over the rows
of a matrix, with ``covariance`` ``"diagonal"`` (mean field), ``"full"`` (a
Cholesky factor per row) or ``"lowrank"`` (diagonal + rank-r factor). Scales are
parametrized by their logarithm (the paper's "log root variances"), so gradient
variances are reported with respect to ``log_scale``.

:class:`ClosedFormBNN` is the paper's network ``x -> A x -> g(A x) -> B g(A x)``
with ``q(A, B) = q(B) prod_h q(a_h)`` and priors ``N(0, prior_scale^2 I)``. Its
objectives call :mod:`cfbnn_cli.bnn.functional`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..moments import get_activation
from ..moments.gaussian import _is_transformed
from . import functional as F
from .classification import (
    as_two_class,
    softmax_ell_analytic_numerator,
    softmax_ell_approximation,
    softmax_ell_control_variate,
    softmax_ell_monte_carlo,
)
from .monte_carlo import sample_outputs_local

COVARIANCES = ("diagonal", "full", "lowrank")
LIKELIHOODS = ("normal", "softmax", "logistic")
CLASSIFICATION_OBJECTIVES = ("approximation", "control_variate", "analytic_numerator", "sampling")


def augment(x: torch.Tensor) -> torch.Tensor:
    """Append the bias column of ones (paper footnote 2)."""
    return torch.cat([x, torch.ones(x.shape[:-1] + (1,), dtype=x.dtype, device=x.device)], dim=-1)


class LearnablePrecision(nn.Module):
    """The Normal likelihood's precision beta, stored as its log; learned or fixed."""

    def __init__(self, precision: float = 1.0, learn: bool = True):
        super().__init__()
        if not precision > 0:
            raise ValueError(f"`precision` must be > 0; got {precision!r}")
        log_precision = torch.tensor(math.log(precision))
        if learn:
            self.log_precision = nn.Parameter(log_precision)
        else:
            self.register_buffer("log_precision", log_precision)

    @property
    def precision(self) -> torch.Tensor:
        return self.log_precision.exp()


class GaussianMatrix(nn.Module):
    """``q`` over an ``(rows, cols)`` matrix with independent rows."""

    def __init__(
        self,
        rows: int,
        cols: int,
        covariance: str = "diagonal",
        rank: int = 10,
        init_scale: float = 1e-2,
        init_loc_std: Optional[float] = None,
        generator: Optional[torch.Generator] = None,
    ):
        super().__init__()
        if covariance not in COVARIANCES:
            raise ValueError(f"`covariance` must be one of {COVARIANCES}; got {covariance!r}")
        if rows < 1 or cols < 1:
            raise ValueError(f"`rows` and `cols` must be >= 1; got {rows}, {cols}")
        if not init_scale > 0:
            raise ValueError(f"`init_scale` must be > 0; got {init_scale!r}")
        self.covariance = covariance
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
            self.factor = nn.Parameter(torch.randn(rows, cols, rank, generator=generator) * init_scale / math.sqrt(rank))

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
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or any(_is_transformed(p) for p in parameters):
            return torch.stack([self.loc, variance_of()])
        key = tuple((p._version, p.data_ptr(), p.device, p.dtype, p.shape) for p in parameters)
        if self._cached_loc_and_variance is None or self._cached_loc_and_variance[0] != key:
            self._cached_loc_and_variance = (key, torch.stack([self.loc, variance_of()]))
        return self._cached_loc_and_variance[1]

    def kl(self, prior_scale: float = 1.0) -> torch.Tensor:
        return F.kl_normal_rows(self.loc, self.scale(), prior_scale)


class ClosedFormBNN(LearnablePrecision):
    """One hidden layer, both weight matrices integrated out in closed form.

    ``input_dim`` excludes the bias column (added here). ``likelihood="normal"`` uses
    the exact ELL; ``"softmax"``/``"logistic"`` use ``objective`` from
    :data:`CLASSIFICATION_OBJECTIVES` (the closed-form approximation, the unbiased
    control variate, the analytic numerator, or plain local-reparameterization
    sampling).
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
        likelihood: str = "normal",
        precision: float = 1.0,
        learn_precision: bool = True,
        init_scale: float = 1e-2,
        generator: Optional[torch.Generator] = None,
    ):
        super().__init__(precision, learn_precision)
        if likelihood not in LIKELIHOODS:
            raise ValueError(f"`likelihood` must be one of {LIKELIHOODS}; got {likelihood!r}")
        if b_covariance not in ("diagonal", "full"):
            raise ValueError(f"`b_covariance` must be 'diagonal' or 'full'; got {b_covariance!r}")
        if not prior_scale > 0:
            raise ValueError(f"`prior_scale` must be > 0; got {prior_scale!r}")
        if likelihood == "logistic" and output_dim != 1:
            raise ValueError(f"`output_dim` must be 1 for the logistic likelihood; got {output_dim}")
        self.activation = get_activation(activation)
        self.likelihood = likelihood
        self.prior_scale = float(prior_scale)
        self.output_dim = output_dim
        self.a = GaussianMatrix(hidden_dim, input_dim + 1, a_covariance, rank, init_scale, generator=generator)
        self.b = GaussianMatrix(output_dim, hidden_dim, b_covariance, rank, init_scale, generator=generator)

    def _b(self):
        loc, scale = self.b.loc, self.b.scale()
        if self.output_dim == 1 and self.likelihood != "softmax":
            return loc[0], scale[0]
        return loc, scale

    def predictive(self, x):
        """``(mean, var_from_A, var_from_B, observation_noise)`` at inputs ``x`` (no sampling)."""
        b_loc, b_scale = self._b()
        mean, var_a, var_b = F.predictive_moments(augment(x), self.a.loc, self.a.scale(), b_loc, b_scale, self.activation)
        return mean, var_a, var_b, 1.0 / self.precision

    def kl(self) -> torch.Tensor:
        return self.a.kl(self.prior_scale) + self.b.kl(self.prior_scale)

    def expected_log_likelihood(self, x, y, objective: str = "approximation", num_samples: int = 1, generator=None):
        """Summed ``E_q[log p(y | x, A, B)]`` over the batch (exact for the Normal likelihood)."""
        b_loc, b_scale = self._b()
        xa = augment(x)
        if self.likelihood == "normal":
            return F.regression_expected_log_likelihood(
                xa, y, self.a.loc, self.a.scale(), b_loc, b_scale, self.precision, self.activation
            )
        if objective not in CLASSIFICATION_OBJECTIVES:
            raise ValueError(f"`objective` must be one of {CLASSIFICATION_OBJECTIVES}; got {objective!r}")
        mean, var_a, var_b = F.predictive_moments(xa, self.a.loc, self.a.scale(), b_loc, b_scale, self.activation)
        variance = var_a + var_b
        if self.likelihood == "logistic":
            mean, variance = as_two_class(mean), as_two_class(variance)
        if objective == "approximation":
            return softmax_ell_approximation(mean, variance, y).sum()
        samples = sample_outputs_local(xa, self.a.loc, self.a.scale(), b_loc, b_scale, self.activation, num_samples, generator)
        if self.likelihood == "logistic":
            samples = as_two_class(samples)
        if objective == "control_variate":
            return softmax_ell_control_variate(mean, variance, samples, y).sum()
        if objective == "analytic_numerator":
            return softmax_ell_analytic_numerator(mean, samples, y).sum()
        return softmax_ell_monte_carlo(samples, y).sum()

    def elbo(self, x, y, num_data: Optional[int] = None, **objective_kwargs) -> torch.Tensor:
        """``(num_data / batch) * ELL - KL(A) - KL(B)``: unbiased minibatch ELBO."""
        batch = x.shape[0]
        scale = 1.0 if num_data is None else num_data / batch
        return scale * self.expected_log_likelihood(x, y, **objective_kwargs) - self.kl()
