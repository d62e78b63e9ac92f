"""pipelines/imagenet: features and their cache, the head, MC vs deterministic prediction, outputs, errors."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from cfbnn_cli.bnn.network import bayesian_head
from cfbnn_cli.pipelines import imagenet as pipeline
from cfbnn_cli.pipelines.imagenet import expected_calibration_error, monte_carlo_accuracy, top_k_correct
from cfbnn_cli.report.numbers import split_mean_se
from cfbnn_cli.runtime.errors import ConfigError, DataError


def test_top_k_correct_on_hand_built_scores():
    scores = torch.tensor([[0.1, 0.5, 0.2, 0.9, 0.0, 0.3], [3.0, 2.0, 1.0, 0.0, -1.0, -2.0]])
    labels = torch.tensor([1, 5])
    assert top_k_correct(scores, labels, 1).tolist() == [False, False]
    assert top_k_correct(scores, labels, 2).tolist() == [True, False]  # row 0: top-2 = {3, 1}
    assert top_k_correct(scores, labels, 5).tolist() == [True, False]  # row 1: class 5 is the lowest of 6
    assert top_k_correct(scores, labels, 6).tolist() == [True, True]
    assert top_k_correct(scores[:, :3], torch.tensor([2, 2]), 5).tolist() == [True, True]  # k beyond the classes


def test_expected_calibration_error_hand_built():
    # two confident-and-right rows (0.9 -> acc 1) and two 0.6-confident rows half right
    probabilities = torch.tensor([[0.9, 0.1], [0.9, 0.1], [0.6, 0.4], [0.6, 0.4]])
    labels = torch.tensor([0, 0, 0, 1])
    expected = 0.5 * abs(1.0 - 0.9) + 0.5 * abs(0.5 - 0.6)
    assert expected_calibration_error(probabilities, labels) == pytest.approx(expected)


def _predictive_argmax(head, x, samples=16384, seed=9):
    """argmax of E_q[softmax(logits)], brute force with many samples (the limit MC converges to)."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(
        torch.softmax(head.sample_outputs(x, 1024, generator=generator), -1).sum(0) for _ in range(samples // 1024)
    )
    return total.argmax(-1)


@pytest.mark.slow  # the deterministic prediction as the Monte Carlo limit (below) runs by default
@torch.no_grad()
def test_monte_carlo_prediction_converges_with_n_inner():
    """Wide posterior: MC(N_inner) approaches the exact predictive's answer; its spread shrinks."""
    torch.manual_seed(0)
    head = bayesian_head(6, [16, 16], 5, init_scale=0.1).double()
    x = torch.randn(400, 6, dtype=torch.float64)
    reference = _predictive_argmax(head, x)
    agreement = monte_carlo_accuracy(head, x, reference, 1024, [1, 8, 64, 512], 200, torch.Generator().manual_seed(1))
    means = [float(agreement[n][0].mean()) for n in (1, 8, 64, 512)]
    spreads = [float(agreement[n][0].std()) for n in (1, 8, 64, 512)]
    assert means[0] < means[1] < means[2] < means[3]
    assert means[3] > 0.97 and means[0] < 0.9  # a real gap: the posterior is wide enough to matter
    assert spreads[0] > spreads[2] > spreads[3]


@torch.no_grad()
def test_deterministic_prediction_is_the_monte_carlo_limit_for_a_narrow_posterior():
    torch.manual_seed(0)
    head = bayesian_head(6, [16, 16], 5, init_scale=0.02).double()
    x = torch.randn(400, 6, dtype=torch.float64)
    deterministic = head.output_mean(x).argmax(-1)
    # 4,096 draws (6 s -> 1.5 s): one row of the 400 has a top-2 margin under 3 standard errors of
    # the brute force's mean (z = 1.6; 3.2 with 16,384), and the bound lets 4 rows differ
    assert float((deterministic == _predictive_argmax(head, x, samples=4096)).double().mean()) > 0.99
    agreement = monte_carlo_accuracy(head, x, deterministic, 512, [1, 512], 200, torch.Generator().manual_seed(2))
    assert float(agreement[512][0].mean()) > 0.99 and float(agreement[1][0].mean()) <= float(agreement[512][0].mean())


