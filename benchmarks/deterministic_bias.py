"""How far the deterministic moment propagation is from the network it approximates.

For random networks (weights' means from the init, posterior s.d. ``init_scale``, inputs
N(0, I)), and 1-3 hidden layers of 50 ReLU units, compare against Monte Carlo of the exact
model (every layer sampled, ``num_samples`` draws per point):

* the output mean: bias in units of the output's s.d. (mean over points of
  |propagated - MC| / sd, and the MC standard error in the same units);
* the output variance: relative bias (propagated / MC - 1);
* the heteroscedastic expected log-likelihood ``E[log N(y | m, e^l)]`` (2 outputs): bias
  in nats per point at y ~ N(0, 1), with its Monte Carlo s.e.;
* the heteroscedastic log predictive density ``log E[N(y | m, e^l)]``: bias in nats.

One hidden layer is exact for the first two (the paper's closed form); the
heteroscedastic terms assume (m, l) jointly Normal at every depth.

    python benchmarks/deterministic_bias.py [--samples 200000]

Prints a Markdown table (the README's "bias of the approximation" table).
"""

from __future__ import annotations

import argparse
import math

import torch

from cfbnn_cli.bnn.likelihoods import HeteroscedasticNormalLikelihood
from cfbnn_cli.bnn.network import BayesianNetwork, mixture_log_likelihood


def measure(depth: int, init_scale: float, samples: int, seed: int = 0, points: int = 64, width: int = 50):
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(points, 8, dtype=torch.float64, generator=generator)
    y = torch.randn(points, dtype=torch.float64, generator=generator)
    homoscedastic = BayesianNetwork(8, [width] * depth, 1, init_scale=init_scale, generator=generator).double()
    heteroscedastic = BayesianNetwork(8, [width] * depth, 2, init_scale=init_scale, generator=generator,
                                      likelihood=HeteroscedasticNormalLikelihood()).double()
    with torch.no_grad():
        mean, variance = homoscedastic.output_moments(x, "deterministic", ())
        draws = torch.cat([homoscedastic.sample_outputs(x, 10_000, generator) for _ in range(samples // 10_000)])
        sd = draws.std(0)
        mean_bias = ((mean - draws.mean(0)).abs() / sd).mean().item()
        mean_se = (1 / math.sqrt(len(draws)))  # in units of sd
        variance_bias = (variance / draws.var(0) - 1).mean().item()
        ell = heteroscedastic.expected_log_likelihood_per_point(x, y, "deterministic")
        pairs = torch.cat([heteroscedastic.sample_outputs(x, 10_000, generator) for _ in range(samples // 10_000)])
        log_density = -0.5 * (math.log(2 * math.pi) + pairs[..., 1] + (y - pairs[..., 0]).square() * torch.exp(-pairs[..., 1]))
        ell_bias = (ell - log_density.mean(0)).mean().item()
        ell_se = (log_density.std(0) / math.sqrt(len(pairs))).square().mean().sqrt().item() / math.sqrt(points)
        predictive = mixture_log_likelihood(y, *heteroscedastic.predictive_components(x, "deterministic"))
        monte_carlo = torch.logsumexp(log_density, 0) - math.log(len(pairs))
        predictive_bias = (predictive - monte_carlo).mean().item()
    return mean_bias, mean_se, variance_bias, ell_bias, ell_se, predictive_bias


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200_000)
    args = parser.parse_args()
    print("| hidden layers | posterior s.d. | mean: mean abs bias / sd (MC s.e.) | variance: relative bias | "
          "heteroscedastic ELL bias, nats (MC s.e.) | heteroscedastic log predictive bias, nats |")
    print("|---|---|---|---|---|---|")
    for depth in (1, 2, 3):
        for init_scale in (0.02, 0.1, 0.3):
            mb, mse, vb, eb, ese, pb = measure(depth, init_scale, args.samples)
            print(f"| {depth} | {init_scale} | {mb:.4f} ({mse:.4f}) | {vb:+.3f} | {eb:+.4f} ({ese:.4f}) | {pb:+.4f} |")


if __name__ == "__main__":
    main()
