"""`cfbnn vae`: the Bayesian-decoder VAE, its estimators against references, the pipeline."""

import gzip
import math
import struct

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from cfbnn_cli.bnn.vae import BayesianDecoderVAE
from cfbnn_cli.cli import config_dir
from cfbnn_cli.data.unsupervised import fashion_mnist_pixels, load_unsupervised_data, split_and_standardize
from cfbnn_cli.pipelines import vae as pipeline
from cfbnn_cli.runtime.errors import ConfigError, DataError
from cfbnn_cli.runtime.numerics import NonFiniteLossError

DT = torch.float64
TINY = [
    "data=synthetic", "data.input_dim=6", "data.n_train=250", "data.n_test=50", "model.encoder_hidden=[16,16]",
    "model.latent_dim=2", "model.decoder_hidden=12", "trainer.epochs=4", "trainer.batch_size=25", "trainer.lr=0.01",
    "evaluation.inner_samples=8", "evaluation.trials=3", "device=cpu",
]


def tiny_cfg(*overrides):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(config_name="vae", overrides=TINY + list(overrides))


def _model(variant, seed=0, **kwargs):
    torch.manual_seed(seed)
    sizes = dict(data_dim=4, latent_dim=3, encoder_hidden=[8], decoder_hidden=6, init_scale=0.3)
    sizes.update(kwargs)
    model = BayesianDecoderVAE(variant=variant, generator=torch.Generator().manual_seed(seed), **sizes).double()
    with torch.no_grad():
        model.log_precision.fill_(math.log(3.0))
    return model


def test_v3_decoder_ell_matches_monte_carlo_over_decoder_weights():
    """E_q(W)[log N(x | W2 relu(W1 [z,1]) + ..., 1/beta)] in closed form vs 2x10^5 weight draws."""
    model = _model("v3")
    g = torch.Generator().manual_seed(1)
    z = torch.randn(5, 3, generator=g, dtype=DT)
    x = torch.randn(5, 4, generator=g, dtype=DT)
    with torch.no_grad():
        exact = model.decoder_expected_log_likelihood(z, x)
        first, second = model.decoder.layers
        estimates = []
        for chunk in range(20):
            S = 10_000
            W1 = first.loc + first.scale() * torch.randn((S,) + first.loc.shape, generator=g, dtype=DT)
            W2 = second.loc + second.scale() * torch.randn((S,) + second.loc.shape, generator=g, dtype=DT)
            ones = torch.ones(5, 1, dtype=DT)
            hidden = torch.relu(torch.cat([z, ones], 1) @ W1.transpose(-1, -2))
            out = torch.cat([hidden, ones.expand(S, 5, 1)], -1) @ W2.transpose(-1, -2)
            estimates.append(torch.distributions.Normal(out, model.precision ** -0.5).log_prob(x).sum(-1))
        samples = torch.cat(estimates)
    mean = samples.mean(0)
    standard_error = samples.std(0) / math.sqrt(samples.shape[0])
    assert samples.shape[0] >= 100_000
    assert ((exact - mean).abs() / standard_error).max() < 4, (exact, mean, standard_error)


def test_v2_estimator_is_unbiased_for_the_v3_value():
    model3 = _model("v3")
    model2 = _model("v2")
    model2.load_state_dict(model3.state_dict())
    g = torch.Generator().manual_seed(2)
    z = torch.randn(5, 3, generator=g, dtype=DT)
    x = torch.randn(5, 4, generator=g, dtype=DT)
    with torch.no_grad():
        exact = model3.decoder_expected_log_likelihood(z, x)
        draws = model2.decoder_expected_log_likelihood(z.expand(100_000, 5, 3), x, g)
    z_score = (exact - draws.mean(0)).abs() / (draws.std(0) / math.sqrt(draws.shape[0]))
    assert z_score.max() < 4


def test_v1_importance_weighted_estimate_matches_brute_force_integration():
    """latent_dim = 1: log p(x) = log int N(x | f(z), 1/beta) N(z | 0, 1) dz by a dense grid."""
    model = _model("v1", latent_dim=1, seed=3)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(4), dtype=DT)
    with torch.no_grad():
        grid = torch.linspace(-12, 12, 40_001, dtype=DT).unsqueeze(-1)
        mean = model.decoder(grid)  # (G, 4)
        log_joint = torch.distributions.Normal(mean.unsqueeze(1), model.precision ** -0.5).log_prob(x).sum(-1) + (
            torch.distributions.Normal(0.0, 1.0).log_prob(grid)
        )  # (G, 3)
        brute_force = torch.logsumexp(log_joint, 0) + math.log(grid[1, 0] - grid[0, 0])
        g = torch.Generator().manual_seed(5)
        trials = torch.stack([model.importance_weighted_log_likelihood(x, 20_000, g) for _ in range(10)])
    estimate = trials.mean(0)
    standard_error = trials.std(0) / math.sqrt(trials.shape[0])
    assert ((estimate - brute_force).abs() <= 4 * standard_error + 2e-3).all(), (estimate, brute_force)


