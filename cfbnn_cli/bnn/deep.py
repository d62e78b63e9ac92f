"""Deeper mean-field BNNs whose last two weight matrices are integrated in closed form.

The paper's "Variance Reduction" network is ``D - H1 - H2 - 1`` with ReLU and a
mean-field Normal ``q`` on every weight matrix (biases via augmented inputs); the
VAE's Bayesian decoder is ``latent - 500 - D`` (``output_dim = D``, independent
outputs). Three estimators of the same ELBO:

* ``sampling``: every layer by local reparameterization (pre-activations sampled);
* ``integrate_output_layer``: every layer but the output layer sampled; the output
  layer's weights integrated exactly given the sampled activations (paper VAE "v2");
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

ESTIMATORS = ("analytic", "integrate_output_layer", "sampling")
_SAMPLED_FROM_THE_END = {"analytic": 2, "integrate_output_layer": 1, "sampling": 0}


class MeanFieldMLP(LearnablePrecision):
    """``D -> H_1 -> ... -> H_L -> O`` with ``q(W_l) = N(loc, diag(exp(log_scale))^2)``.

    Outputs are ``(..., N)`` for ``output_dim = 1`` and ``(..., N, O)`` otherwise.
    """

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
        output_dim: int = 1,
    ):
        super().__init__(precision, learn_precision)
        if int(output_dim) < 1:
            raise ValueError(f"`output_dim` must be >= 1; got {output_dim}")
        self.output_dim = int(output_dim)
        hidden_sizes = list(hidden_sizes)
        if not hidden_sizes or any(int(h) < 1 for h in hidden_sizes):
            raise ValueError(f"`hidden_sizes` must be a non-empty list of positive widths; got {hidden_sizes}")
        if not prior_scale > 0:
            raise ValueError(f"`prior_scale` must be > 0; got {prior_scale!r}")
        self.activation = get_activation(activation)
        self.prior_scale = float(prior_scale)
        widths = [input_dim] + hidden_sizes + [self.output_dim]
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
        sampled = len(self.layers) - _SAMPLED_FROM_THE_END[estimator]
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
        """Mean and variance of the outputs given the noise of the sampled layers.

        ``(..., N)`` each for one output, ``(..., N, O)`` for several. ``sampling``: the
        final layer's local-reparameterization draw is part of ``noise``, so the
        variance is 0 and the mean is the sampled output. ``integrate_output_layer``:
        the variance is the output layer's weight uncertainty given the sampled
        activations.
        """
        _check_estimator(estimator)
        mean, variance = self._output_moments(x, estimator, noise)
        if self.output_dim == 1:
            return mean[..., 0], variance[..., 0]
        return mean, variance

    def _output_moments(self, x, estimator, noise):
        if estimator != "analytic":
            sampled_layers = self.layers[:-1]
            hidden = self._sample_through(x, sampled_layers, noise[: len(sampled_layers)])
            final = self.layers[-1]
            gamma, xi = preactivation_moments(augment(hidden), final.loc, final.scale())
            if estimator == "sampling":
                out = gamma + xi * noise[-1]
                return out, torch.zeros_like(out)
            return gamma, xi.square()
        hidden = self._sample_through(x, self.layers[:-2], noise)
        a, b = self.layers[-2], self.layers[-1]
        gamma, xi = preactivation_moments(augment(hidden), a.loc, a.scale())
        phi, _, variance = self.activation.moments(gamma, xi, return_variance=True)
        # the final layer's bias acts on a constant "hidden unit": Phi = 1, Var = 0
        phi = augment(phi)
        variance = torch.cat([variance, torch.zeros_like(variance[..., :1])], -1)
        mean, var_a, var_b = output_moments_given_hidden(phi, variance, b.loc, b.scale())
        return mean, var_a + var_b

    def expected_log_likelihood(self, x, y, estimator: str, noise=None, generator=None):
        """One-sample (or exact, for one hidden layer + analytic) estimate of the summed ELL.

        ``y`` is ``(N,)`` for one output, ``(N, O)`` for several; summed over both.
        """
        if noise is None:
            noise = self.sample_noise(x.shape[0], estimator, generator)
        mean, variance = self.output_moments(x, estimator, noise)
        return gaussian_log_likelihood(y, mean, variance, self.precision, data_dims=1 if self.output_dim == 1 else 2)

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
