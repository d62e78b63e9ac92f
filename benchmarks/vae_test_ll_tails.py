"""Where a VAE run's mean test log-likelihood comes from: per test point, for each variant.

    python benchmarks/vae_test_ll_tails.py outputs/table2_fm/rows20000/0 [more run dirs]

For each finished ``cfbnn vae`` run dir (its config and ``checkpoints/<variant>/best.pt``) it
rebuilds the split, scores every test point with the importance-weighted estimate (K=100, one
trial, the default reading) and prints per variant: the mean (the paper's measure), the
median, the worst point, how many points lie more than 1000 nats below the median, and the
mean without them; then the largest standardized test values. On per-pixel standardized
images, pixel columns that are nearly constant in the training rows (the border) give a test
image with ink there a value hundreds of standard deviations out, which a point-estimate
decoder scores far lower than a Bayesian predictive: the mean then weighs those few images.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from omegaconf import OmegaConf

from cfbnn_cli.data.unsupervised import load_unsupervised_data
from cfbnn_cli.pipelines.vae import _build


@torch.no_grad()
def per_point(run_dir: str, variant: str, cfg, data, inner_samples: int = 100) -> np.ndarray:
    model = _build(cfg, data.dim, variant, torch.Generator().manual_seed(0))
    state = torch.load(f"{run_dir}/checkpoints/{variant}/best.pt", weights_only=True)
    model.load_state_dict(state["model"])
    model.eval()
    generator = torch.Generator().manual_seed(0)
    chunks = [
        model.importance_weighted_log_likelihood(data.x_test[i : i + 200], inner_samples, generator)
        for i in range(0, len(data.x_test), 200)
    ]
    return (torch.cat(chunks) - data.log_scale).numpy()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for run_dir in args.runs:
        cfg = OmegaConf.load(f"{run_dir}/.hydra/config.yaml")
        data = load_unsupervised_data(cfg.data)
        print(f"{run_dir} ({cfg.data.name}, {len(data.x_test)} test points)")
        for variant in ("v1", "v2", "v3"):
            values = per_point(run_dir, variant, cfg, data)
            median = float(np.median(values))
            far = values < median - 1000
            print(
                f"  {variant}: mean {values.mean():8.1f}  median {median:7.1f}  worst {values.min():11.1f}  "
                f"{int(far.sum()):4d} points > 1000 below the median  mean without them {values[~far].mean():7.1f}"
            )
        largest = torch.topk(data.x_test.abs().max(0).values, 3).values.tolist()
        print("  largest |standardized test value| of a column:", ", ".join(f"{v:.0f}" for v in largest))


if __name__ == "__main__":
    main()