@pytest.mark.parametrize("variant", ["v1", "v2", "v3"])
def test_importance_weighted_bound_exceeds_elbo_and_increases_with_k(variant):
    model = _model(variant, seed=6)
    x = torch.randn(20, 4, generator=torch.Generator().manual_seed(7), dtype=DT)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        elbo = torch.stack([model.elbo_per_point(x, g) for _ in range(400)]).mean(0)  # E[ELBO_n], no weight KL
        by_k = {}
        for k in (1, 10, 100):
            trials = torch.stack([model.importance_weighted_log_likelihood(x, k, g) for _ in range(400)])
            by_k[k] = (trials.mean(), trials.mean(1).std() / math.sqrt(trials.shape[0]))
    assert by_k[1][0] >= elbo.mean() - 4 * by_k[1][1]
    assert by_k[10][0] > elbo.mean() + 4 * by_k[10][1]
    assert by_k[10][0] > by_k[1][0] and by_k[100][0] > by_k[10][0]


@pytest.mark.parametrize("variant", ["v1", "v2", "v3"])
def test_each_variant_trains_and_lowers_the_loss(tmp_path, variant):
    result = pipeline.run(tiny_cfg(f"variant={variant}"), tmp_path)
    history = pd.read_csv(tmp_path / "metrics.csv")
    assert list(history["epoch"]) == [1, 2, 3, 4] and set(history["variant"]) == {variant}
    assert history["train_elbo_per_point"].iloc[-1] > history["train_elbo_per_point"].iloc[0]
    assert math.isfinite(result["metrics"][f"vae/{variant}/test_ll"])
    assert (tmp_path / "checkpoints" / variant / "best.pt").exists()


def test_all_variants_write_the_table(tmp_path):
    result = pipeline.run(tiny_cfg("trainer.epochs=2"), tmp_path)
    table = pd.read_csv(tmp_path / "vae_results.csv", index_col=0)
    assert list(table.index) == ["V1", "V2", "V3"]
    assert list(table["Bayesian decoder"]) == ["no", "yes", "yes"]
    assert "±" in table.loc["V3", "Test LL"]
    assert "\\toprule" in (tmp_path / "vae_results.tex").read_text()
    assert (tmp_path / "vae_results.md").read_text().count("V2") == 1
    assert (tmp_path / "training.png").read_bytes()[:4] == b"\x89PNG"
    for variant in ("v1", "v2", "v3"):
        assert math.isfinite(result["metrics"][f"vae/{variant}/test_ll"])
        assert result["metrics"][f"vae/{variant}/best_epoch"] in (1, 2)


