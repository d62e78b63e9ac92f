"""The deep recipe's settings (train/fit_settings.py): the prior scale `auto`, and the first layer
trained on scaled inputs whose factor then goes into its weights exactly."""

import math

import pytest
import torch

from cfbnn_cli.bnn.network import BayesianNetwork
from cfbnn_cli.cli import compose_config
from cfbnn_cli.train.fit_settings import input_scale, prior_scale, scale_first_layer


@pytest.mark.parametrize("covariance", ["diagonal", "full", "lowrank"])
def test_the_first_layer_on_inputs_times_r_is_the_layer_scaled_by_r_on_the_inputs(covariance):
    """W (r x) = (r W) x in distribution: the means and the posterior's scale of the inputs' weights
    scaled by r give the same predictive for x as the unscaled layer for r x (the bias untouched)."""
    torch.manual_seed(0)
    network = BayesianNetwork(3, [6, 5], covariance=[covariance, "diagonal", "diagonal"], init_scale=0.3).double()
    with torch.no_grad():  # a posterior that is not diagonal in the first layer, where it may not be
        for name, value in network.named_parameters():
            if "off_diagonal" in name or "factor" in name:
                value.normal_(0.0, 0.2)
    x = torch.randn(8, 3, dtype=torch.float64)
    before = network.predict(x * 2.5, estimator="deterministic")
    scale_first_layer(network, 2.5)
    after = network.predict(x, estimator="deterministic")
    torch.testing.assert_close(after.mean, before.mean)
    torch.testing.assert_close(after.variance, before.variance)


def test_auto_keeps_n01_for_one_hidden_layer_and_scales_deeper_networks_by_their_width():
    cfg = compose_config("train_regression", ["data=csv", "data.path=x.csv", "data.target=y"])
    assert cfg.model.prior_scale == "auto"
    assert prior_scale(cfg, [50]) == 1.0 and input_scale(cfg, [50]) == 1.0
    assert prior_scale(cfg, [50, 20]) == pytest.approx(1 / math.sqrt(51))
    # the first layer's prior in the inputs' units: N(0, (input scale x prior scale)^2) = N(0, 1)
    assert input_scale(cfg, [50, 20]) * prior_scale(cfg, [50, 20]) == pytest.approx(1.0)
    fixed = compose_config(
        "train_regression", ["data=csv", "data.path=x.csv", "data.target=y", "model.prior_scale=0.5"]
    )
    assert prior_scale(fixed, [50, 50]) == 0.5 and input_scale(fixed, [50, 50]) == 1.0
