"""pipelines/vae.py: `cfbnn vae` trains each variant, writes Table 2, resumes, rejects bad configs."""

import math

import pandas as pd
import pytest
import torch

from cfbnn_cli.bnn.vae import BayesianDecoderVAE
from cfbnn_cli.pipelines import vae as pipeline
from cfbnn_cli.runtime.errors import ConfigError
from cfbnn_cli.runtime.numerics import NonFiniteLossError


@pytest.mark.parametrize("variant", ["v1", "v2", "v3"])
def test_each_variant_trains_and_lowers_the_loss(tmp_path, variant, vae_cfg):
    result = pipeline.run(vae_cfg(f"variant={variant}"), tmp_path)
    history = pd.read_csv(tmp_path / "metrics.csv")
    assert list(history["epoch"]) == [1, 2, 3, 4] and set(history["variant"]) == {variant}
    assert history["train_elbo_per_point"].iloc[-1] > history["train_elbo_per_point"].iloc[0]
    assert math.isfinite(result["metrics"][f"vae/{variant}/test_ll"])
    assert (tmp_path / "checkpoints" / variant / "best.pt").exists()


def test_all_variants_write_the_table(tmp_path, vae_cfg):
    result = pipeline.run(vae_cfg("trainer.epochs=2"), tmp_path)
    table = pd.read_csv(tmp_path / "vae_results.csv", index_col="variant")  # the numbers, one per column
    assert list(table.index) == ["v1", "v2", "v3"]
    assert list(table["bayesian_decoder"]) == [False, True, True]
    assert (table["test_ll_se"] > 0).all() and (table["trials"] == 3).all()
    assert list(table["stopped"]) == ["cap"] * 3 and list(table["epochs"]) == [2, 2, 2]
    assert "\\toprule" in (tmp_path / "vae_results.tex").read_text()
    markdown = (tmp_path / "vae_results.md").read_text()  # the formatted cells, to read
    assert markdown.count("| V2 ") == 1 and "±" in markdown and "Test LL (± s.e., 3 trials)" in markdown
    assert (tmp_path / "training.png").read_bytes()[:4] == b"\x89PNG"
    m = result["metrics"]
    for variant in ("v1", "v2", "v3"):
        assert math.isfinite(m[f"vae/{variant}/test_ll"])
        assert m[f"vae/{variant}/best_epoch"] in (1, 2) and m[f"vae/{variant}/epochs"] == 2
        # the ELBO's terms add up to it, and the table shows the same numbers
        assert m[f"vae/{variant}/test_elbo"] == pytest.approx(
            m[f"vae/{variant}/test_ell"] - m[f"vae/{variant}/test_kl_z"] - m[f"vae/{variant}/test_kl_w"]
        )
        assert table.loc[variant, "test_kl_z"] == m[f"vae/{variant}/test_kl_z"]
        assert m[f"vae/{variant}/test_kl_z"] > 0
    assert m["vae/v1/test_kl_w"] == 0  # a point-estimate decoder has no weight KL
    assert m["vae/v2/test_kl_w"] > 0 and m["vae/v3/test_kl_w"] > 0


def test_posterior_mean_reading_adds_a_column_and_metrics(tmp_path, vae_cfg):
    result = pipeline.run(vae_cfg("trainer.epochs=1", "evaluation.posterior_mean_reading=true"), tmp_path)
    m = result["metrics"]
    table = pd.read_csv(tmp_path / "vae_results.csv", index_col="variant")
    assert "Test LL, weights at posterior mean" in (tmp_path / "vae_results.md").read_text()
    assert table.loc["v3", "test_ll_posterior_mean"] == m["vae/v3/test_ll_posterior_mean"]
    assert m["vae/v1/test_ll_posterior_mean"] == m["vae/v1/test_ll"]  # a point decoder: one reading
    for variant in ("v2", "v3"):
        assert math.isfinite(m[f"vae/{variant}/test_ll_posterior_mean"])
        assert m[f"vae/{variant}/test_ll_posterior_mean"] != m[f"vae/{variant}/test_ll"]
    without = pipeline.run(vae_cfg("trainer.epochs=1"), tmp_path / "plain")
    assert not any("posterior_mean" in key for key in without["metrics"])


