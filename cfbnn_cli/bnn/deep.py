"""Deeper mean-field BNNs whose last two weight matrices are integrated in closed form.

The paper's "Variance Reduction" network is ``D - H1 - H2 - 1`` with ReLU and a
mean-field Normal ``q`` on every weight matrix (biases via augmented inputs). Two
estimators of the same ELBO:

* ``sampling``: every layer by local reparameterization (pre-activations sampled);
* ``analytic``: the layers before the last hidden layer sampled by local
  reparameterization; the last two weight matrices integrated out exactly -- the
  one-hidden-layer closed form applied to the sampled activations (paper Sec. 4.1).

With a single hidden layer the ``analytic`` estimator samples nothing at all.

Noise is an explicit argument (a tuple of standard-normal tensors, see
:meth:`MeanFieldMLP.noise_shapes`) so that ``torch.func.vmap`` can draw many
gradient samples in one call.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from ..moments import get_activation
from .functional import gaussian_log_likelihood, output_moments_given_hidden, preactivation_moments
from .layers import GaussianMatrix, LearnablePrecision, augment

ESTIMATORS = ("analytic", "sampling")


class MeanFieldMLP(LearnablePrecision):
    """``D -> H_1 -> ... -> H_L -> 1`` with ``q(W_l) = N(loc, diag(exp(log_scale))^2)``."""

    def __init__(
        self,
        input_dim: int,
        hidden_sizes: Sequence[int],
        activation="relu",
        prior_scale: float = 1.0,
        init_scale: float = 1e-2,
        precision: float = 1.0,
        learn_precision: bool = True,
        generator: Optional[torch.Generator] = None,
    ):
        super().__init__(precision, learn_precision)
        hidden_sizes = list(hidden_sizes)
        if not hidden_sizes or any(int(h) < 1 for h in hidden_sizes):
            raise ValueError(f"`hidden_sizes` must be a non-empty list of positive widths; got {hidden_sizes}")
        if not prior_scale > 0:
            raise ValueError(f"`prior_scale` must be > 0; got {prior_scale!r}")
        self.activation = get_activation(activation)
        self.prior_scale = float(prior_scale)
        widths = [input_dim] + hidden_sizes + [1]
        self.layers = nn.ModuleList(
            GaussianMatrix(out, inp + 1, "diagonal", init_scale=init_scale, generator=generator)
            for inp, out in zip(widths[:-1], widths[1:])
        )

    def layer_names(self):
        names = ["first", "second", "third", "fourth", "fifth"]
        n = len(self.layers)
        return [names[i] if i < n - 1 else "final" for i in range(n)]

    def noise_shapes(self, batch: int, estimator: str) -> Tuple[Tuple[int, ...], ...]:
        """Shapes of the standard-normal noise one ELL evaluation consumes."""
        _check_estimator(estimator)
        sampled = len(self.layers) - (2 if estimator == "analytic" else 0)
        return tuple((batch, layer.loc.shape[0]) for layer in self.layers[:sampled])

    def sample_noise(self, batch: int, estimator: str, generator=None, num_samples: Optional[int] = None):
        lead = () if num_samples is None else (num_samples,)
        like = self.layers[0].loc
        return tuple(
            torch.randn(lead + shape, generator=generator, dtype=like.dtype, device=like.device)
            for shape in self.noise_shapes(batch, estimator)
        )

    def kl(self) -> torch.Tensor:
        return sum(layer.kl(self.prior_scale) for layer in self.layers)

    def _sample_through(self, h, layers, noise):
        for layer, eps in zip(layers, noise):
            gamma, xi = preactivation_moments(augment(h), layer.loc, layer.scale())
            h = self.activation(gamma + xi * eps)
        return h

    def output_moments(self, x, estimator: str, noise):
        """Mean and variance of the output given the noise of the sampled layers: ``(..., N)``.

        ``sampling``: the final layer's local-reparameterization draw is part of
        ``noise``, so the variance is 0 and the mean is the sampled output.
        """
        _check_estimator(estimator)
        if estimator == "sampling":
            hidden = self._sample_through(x, self.layers[:-1], noise[:-1])
            final = self.layers[-1]
            gamma, xi = preactivation_moments(augment(hidden), final.loc, final.scale())
            out = (gamma + xi * noise[-1])[..., 0]
            return out, torch.zeros_like(out)
        hidden = self._sample_through(x, self.layers[:-2], noise)
        a, b = self.layers[-2], self.layers[-1]
        gamma, xi = preactivation_moments(augment(hidden), a.loc, a.scale())
        phi, _, variance = self.activation.moments(gamma, xi, return_variance=True)
        # the final layer's bias acts on a constant "hidden unit": Phi = 1, Var = 0
        phi = augment(phi)
        variance = torch.cat([variance, torch.zeros_like(variance[..., :1])], -1)
        mean, var_a, var_b = output_moments_given_hidden(phi, variance, b.loc[0], b.scale()[0])
        return mean[..., 0], (var_a + var_b)[..., 0]

    def expected_log_likelihood(self, x, y, estimator: str, noise=None, generator=None):
        """One-sample (or exact, for one hidden layer + analytic) estimate of the summed ELL."""
        if noise is None:
            noise = self.sample_noise(x.shape[0], estimator, generator)
        mean, variance = self.output_moments(x, estimator, noise)
        return gaussian_log_likelihood(y, mean, variance, self.precision)

    def elbo(self, x, y, num_data: int, estimator: str, noise=None, generator=None):
        """``(num_data / batch) * ELL - KL``."""
        ell = self.expected_log_likelihood(x, y, estimator, noise, generator)
        return num_data / x.shape[0] * ell - self.kl()

    def forward(self, x, y, estimator: str, noise=None):
        """The summed ELL estimate (so that ``torch.func.functional_call`` can evaluate it)."""
        return self.expected_log_likelihood(x, y, estimator, noise)

    @torch.no_grad()
    def predict(self, x, num_samples: int = 32, generator=None, chunk: int = 8):
        """Predictive moments by the closed form over the last two layers.

        Returns ``(component_means, component_variances)``, each ``(S, N)``: the
        predictive is the equal mixture of ``N(mean_s, var_s + 1/beta)`` over ``S``
        samples of the earlier layers (``S = 1`` and exact for one hidden layer).
        """
        if len(self.layers) == 2:
            mean, variance = self.output_moments(x, "analytic", ())
            return mean.unsqueeze(0), variance.unsqueeze(0)
        return self._sampled_output_moments(x, "analytic", num_samples, generator, chunk)

    @torch.no_grad()
    def sample_outputs(self, x, num_samples: int = 32, generator=None, chunk: int = 8):
        """Monte Carlo outputs ``(S, N)`` with every layer sampled (local reparameterization)."""
        return self._sampled_output_moments(x, "sampling", num_samples, generator, chunk)[0]

    def _sampled_output_moments(self, x, estimator, num_samples, generator, chunk):
        """``output_moments`` for ``num_samples`` noise draws, ``chunk`` at a time: ``(S, N)`` each."""
        means, variances = [], []
        for start in range(0, num_samples, chunk):
            count = min(chunk, num_samples - start)
            noise = self.sample_noise(x.shape[0], estimator, generator, num_samples=count)
            mean, variance = self.output_moments(x.unsqueeze(0).expand(count, *x.shape), estimator, noise)
            means.append(mean)
            variances.append(variance)
        return torch.cat(means), torch.cat(variances)


def _check_estimator(estimator):
    if estimator not in ESTIMATORS:
        raise ValueError(f"`estimator` must be one of {ESTIMATORS}; got {estimator!r}")


def mixture_log_likelihood(y, means, variances):
    """``log (1/S) sum_s N(y | mean_s, var_s)`` per data point: ``(N,)``."""
    log_probs = -0.5 * ((y - means).square() / variances + torch.log(2 * math.pi * variances))
    return torch.logsumexp(log_probs, 0) - math.log(means.shape[0])