@pytest.mark.parametrize("objective", ["sampling", "approximation", "control_variate"])
def test_each_objective_trains_and_writes_the_figure_and_tables(tmp_path, objective, imagenet_cfg):
    # every training image (the demo's 100-image subset is too few for 3 epochs of this tiny head)
    timing = "evaluation.paper_head_timing=" + ("true" if objective == "sampling" else "false")
    result = pipeline.run(imagenet_cfg(f"objective={objective}", "data.train_size=null", timing), tmp_path / "run")
    run = tmp_path / "run"
    history = pd.read_csv(run / "metrics.csv")
    assert history["train_elbo_per_point"].iloc[-1] > history["train_elbo_per_point"].iloc[0]
    table = pd.read_csv(run / "prediction.csv")  # the numbers, one per column
    assert list(table["method"]) == ["monte_carlo"] * 4 + ["deterministic"]
    assert list(table["N_inner"].iloc[:4]) == [1, 4, 16, 64] and pd.isna(table["N_inner"].iloc[4])  # nothing sampled
    assert list(table["N_outer"].iloc[:4]) == [64, 16, 4, 1]
    m = result["metrics"]
    assert table["top1_mean"].iloc[4] == m["deterministic/top1"]
    for n, mean, sd in zip([1, 4, 16, 64], table["top1_mean"], table["top1_sd"]):
        assert mean == pytest.approx(m[f"monte_carlo/N{n}/top1_mean"])
        assert m[f"monte_carlo/N{n}/top3_mean"] >= m[f"monte_carlo/N{n}/top1_mean"]
        assert (sd == 0.0) == (n == 64)  # one outer trial: no spread
    formatted = [line for line in (run / "prediction.md").read_text().splitlines() if line.startswith("| Monte Carlo")]
    for line, n in zip(formatted, [1, 4, 16, 64]):  # the readable cells: mean ± s.e. over the outer trials, rounded
        cell = [c.strip() for c in line.strip("|").split("|")][3]
        top1, se = split_mean_se(cell)
        decimals = len(cell.split(" ")[0].split(".")[1])
        assert top1 == pytest.approx(m[f"monte_carlo/N{n}/top1_mean"], abs=0.51 * 10**-decimals)
        assert (se is None) == (n == 64)
    timing = pd.read_csv(run / "timing.csv")
    # this run's head, then (objective=sampling) a head of the paper's sizes: the paper's claim at its size
    paper = objective == "sampling"
    assert timing["ratio_to_deterministic"].iloc[0] == 1 and len(timing) == (10 if paper else 5)
    assert list(timing["head"]) == ["64-32-32-10 (this run's)"] * 5 + ["2048-1000-1000-1000 (paper size)"] * 5 * paper
    assert (timing["seconds_per_image"] > 0).all()
    if paper:
        assert m["paper_head/monte_carlo/N64/speed_ratio_mc_over_deterministic"] > 1  # 64 samples of 256 x 1000 logits
    markdown = (run / "prediction.md").read_text()
    assert markdown.count("| Monte Carlo ") == 4 and "('" not in markdown  # plain row labels, no tuples
    assert "\\pm" in (run / "prediction.tex").read_text() and "('" not in (run / "prediction.tex").read_text()
    assert (run / "prediction.png").read_bytes()[:4] == b"\x89PNG"
    assert result["figures"]["accuracy_against_time"] == "accuracy_against_time.png"  # accuracy against ms per image
    assert (run / "accuracy_against_time.png").read_bytes()[:4] == b"\x89PNG"
    assert m["deterministic/top1"] > 0.5  # digits: far above chance (0.1)
    assert m["deterministic/top3"] >= m["deterministic/top1"] and m["evaluation/top_k"] == 3
    assert m["calibration/variance_corrected/ece"] >= 0 and math.isfinite(m["calibration/variance_corrected/nll"])


