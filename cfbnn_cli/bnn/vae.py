"""A VAE whose decoder is Bayesian and (in part or entirely) integrated in closed form.

Paper "VAE with a Bayesian Decoder" (Table 2). Encoder: a deterministic
``D - 500 - 500 - 2 x latent`` ReLU network giving ``q(z|x) = N(mu(x), diag sigma(x)^2)``.
Decoder: one hidden layer ``latent - 500 - D`` (ReLU), Normal likelihood with a
learned precision ``beta``. Three variants:

* ``v1``: point-estimate decoder weights (an ordinary VAE); only ``z`` is sampled;
* ``v2``: mean-field Normal ``q(W)`` on both decoder matrices; the pre-activations of
  the first sampled by local reparameterization, the output layer integrated in
  closed form given them (estimator ``integrate_output_layer``);
* ``v3``: the same ``q(W)``; given ``z`` the decoder's expected log-likelihood is the
  one-hidden-layer closed form -- no weight is sampled, only ``z``.

The training objective (all variants) is the ELBO
``sum_n E_q[log p(x_n | z_n, W)] - KL(q(z_n|x_n) || N(0, I)) - KL(q(W) || p(W))``,
with the weight KL counted once per data set (``num_data / batch`` scaling of the rest).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import nn

from .estimators import ClosedForm, IntegrateOutputLayer
from .functional import augment
from .likelihoods import NormalLikelihood
from .network import BayesianNetwork

VARIANTS = {
    "v1": {"bayesian": False, "estimator": ClosedForm(), "sampled": "z"},
    "v2": {
        "bayesian": True,
        "estimator": IntegrateOutputLayer(),
        "sampled": "z, first decoder layer (local reparam.)",
    },
    "v3": {"bayesian": True, "estimator": ClosedForm(), "sampled": "z only"},
}
# how a test likelihood treats V2's and V3's decoder weights: drawn from q(W) jointly with each z
# inside the importance weights, or fixed at their posterior means (see importance_weighted_log_likelihood)
DECODER_WEIGHT_READINGS = ("sampled", "posterior_mean")
_LOG_2PI = math.log(2 * math.pi)


def _standard_normal_log_density(z):
    return -0.5 * (z.square() + _LOG_2PI).sum(-1)


class BayesianDecoderVAE(nn.Module):
    def __init__(
        self,
        data_dim: int,
        latent_dim: int = 30,
        encoder_hidden: Sequence[int] = (500, 500),
        decoder_hidden: int = 500,
        variant: str = "v3",
        activation="relu",
        prior_scale: float = 1.0,
        init_scale: float = 1e-2,
        precision: float = 1.0,
        generator: Optional[torch.Generator] = None,
    ):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"`variant` must be one of {list(VARIANTS)}; got {variant!r}")
        for name, value in (("data_dim", data_dim), ("latent_dim", latent_dim), ("decoder_hidden", decoder_hidden)):
            if int(value) < 1:
                raise ValueError(f"`{name}` must be >= 1; got {value}")
        self.variant = variant
        self.data_dim, self.latent_dim = int(data_dim), int(latent_dim)
        widths = [self.data_dim] + [int(h) for h in encoder_hidden]
        layers = []
        for inp, out in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(inp, out), nn.ReLU()]
        self.encoder = nn.Sequential(*layers, nn.Linear(widths[-1], 2 * self.latent_dim))
        # one network for every variant: V1's decoder is all point layers, V2/V3's all Gaussian
        self.decoder = BayesianNetwork(
            self.latent_dim,
            [decoder_hidden],
            self.data_dim,
            activation,
            prior_scale=prior_scale,
            init_scale=init_scale,
            likelihood=NormalLikelihood(precision, learn=True),
            point_layers=0 if VARIANTS[variant]["bayesian"] else 2,
            generator=generator,
        )

    @property
    def bayesian(self) -> bool:
        return VARIANTS[self.variant]["bayesian"]

    def encode(self, x):
        """``(mu, sigma)`` of ``q(z|x)``, each ``(N, latent)``."""
        mu, pre_sigma = self.encoder(x).chunk(2, dim=-1)
        return mu, nn.functional.softplus(pre_sigma) + 1e-5

    @property
    def precision(self) -> torch.Tensor:
        return self.decoder.likelihood.precision

    def weight_kl(self) -> torch.Tensor:
        """``KL(q(W) || p(W))`` of the decoder (0 for V1's point estimates)."""
        return self.decoder.kl()

    def _decoder_noise(self, z, estimator, generator):
        return self.decoder.sample_noise(z.shape[-2], estimator=estimator, generator=generator, lead=z.shape[:-2])

    def decoder_expected_log_likelihood(self, z, x, generator=None):
        """``E_q(W)[log p(x_n | z_n, W)]`` per data point ``(..., N)`` for given ``z`` ``(..., N, latent)``.

        Exact over the decoder weights for ``v3``; a one-sample (first layer)
        estimate with the output layer exact for ``v2``; ``log p(x|z)`` for ``v1``.
        """
        estimator = VARIANTS[self.variant]["estimator"]
        noise = self._decoder_noise(z, estimator, generator)
        return self.decoder.expected_log_likelihood_per_point(z, x, estimator=estimator, noise=noise)

    def elbo_terms_per_point(self, x, generator=None):
        """The two per-point terms of the ELBO, ``(ell, kl_z)``, each ``(N,)``: a one-sample
        estimate of ``E_q[log p(x_n | z, W)]`` (over ``z``; over ``W`` as in
        :meth:`decoder_expected_log_likelihood`) and ``KL(q(z|x_n) || N(0, I))`` (exact).
        The ELBO of the data set is ``sum_n (ell_n - kl_z_n) - KL(q(W) || p(W))``
        (:meth:`weight_kl`)."""
        mu, sigma = self.encode(x)
        z = mu + sigma * torch.randn(mu.shape, generator=generator, dtype=mu.dtype, device=mu.device)
        kl_z = 0.5 * (mu.square() + sigma.square() - 1.0).sum(-1) - torch.log(sigma).sum(-1)
        return self.decoder_expected_log_likelihood(z, x, generator), kl_z

    def elbo_per_point(self, x, generator=None):
        """One-sample ``E_q[log p(x_n | z, W)] - KL(q(z|x_n) || p(z))`` per data point ``(N,)``."""
        ell, kl_z = self.elbo_terms_per_point(x, generator)
        return ell - kl_z

    def elbo(self, x, num_data: int, generator=None) -> torch.Tensor:
        """Minibatch ELBO of the whole data set: ``num_data * mean_n(elbo_n) - KL(q(W) || p(W))``."""
        return num_data * self.elbo_per_point(x, generator).mean() - self.weight_kl()

    def _posterior_mean_decoder(self, z):
        """The decoder's output mean with every weight at its posterior mean ``E_q[W]``
        (``(..., N, D)``): the plug-in network, as V1 uses its point estimates."""
        h = z
        for index, layer in enumerate(self.decoder.layers):
            h = (augment(h) if layer.bias else h) @ layer.loc.transpose(-1, -2)
            if index < len(self.decoder.layers) - 1:
                h = self.decoder.activation(h)
        return h

    @torch.no_grad()
    def importance_weighted_log_likelihood(
        self, x, inner_samples: int, generator=None, decoder_weights: str = "sampled"
    ) -> torch.Tensor:
        """One trial of the importance-weighted estimate of ``log p(x_n)`` per point ``(N,)``.

        ``log (1/K) sum_k p(x | z_k, W_k) p(z_k) / q(z_k | x)`` with ``z_k ~ q(z|x)``
        and, for v2/v3, the decoder weights drawn jointly with each ``z_k`` from
        ``q(W)`` -- the first layer's pre-activations by local reparameterization (exact
        in distribution for one point) and the output layer integrated *exactly*:
        given the hidden activations ``h`` the outputs are independent Normals,
        ``x_d ~ N(B0_d h, sum_j s_dj^2 h_j^2 + 1/beta)``. So for v2/v3 it estimates
        ``log int p(x|z,W) p(z) q(W) dz dW`` (the log-likelihood under the posterior
        predictive of the decoder), and for v1 ``log int p(x|z) p(z) dz``. Its
        expectation is a lower bound that rises with K to the true value (IWAE).
        The K samples are one batched computation (no loop over them).

        ``decoder_weights="posterior_mean"`` is the other reading of a Bayesian decoder's
        test likelihood: the weights fixed at their posterior means, ``log int p(x|z, E_q[W])
        p(z) dz`` (no weight uncertainty; for v1 the two readings coincide).
        """
        if decoder_weights not in DECODER_WEIGHT_READINGS:
            raise ValueError(f"`decoder_weights` must be one of {DECODER_WEIGHT_READINGS}; got {decoder_weights!r}")
        mu, sigma = self.encode(x)
        eps = torch.randn((inner_samples,) + mu.shape, generator=generator, dtype=mu.dtype, device=mu.device)
        z = mu + sigma * eps  # (K, N, latent)
        log_q = (-0.5 * (eps.square() + _LOG_2PI) - torch.log(sigma)).sum(-1)
        if decoder_weights == "posterior_mean" and self.bayesian:
            mean, variance = self._posterior_mean_decoder(z), torch.zeros((), dtype=z.dtype, device=z.device)
        else:
            estimator = IntegrateOutputLayer()
            mean, variance = self.decoder.output_moments(
                z, estimator=estimator, noise=self._decoder_noise(z, estimator, generator)
            )
        log_px = self.decoder.likelihood.log_predictive_density(x, mean, variance).sum(-1)
        log_weights = log_px + _standard_normal_log_density(z) - log_q
        return torch.logsumexp(log_weights, 0) - math.log(inner_samples)
