"""bnn/calibration.py: the predictive CDF of a Gaussian mixture against scipy's Normal CDF, and the
coverage of central intervals of a predictive that is calibrated by construction (Monte Carlo,
within three standard errors)."""

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

from cfbnn_cli.bnn.calibration import NOMINAL_LEVELS, central_coverage, coverage_curve, mixture_cdf


def test_the_mixture_cdf_is_the_weighted_normal_cdf():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(7, generator=g, dtype=torch.float64)
    means = torch.randn(3, 7, generator=g, dtype=torch.float64)
    variances = torch.rand(3, 7, generator=g, dtype=torch.float64) + 0.1
    weights = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)[:, None].expand(3, 7)
    expected = (norm.cdf(y.numpy(), means.numpy(), np.sqrt(variances.numpy())) * weights.numpy()).sum(0)
    torch.testing.assert_close(mixture_cdf(y, means, variances, weights.log()), torch.from_numpy(expected))
    equal = norm.cdf(y.numpy(), means.numpy(), np.sqrt(variances.numpy())).mean(0)
    torch.testing.assert_close(mixture_cdf(y, means, variances), torch.from_numpy(equal))


def test_a_calibrated_predictive_covers_each_level_within_three_standard_errors():
    g = torch.Generator().manual_seed(1)
    n = 20_000
    means = torch.randn(2, n, generator=g, dtype=torch.float64)
    variances = torch.rand(2, n, generator=g, dtype=torch.float64) + 0.5
    # targets drawn from the very mixture (equal weights): its PIT is uniform
    pick = torch.randint(0, 2, (n,), generator=g)
    y = means[pick, torch.arange(n)] + variances[pick, torch.arange(n)].sqrt() * torch.randn(
        n, generator=g, dtype=torch.float64
    )
    pit = mixture_cdf(y, means, variances)
    for level, share in coverage_curve(pit, NOMINAL_LEVELS):
        assert share == pytest.approx(level, abs=3 * math.sqrt(level * (1 - level) / n))
    # an overconfident predictive (variances a quarter of the truth) covers too little
    assert central_coverage(mixture_cdf(y, means, variances / 4), 0.9) < 0.8