def test_training_stops_when_the_validation_elbo_stops_improving(tmp_path, monkeypatch, vae_cfg):
    """Validation ELBO 1, 2, 3 (best), then lower for `patience` = 3 epochs: training stops
    after epoch 6 of a cap of 20, keeps epoch 3, and a resumed finished run trains no more."""
    scripted = iter([1.0, 2.0, 3.0, 2.5, 2.9, 2.8] + [0.0] * 20)
    monkeypatch.setattr(pipeline, "mean_elbo_per_point", lambda *args, **kwargs: next(scripted))
    result = pipeline.run(vae_cfg("variant=v1", "trainer.epochs=20", "trainer.patience=3"), tmp_path)
    history = pd.read_csv(tmp_path / "metrics.csv")
    assert list(history["epoch"]) == [1, 2, 3, 4, 5, 6]
    assert result["metrics"]["vae/v1/best_epoch"] == 3 and result["metrics"]["vae/v1/epochs"] == 6
    table = pd.read_csv(tmp_path / "vae_results.csv", index_col="variant")
    assert table.loc["v1", "epochs"] == 6 and table.loc["v1", "stopped"] == "patience"
    assert table.loc["v1", "best_epoch"] == 3 and table.loc["v1", "patience"] == 3
    assert "6 (stopped: no gain in 3)" in (tmp_path / "vae_results.md").read_text()
    assert torch.load(tmp_path / "checkpoints" / "v1" / "best.pt", weights_only=True)["epoch"] == 3
    again = pipeline.run(vae_cfg("variant=v1", "trainer.epochs=20", "trainer.patience=3", "resume=true"), tmp_path)
    assert list(pd.read_csv(tmp_path / "metrics.csv")["epoch"]) == [1, 2, 3, 4, 5, 6]
    assert again["metrics"]["vae/v1/epochs"] == 6


def test_resume_continues_from_the_last_checkpoint(tmp_path, interrupt_on_call, vae_cfg):
    """Stopped after epoch 2 and resumed with the same config: exactly the uninterrupted run."""
    cfg = vae_cfg("variant=v3", "trainer.epochs=3")
    pipeline.run(cfg, tmp_path / "whole")
    reference = pd.read_csv(tmp_path / "whole" / "metrics.csv")
    restore = interrupt_on_call(pipeline, "mean_elbo_per_point", 3)  # the validation ELBO, once per epoch
    with pytest.raises(KeyboardInterrupt):
        pipeline.run(cfg, tmp_path / "stopped")
    restore()
    pipeline.run(vae_cfg("variant=v3", "trainer.epochs=3", "resume=true"), tmp_path / "stopped")
    after = pd.read_csv(tmp_path / "stopped" / "metrics.csv")
    assert list(after["epoch"]) == [1, 2, 3]
    pd.testing.assert_frame_equal(after.drop(columns="epoch_seconds"), reference.drop(columns="epoch_seconds"))


def test_nan_stops_with_epoch_and_step_and_keeps_the_checkpoint(tmp_path, monkeypatch, vae_cfg):
    original, calls = BayesianDecoderVAE.elbo, {"n": 0}

    def nan_in_epoch_2(self, *args, **kwargs):  # 9 steps per epoch (the bar shows 0/9)
        calls["n"] += 1
        value = original(self, *args, **kwargs)
        return value * float("nan") if calls["n"] > 9 else value

    monkeypatch.setattr(BayesianDecoderVAE, "elbo", nan_in_epoch_2)
    with pytest.raises(NonFiniteLossError, match="epoch 2, step 0"):
        pipeline.run(vae_cfg("variant=v1", "trainer.epochs=2"), tmp_path)
    kept = torch.load(tmp_path / "checkpoints" / "v1" / "last.pt", weights_only=True)
    assert kept["epoch"] == 1