def test_training_subset_is_class_balanced_and_seeded():
    from cfbnn_cli.data.images import training_subset

    labels = torch.as_tensor(np.repeat(np.arange(10), [50, 40, 30, 30, 30, 30, 30, 30, 30, 3]))
    rows = training_subset(labels, 100, seed=0)
    counts = np.bincount(labels[rows].numpy(), minlength=10)
    assert len(rows) == len(set(rows.tolist())) == 100
    assert counts[9] == 3 and set(counts[:9]) <= {10, 11}  # the small class gives all it has, the rest share
    assert np.array_equal(rows, training_subset(labels, 100, seed=0))
    assert not np.array_equal(rows, training_subset(labels, 100, seed=1))
    assert len(training_subset(labels, None, seed=0)) == len(labels)
    with pytest.raises(ConfigError, match="data.train_size=1000"):
        training_subset(labels, 1000, seed=0)


def test_top_k_must_be_below_the_number_of_classes(tmp_path, imagenet_cfg):
    with pytest.raises(ConfigError, match="evaluation.top_k=10 must be below the 10 classes"):
        pipeline.run(imagenet_cfg("evaluation.top_k=10"), tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_stages_reuse_each_other(tmp_path, monkeypatch, imagenet_cfg):
    run = tmp_path / "run"
    pipeline.run(imagenet_cfg("stage=features"), run)
    assert not (run / "checkpoints").exists()
    with pytest.raises(ConfigError, match="no trained head"):
        pipeline.run(imagenet_cfg("stage=evaluate"), run)
    from cfbnn_cli.pipelines.imagenet import features

    calls = []
    original = features.extract
    monkeypatch.setattr(features, "extract", lambda *a, **k: calls.append(1) or original(*a, **k))
    pipeline.run(imagenet_cfg("stage=train"), run)
    assert (run / "checkpoints" / "best.pt").exists() and not (run / "prediction.csv").exists()
    result = pipeline.run(imagenet_cfg("stage=evaluate"), run)
    assert (run / "prediction.csv").exists() and "deterministic/top1" in result["metrics"]
    assert len(list((tmp_path / "cache").iterdir())) == 1  # one feature cache, reused by every stage


def _fake_cfg(imagenet_cfg, *overrides):
    return imagenet_cfg(
        "data=fake",
        "backbone.name=resnet50",
        "features.shard_size=16",
        "features.batch_size=8",
        "data.n_train=40",
        "data.n_held_out=10",
        *overrides,
    )


def test_resnet50_features_shapes_cache_resume_and_rebuild(tmp_path, monkeypatch, imagenet_cfg):
    from cfbnn_cli.pipelines.imagenet import features

    torch.manual_seed(0)
    device = torch.device("cpu")
    cfg = _fake_cfg(imagenet_cfg)
    first = pipeline.compute_features(cfg, device)
    x, y, skipped = first["train"]
    assert x.shape == (40, 2048) and x.dtype == torch.float16 and y.shape == (40,) and skipped == 0
    folder = first["folder"]
    assert sorted(p.name for p in folder.glob("train_*.pt")) == ["train_00000.pt", "train_00001.pt", "train_00002.pt"]
    # resume: only the missing shard is computed again
    (folder / "train_00001.pt").unlink()
    seen = []
    original = torch.utils.data.DataLoader

    def counting_loader(dataset, *args, **kwargs):
        seen.append(len(dataset))
        return original(dataset, *args, **kwargs)

    monkeypatch.setattr(features, "DataLoader", counting_loader)
    again = pipeline.compute_features(cfg, device)
    assert seen == [16]
    torch.testing.assert_close(again["train"][0], x)
    # other preprocessing: another folder, rebuilt (never the cached features)
    other = pipeline.compute_features(_fake_cfg(imagenet_cfg, "data.image_size=48"), device)
    assert other["folder"] != folder and len(seen) > 1


def _image_folder(root, corrupt: bool):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for label in ("n01", "n02"):
            directory = root / split / label
            directory.mkdir(parents=True)
            for i in range(3):
                Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(directory / f"{i}.png")
    if corrupt:
        (root / "val" / "n02" / "broken.png").write_bytes(b"not an image")


def test_imagenet_layout_with_a_corrupt_image_is_skipped_and_counted(tmp_path, imagenet_cfg):
    _image_folder(tmp_path / "imagenet", corrupt=True)
    cfg = imagenet_cfg(
        "data=imagenet",
        f"data.root={tmp_path / 'imagenet'}",
        "backbone.name=resnet50",
        "data.image_size=32",
        "data.resize=36",
        "stage=features",
    )
    result = pipeline.run(cfg, tmp_path / "run")
    assert result["metrics"]["features/skipped_unreadable_images"] == 1
    assert result["metrics"]["features/train_images"] == 6 and result["metrics"]["features/held_out_images"] == 6


def test_missing_data_and_weights_name_what_to_put_where(tmp_path, monkeypatch, imagenet_cfg):
    with pytest.raises(DataError, match="ImageFolder layout"):
        pipeline.run(imagenet_cfg("data=imagenet", f"data.root={tmp_path / 'nowhere'}"), tmp_path / "run")
    with pytest.raises(DataError, match="backbone.weights=.*missing.pth: file not found"):
        pipeline.run(_fake_cfg(imagenet_cfg, f"backbone.weights={tmp_path / 'missing.pth'}"), tmp_path / "run")
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    with pytest.raises(DataError, match="resnet50-11ad3fa6.pth"):
        pipeline.run(_fake_cfg(imagenet_cfg, "backbone.weights=torchvision"), tmp_path / "run")
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        pipeline.run(imagenet_cfg("data=fashion_mnist", f"data.root={tmp_path / 'none'}"), tmp_path / "run")


def test_weights_from_a_local_file_are_loaded(tmp_path):
    from torchvision.models import resnet50

    from cfbnn_cli.pipelines.imagenet.features import build_backbone

    torch.manual_seed(3)
    reference = resnet50(weights=None)
    torch.save(reference.state_dict(), tmp_path / "resnet50.pth")
    model, description = build_backbone("resnet50", str(tmp_path / "resnet50.pth"), torch.device("cpu"))
    torch.testing.assert_close(model.conv1.weight, reference.conv1.weight)
    assert description["weights"].endswith("resnet50.pth")
    (tmp_path / "bad.pth").write_bytes(b"junk")
    with pytest.raises(DataError, match="not a torchvision ResNet50 state dict"):
        build_backbone("resnet50", str(tmp_path / "bad.pth"), torch.device("cpu"))


@pytest.mark.parametrize(
    "override, message",
    [
        ("evaluation.inner_samples=[1,3]", "these do not: \\[3\\]"),
        ("objective=exact", "objective='exact'"),
        ("stage=predict", "stage='predict'"),
        ("model.hidden_sizes=[10]", "two positive widths"),
        ("split.validation_fraction=1", "split.validation_fraction=1"),
        ("backbone.name=vit", "backbone.name='vit'"),
    ],
)
def test_bad_config_is_rejected_before_work(tmp_path, override, message, imagenet_cfg):
    with pytest.raises(ConfigError, match=message):
        pipeline.run(imagenet_cfg(override), tmp_path / "run")
    assert not (tmp_path / "cache").exists()


def test_head_training_resumes_from_its_last_checkpoint(tmp_path, interrupt_on_call, imagenet_cfg):
    """Stopped after epoch 2 and resumed with the same config: exactly the uninterrupted run."""
    cfg = imagenet_cfg("stage=train", "trainer.epochs=3")
    pipeline.run(cfg, tmp_path / "whole")
    reference = pd.read_csv(tmp_path / "whole" / "metrics.csv")
    from cfbnn_cli.pipelines.imagenet import pipeline as stages

    restore = interrupt_on_call(stages, "top_k_correct", 3)  # the validation accuracy, once per epoch
    with pytest.raises(KeyboardInterrupt):
        pipeline.run(cfg, tmp_path / "run")
    restore()
    pipeline.run(imagenet_cfg("stage=train", "trainer.epochs=3", "resume=true"), tmp_path / "run")
    after = pd.read_csv(tmp_path / "run" / "metrics.csv")
    assert list(after["epoch"]) == [1, 2, 3]
    pd.testing.assert_frame_equal(after.drop(columns="epoch_seconds"), reference.drop(columns="epoch_seconds"))
