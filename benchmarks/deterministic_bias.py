"""How far the deterministic moment propagation is from the network it approximates.

For random networks (weights' means from the init, posterior s.d. ``init_scale``, inputs
N(0, I)) and for networks trained under the deterministic estimator on diabetes, with
1-3 hidden layers of 50 ReLU units, compare against Monte Carlo of the exact model
(every layer sampled, ``--samples`` draws per point):

* the output mean: bias in units of the output's s.d. (mean over points of
  |propagated - MC| / sd, and the MC standard error in the same units);
* the output variance: relative bias (propagated / MC - 1), for the diagonal propagation
  (``deterministic``) and for the full covariance across units (``deterministic_full``);
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
from cfbnn_cli.bnn.network import BayesianNetwork
from cfbnn_cli.bnn.predictive import mixture_log_likelihood


def random_networks(depth: int, init_scale: float, seed: int = 0, points: int = 64, width: int = 50):
    """Random networks on N(0, I) inputs and N(0, 1) targets."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(points, 8, dtype=torch.float64, generator=generator)
    y = torch.randn(points, dtype=torch.float64, generator=generator)
    homoscedastic = BayesianNetwork(8, [width] * depth, 1, init_scale=init_scale, generator=generator).double()
    heteroscedastic = BayesianNetwork(
        8, [width] * depth, 2, init_scale=init_scale, generator=generator, likelihood=HeteroscedasticNormalLikelihood()
    ).double()
    return homoscedastic, heteroscedastic, x, y


def trained_networks(depth: int, iterations: int = 300, width: int = 50, points: int = 64):
    """Networks trained under the deterministic estimator (full-batch L-BFGS, ``iterations``
    at most) on scikit-learn's diabetes data (standardized); measured on 64 held-out rows."""
    from sklearn.datasets import load_diabetes

    from cfbnn_cli.train.full_batch import minimize_full_batch

    features, target = load_diabetes(return_X_y=True)
    x = torch.tensor((features - features.mean(0)) / features.std(0))
    y = torch.tensor((target - target.mean()) / target.std())
    train, test = slice(points, None), slice(0, points)
    generator = torch.Generator().manual_seed(0)
    networks = []
    for outputs, likelihood in ((1, None), (2, HeteroscedasticNormalLikelihood())):
        net = BayesianNetwork(
            x.shape[1], [width] * depth, outputs, init_scale=0.1, generator=generator, likelihood=likelihood
        ).double()
        num_data = len(y[train])
        minimize_full_batch(
            lambda: -net.elbo(x[train], y[train], num_data=num_data, estimator="deterministic") / num_data,
            net.parameters(),
            max_iterations=iterations,
        )
        networks.append(net)
    return networks[0], networks[1], x[test], y[test]


def measure(homoscedastic, heteroscedastic, x, y, samples: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed + 1)
    points = len(y)
    with torch.no_grad():
        mean, variance = homoscedastic.output_moments(x, estimator="deterministic", noise=())
        draws = torch.cat(
            [homoscedastic.sample_outputs(x, 10_000, generator=generator) for _ in range(samples // 10_000)]
        )
        sd = draws.std(0)
        mean_bias = ((mean - draws.mean(0)).abs() / sd).mean().item()
        mean_se = 1 / math.sqrt(len(draws))  # in units of sd
        variance_bias = (variance / draws.var(0) - 1).mean().item()
        _, full_variance = homoscedastic.output_moments(x, estimator="deterministic_full", noise=())
        full_variance_bias = (full_variance / draws.var(0) - 1).mean().item()
        ell = heteroscedastic.expected_log_likelihood_per_point(x, y, estimator="deterministic")
        pairs = torch.cat(
            [heteroscedastic.sample_outputs(x, 10_000, generator=generator) for _ in range(samples // 10_000)]
        )
        log_density = -0.5 * (
            math.log(2 * math.pi) + pairs[..., 1] + (y - pairs[..., 0]).square() * torch.exp(-pairs[..., 1])
        )
        ell_bias = (ell - log_density.mean(0)).mean().item()
        ell_se = (log_density.std(0) / math.sqrt(len(pairs))).square().mean().sqrt().item() / math.sqrt(points)
        predictive = mixture_log_likelihood(y, *heteroscedastic.predictive_components(x, estimator="deterministic"))
        monte_carlo = torch.logsumexp(log_density, 0) - math.log(len(pairs))
        predictive_bias = (predictive - monte_carlo).mean().item()
    return mean_bias, mean_se, variance_bias, full_variance_bias, ell_bias, ell_se, predictive_bias


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200_000)
    args = parser.parse_args()
    print(
        "| network | hidden layers | posterior s.d. | mean: mean abs bias / sd (MC s.e.) | variance: relative bias, "
        "diagonal | variance: relative bias, full covariance | heteroscedastic ELL bias, nats (MC s.e.) | "
        "heteroscedastic log predictive bias, nats |"
    )
    print("|---|---|---|---|---|---|---|---|")
    cases = [("random", depth, init_scale) for depth in (1, 2, 3) for init_scale in (0.02, 0.1, 0.3)]
    cases += [("trained on diabetes", depth, None) for depth in (1, 2, 3)]
    for kind, depth, init_scale in cases:
        networks = random_networks(depth, init_scale) if init_scale is not None else trained_networks(depth)
        mb, mse, vb, fvb, eb, ese, pb = measure(*networks, args.samples)
        # a wide log-variance makes E[exp(-l)] heavy-tailed: Monte Carlo then does not converge
        ell = f"{eb:+.4f} ({ese:.4f})" if ese < 0.1 else f"MC does not converge (s.e. {ese:.2g})"
        scale = init_scale if init_scale is not None else "learned"
        print(f"| {kind} | {depth} | {scale} | {mb:.4f} ({mse:.4f}) | {vb:+.3f} | {fvb:+.3f} | {ell} | {pb:+.4f} |")


if __name__ == "__main__":
    main()