def test_the_principal_component_stand_in_trains_and_reports_the_variance_kept(tmp_path, vae_cfg):
    import struct

    import numpy as np

    raw = tmp_path / "fashion" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, count in (("train", 100), ("t10k", 20)):
        images = rng.integers(0, 256, (count, 28, 28)).astype(np.uint8)
        for kind, magic, array in (("images-idx3", 2051, images), ("labels-idx1", 2049, np.zeros(count, np.uint8))):
            header = struct.pack(">I", magic) + b"".join(struct.pack(">I", n) for n in array.shape)
            (raw / f"{name}-{kind}-ubyte").write_bytes(header + array.tobytes())
    cfg = vae_cfg(
        "data=fashion_mnist_pca90", f"data.root={tmp_path / 'fashion'}", "data.components=7", "trainer.epochs=1"
    )
    result = pipeline.run(cfg, tmp_path / "run")
    kept = result["metrics"]["data/pca_variance_kept"]
    # 7 of 784 directions of 84 rows of independent uniform pixels: a little more than 7/83 of the variance
    assert 7 / 83 < kept < 0.2
    assert math.isfinite(result["metrics"]["vae/v3/test_ll"])
    assert "84 training rows, 24 test rows, 7 dims" in (tmp_path / "run" / "vae_results.md").read_text()


@pytest.mark.parametrize(
    "override, message",
    [
        ("variant=v4", "variant='v4'"),
        ("model.latent_dim=0", "model.latent_dim=0"),
        ("model.encoder_hidden=[]", "model.encoder_hidden"),
        ("trainer.batch_size=100000", "exceeds"),
        ("evaluation.inner_samples=0", "evaluation.inner_samples=0"),
        ("trainer.compile=maybe", "trainer.compile"),
        ("trainer.patience=0", "trainer.patience"),
        ("+data.std_floor=wide", "data.std_floor='wide' must be pooled, a positive number"),
        ("+data.std_floor=-0.1", "data.std_floor=-0.1 must be pooled, a positive number"),
        ("+data.components=0", "data.components=0"),
    ],
)
def test_bad_config_is_rejected_before_training(tmp_path, override, message, vae_cfg):
    with pytest.raises(ConfigError, match=message):
        pipeline.run(vae_cfg(override), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_cli_sweep_over_variants_writes_one_result_per_variant(tmp_path, cfbnn, tiny_overrides):
    import json

    sweep = tmp_path / "sweep"
    out = cfbnn("vae", "-m", "variant=v1,v2,v3", f"hydra.sweep.dir={sweep}", *tiny_overrides["vae"], "trainer.epochs=1")
    assert out.returncode == 0, out.stderr[-2000:]
    results = [json.loads((sweep / str(job) / "results.json").read_text()) for job in range(3)]
    assert [r["config"]["variant"] for r in results] == ["v1", "v2", "v3"]
    for job, (result, variant) in enumerate(zip(results, ("v1", "v2", "v3"))):
        assert math.isfinite(result["metrics"][f"vae/{variant}/test_ll"])
        assert (sweep / str(job) / "done").exists()


@pytest.mark.slow
def test_compiled_objective_trains_like_the_eager_one(tmp_path, vae_cfg):
    eager = pipeline.run(vae_cfg("variant=v3", "trainer.epochs=1"), tmp_path / "eager")
    compiled = pipeline.run(vae_cfg("variant=v3", "trainer.epochs=1", "trainer.compile=true"), tmp_path / "compiled")
    a = pd.read_csv(tmp_path / "eager" / "metrics.csv")["train_elbo_per_point"].iloc[0]
    b = pd.read_csv(tmp_path / "compiled" / "metrics.csv")["train_elbo_per_point"].iloc[0]
    assert b == pytest.approx(a, rel=1e-3)
    assert compiled["metrics"]["vae/v3/test_ll"] == pytest.approx(eager["metrics"]["vae/v3/test_ll"], rel=1e-2)