def test_resume_continues_from_the_last_checkpoint(tmp_path, monkeypatch):
    """Stopped after epoch 2 and resumed with the same config: exactly the uninterrupted run."""
    cfg = tiny_cfg("variant=v3", "trainer.epochs=3")
    pipeline.run(cfg, tmp_path / "whole")
    reference = pd.read_csv(tmp_path / "whole" / "metrics.csv")
    original, calls = pipeline.mean_elbo_per_point, {"n": 0}

    def stop_after_epoch_2(*args, **kwargs):  # the validation ELBO, once per epoch
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(pipeline, "mean_elbo_per_point", stop_after_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run(cfg, tmp_path / "stopped")
    monkeypatch.setattr(pipeline, "mean_elbo_per_point", original)
    pipeline.run(tiny_cfg("variant=v3", "trainer.epochs=3", "resume=true"), tmp_path / "stopped")
    after = pd.read_csv(tmp_path / "stopped" / "metrics.csv")
    assert list(after["epoch"]) == [1, 2, 3]
    pd.testing.assert_frame_equal(after.drop(columns="epoch_seconds"), reference.drop(columns="epoch_seconds"))


def test_nan_stops_with_epoch_and_step_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    original, calls = BayesianDecoderVAE.elbo, {"n": 0}

    def nan_in_epoch_2(self, *args, **kwargs):  # 9 steps per epoch (the bar shows 0/9)
        calls["n"] += 1
        value = original(self, *args, **kwargs)
        return value * float("nan") if calls["n"] > 9 else value

    monkeypatch.setattr(BayesianDecoderVAE, "elbo", nan_in_epoch_2)
    with pytest.raises(NonFiniteLossError, match="epoch 2, step 0"):
        pipeline.run(tiny_cfg("variant=v1", "trainer.epochs=2"), tmp_path)
    kept = torch.load(tmp_path / "checkpoints" / "v1" / "last.pt", weights_only=True)
    assert kept["epoch"] == 1


@pytest.mark.parametrize(
    "override, message",
    [("variant=v4", "variant='v4'"), ("model.latent_dim=0", "model.latent_dim=0"),
     ("model.encoder_hidden=[]", "model.encoder_hidden"), ("trainer.batch_size=100000", "exceeds"),
     ("evaluation.inner_samples=0", "evaluation.inner_samples=0"), ("trainer.compile=maybe", "trainer.compile")],
)
def test_bad_config_is_rejected_before_training(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        pipeline.run(tiny_cfg(override), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_data_without_a_vae_loader_is_rejected():
    with pytest.raises(ConfigError, match="data.name='csv' is not one of digits"):
        load_unsupervised_data({"name": "csv"}, seed=0)


def test_split_is_seven_two_one_and_standardized_by_train():
    x = np.random.default_rng(0).normal(3.0, 2.0, size=(1000, 5))
    data = split_and_standardize("x", x, seed=0)
    assert (len(data.x_train), len(data.x_test), len(data.x_val)) == (700, 200, 100)
    torch.testing.assert_close(data.x_train.mean(0), torch.zeros(5), atol=1e-5, rtol=0)
    assert data.log_scale == pytest.approx(5 * math.log(2.0), abs=0.2)  # sum of log standard deviations


def _write_idx(path, magic, array):
    with gzip.open(path, "wb") as handle:
        handle.write(struct.pack(">I", magic) + b"".join(struct.pack(">I", n) for n in array.shape) + array.astype(np.uint8).tobytes())


def test_fashion_mnist_prepare_script_and_loader_on_small_local_files(tmp_path):
    import importlib.util
    from pathlib import Path

    source = tmp_path / "debian"
    source.mkdir()
    rng = np.random.default_rng(0)
    for split, count in (("train", 30), ("t10k", 10)):
        _write_idx(source / f"{split}-images-idx3-ubyte.gz", 2051, rng.integers(0, 256, (count, 28, 28)))
        _write_idx(source / f"{split}-labels-idx1-ubyte.gz", 2049, rng.integers(0, 10, (count,)))
    script = Path(__file__).resolve().parent.parent / "data_scripts" / "prepare_fashion_mnist.py"
    spec = importlib.util.spec_from_file_location("prepare_fashion_mnist", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    root = tmp_path / "fashion"
    with pytest.raises(SystemExit, match="t10k-images-idx3-ubyte.gz holds 10 items, expected 10000"):
        module.main(["--source", str(source), "--out", str(root)])
    assert module.main(["--source", str(source), "--out", str(root), "--allow-subset"]) == 0
    pixels = fashion_mnist_pixels(root)
    assert pixels.shape == (40, 784) and 0 <= pixels.min() and pixels.max() <= 1
    data = load_unsupervised_data({"name": "fashion_mnist", "root": str(root)}, seed=0)
    assert data.dim == 784 and len(data.x_train) == 28
    from cfbnn_cli.data.images import load_image_datasets

    train, held_out, classes = load_image_datasets({"name": "fashion_mnist", "root": str(root)}, "identity")
    assert (len(train), len(held_out), classes) == (30, 10, 10)  # the package's train / test files
    image, label, ok = train[0]
    assert image.shape == (1, 28, 28) and 0 <= label < 10 and ok


def test_missing_fashion_mnist_names_the_install_step(tmp_path):
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist.*prepare_fashion_mnist.py"):
        load_unsupervised_data({"name": "fashion_mnist", "root": str(tmp_path / "nothing")}, seed=0)


def test_cli_sweep_over_variants_writes_one_result_per_variant(tmp_path):
    import json
    import subprocess
    import sys

    sweep = tmp_path / "sweep"
    args = [sys.executable, "-m", "cfbnn_cli.cli", "vae", "-m", "variant=v1,v2,v3", f"hydra.sweep.dir={sweep}",
            *TINY, "trainer.epochs=1"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    results = [json.loads((sweep / str(job) / "results.json").read_text()) for job in range(3)]
    assert [r["config"]["variant"] for r in results] == ["v1", "v2", "v3"]
    for result, variant in zip(results, ("v1", "v2", "v3")):
        assert math.isfinite(result["metrics"][f"vae/{variant}/test_ll"])
        assert (sweep / str(results.index(result)) / "done").exists()


@pytest.mark.slow
def test_compiled_objective_trains_like_the_eager_one(tmp_path):
    eager = pipeline.run(tiny_cfg("variant=v3", "trainer.epochs=1"), tmp_path / "eager")
    compiled = pipeline.run(tiny_cfg("variant=v3", "trainer.epochs=1", "trainer.compile=true"), tmp_path / "compiled")
    a = pd.read_csv(tmp_path / "eager" / "metrics.csv")["train_elbo_per_point"].iloc[0]
    b = pd.read_csv(tmp_path / "compiled" / "metrics.csv")["train_elbo_per_point"].iloc[0]
    assert b == pytest.approx(a, rel=1e-3)
    assert compiled["metrics"]["vae/v3/test_ll"] == pytest.approx(eager["metrics"]["vae/v3/test_ll"], rel=1e-2)
