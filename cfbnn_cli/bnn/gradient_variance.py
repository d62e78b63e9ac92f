"""Per-element Monte Carlo gradient variance, vectorized over samples with torch.func.

Paper Table 1 protocol: fix one minibatch, draw many single-sample gradients of the
negative ELBO, take the variance of every parameter element across draws and
average it over each tensor. On CUDA each chunk of draws is one CUDA graph
(:class:`~cfbnn_cli.runtime.cuda_graphs.GraphedCall`), so a chunk costs one launch.
"""

from __future__ import annotations

from typing import Dict

import torch
from torch.func import functional_call, grad, vmap

from ..moments import validate_args
from ..runtime import threads
from ..runtime.cuda_graphs import GraphedCall


def gradient_variance(
    model,
    x,
    y,
    num_data: int,
    estimator: str,
    num_samples: int,
    chunk_size: int = 25,
    generator=None,
    progress=None,
    cuda_graphs: bool = True,
) -> Dict[str, float]:
    """``{parameter name: mean over its elements of Var_samples[dL/dparam]}``.

    ``model`` is a :class:`cfbnn_cli.bnn.network.BayesianNetwork`. The KL term of the ELBO
    has a deterministic gradient (zero variance), so only the scaled expected
    log-likelihood is differentiated per draw. Draws are vectorized with
    ``vmap(grad(...))`` in chunks of ``chunk_size`` samples (the chunk loop bounds
    memory; it is not a loop over samples). Accumulation is in float64 around the
    first chunk's mean, so the variance does not cancel.
    """
    if num_samples < 2:
        raise ValueError(f"`num_samples` must be >= 2 to estimate a variance; got {num_samples}")
    params = {name: p.detach() for name, p in model.named_parameters()}
    if not model.noise_shapes(x.shape[0], estimator=estimator):
        # nothing is sampled (the deterministic estimator, or one hidden layer under "analytic"):
        # every draw is the same gradient, so its variance is exactly zero, not estimated
        if progress is not None:
            progress.update(num_samples)
        return {k: 0.0 for k in params}

    scale = num_data / x.shape[0]

    def negative_elbo(p, noise):  # without the KL: its gradient does not vary
        return -scale * functional_call(model, p, (x, y), {"estimator": estimator, "noise": noise})

    per_sample = vmap(grad(negative_elbo), in_dims=(None, 0))
    # the noise is drawn outside the graph (eagerly, one call); the draws' gradients inside it
    draws = GraphedCall(lambda *noise: per_sample(params, noise), x.device, label="gradient draws", enabled=cuda_graphs)
    shift = sums = squares = None
    drawn = 0
    while drawn < num_samples:
        threads.rebalance()  # share the cores with other cfbnn jobs (once a second at most)
        count = min(chunk_size, num_samples - drawn)
        noise = model.sample_noise(x.shape[0], estimator=estimator, generator=generator, num_samples=count)
        with validate_args(False):  # the argument checks would wait for the GPU inside the graph
            grads = {k: v.double() for k, v in draws(*noise).items()}
        if shift is None:
            shift = {k: g.mean(0) for k, g in grads.items()}
            sums = {k: torch.zeros_like(s) for k, s in shift.items()}
            squares = {k: torch.zeros_like(s) for k, s in shift.items()}
        for k, g in grads.items():
            centred = g - shift[k]
            sums[k] += centred.sum(0)
            squares[k] += centred.square().sum(0)
        drawn += count
        if progress is not None:
            progress.update(count)
    return {k: ((squares[k] - sums[k] ** 2 / drawn) / (drawn - 1)).clamp(min=0).mean().item() for k in params}
