"""The same numbers on CUDA as on CPU; the pipeline end to end with ``device=cuda``.

Skipped cleanly where CUDA is absent (CI); run on a GPU machine with
``python -m pytest tests/test_cuda.py``.
"""

import pytest
import torch

from cfbnn_cli.bnn import BayesianNetwork, ClosedFormBNN, bayesian_head
from cfbnn_cli.bnn.gradient_variance import gradient_variance

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FAKE = [
    "data=fake",
    "backbone.name=resnet50",
    "features.shard_size=16",
    "features.batch_size=8",
    "data.n_train=40",
    "data.n_held_out=10",
]


def _copy_to(module, device):
    import copy

    return copy.deepcopy(module).to(device)


@pytest.mark.parametrize("covariance", ["diagonal", "full", "lowrank"])
def test_closed_form_elbo_predictive_and_gradients_match_cpu(covariance):
    g = torch.Generator().manual_seed(0)
    cpu = ClosedFormBNN(6, 12, a_covariance=covariance, rank=3, generator=g).double()
    gpu = _copy_to(cpu, "cuda")
    x = torch.randn(40, 6, generator=g, dtype=torch.float64)
    y = torch.randn(40, generator=g, dtype=torch.float64)
    elbo_cpu = cpu.elbo(x, y, num_data=400)
    elbo_gpu = gpu.elbo(x.cuda(), y.cuda(), num_data=400)
    torch.testing.assert_close(elbo_gpu.cpu(), elbo_cpu, rtol=1e-10, atol=1e-8)
    elbo_cpu.backward()
    elbo_gpu.backward()
    for (name, p_cpu), p_gpu in zip(cpu.named_parameters(), gpu.parameters()):
        torch.testing.assert_close(p_gpu.grad.cpu(), p_cpu.grad, rtol=1e-8, atol=1e-10, msg=name)
    for a, b in zip(cpu.predictive(x), gpu.predictive(x.cuda())):  # mean, var_A, var_B, noise
        torch.testing.assert_close(b.cpu(), a, rtol=1e-10, atol=1e-12)


def test_float32_closed_form_on_cuda_is_close_to_float64():
    g = torch.Generator().manual_seed(1)
    model = ClosedFormBNN(20, 50, generator=g).double()
    x = torch.randn(500, 20, generator=g, dtype=torch.float64)
    y = torch.randn(500, generator=g, dtype=torch.float64)
    reference = model.elbo(x, y, num_data=5000)
    single = _copy_to(model, "cuda").float().elbo(x.float().cuda(), y.float().cuda(), num_data=5000)
    assert abs(single.item() - reference.item()) < 1e-4 * abs(reference.item())


def test_deep_model_and_vectorized_gradient_variance_run_on_cuda():
    torch.manual_seed(0)
    model = BayesianNetwork(8, [16, 16]).cuda()
    x = torch.randn(64, 8, device="cuda")
    y = torch.randn(64, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    variances = {
        estimator: gradient_variance(model, x, y, 640, estimator, 200, 100, generator)
        for estimator in ("analytic", "sampling")
    }
    for estimator in variances:
        assert all(torch.isfinite(torch.tensor(v)) and v >= 0 for v in variances[estimator].values())
    final_mean = "layers.2.loc"
    assert variances["analytic"][final_mean] < variances["sampling"][final_mean]
    means, component_variances, _ = model.predictive_components(x, num_samples=8, generator=generator)
    assert means.device.type == "cuda" and bool((component_variances > 0).all())


def test_the_gradient_draws_take_the_triton_kernels():
    """The draws run inside vmap(grad(...)): the tail node's vmap rule takes its Triton kernel there
    (counted by tests/kernel_count.py, which sees each Triton launch)."""
    from kernel_count import count_kernels

    torch.manual_seed(0)
    model = BayesianNetwork(8, [16, 16]).cuda()
    x, y = torch.randn(64, 8, device="cuda"), torch.randn(64, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    with count_kernels() as kernels:
        gradient_variance(model, x, y, 640, "analytic", 8, 4, generator, cuda_graphs=False)
    assert kernels.get("triton::relu_tail_kernel", 0) > 0, kernels


def test_classification_objectives_on_cuda_match_cpu():
    g = torch.Generator().manual_seed(2)
    cpu = ClosedFormBNN(6, 12, output_dim=5, likelihood="softmax", generator=g).double()
    gpu = _copy_to(cpu, "cuda")
    x = torch.randn(30, 6, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 5, (30,), generator=g)
    torch.testing.assert_close(
        gpu.expected_log_likelihood(x.cuda(), labels.cuda()).cpu(), cpu.expected_log_likelihood(x, labels)
    )
    cuda_generator = torch.Generator(device="cuda").manual_seed(0)
    for objective in ("control_variate", "analytic_numerator", "sampling"):
        estimate = gpu.expected_log_likelihood(
            x.cuda(), labels.cuda(), objective=objective, num_samples=64, generator=cuda_generator
        )
        assert estimate.device.type == "cuda" and bool(torch.isfinite(estimate))


def test_regression_pipeline_runs_on_cuda(tmp_path, regression_cfg):
    from cfbnn_cli.pipelines import regression

    result = regression.run(regression_cfg("device=cuda"), tmp_path)
    assert str(result["device"]).startswith("cuda")
    assert result["metrics"]["final_test_rmse"] > 0


def test_vae_decoder_closed_form_on_cuda_matches_cpu_and_pipeline_runs(tmp_path, vae_cfg):
    from cfbnn_cli.bnn.vae import BayesianDecoderVAE
    from cfbnn_cli.pipelines import vae

    model = BayesianDecoderVAE(4, 3, [8], 6, "v3", init_scale=0.3, generator=torch.Generator().manual_seed(0)).double()
    g = torch.Generator().manual_seed(1)
    z = torch.randn(5, 3, generator=g, dtype=torch.float64)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64)
    gpu = _copy_to(model, "cuda")
    torch.testing.assert_close(
        gpu.decoder_expected_log_likelihood(z.cuda(), x.cuda()).cpu(), model.decoder_expected_log_likelihood(z, x)
    )
    estimate = gpu.importance_weighted_log_likelihood(x.cuda(), 50, torch.Generator(device="cuda").manual_seed(0))
    assert estimate.device.type == "cuda" and bool(torch.isfinite(estimate).all())
    result = vae.run(vae_cfg("device=cuda", "trainer.epochs=2"), tmp_path)
    assert str(result["device"]).startswith("cuda")
    assert all(torch.isfinite(torch.tensor(result["metrics"][f"vae/{v}/test_ll"])) for v in ("v1", "v2", "v3"))


def test_uci_protocol_runs_every_method_on_cuda(tmp_path, uci_cfg):
    from cfbnn_cli.pipelines import regression

    result = regression.run(uci_cfg("device=cuda", "trainer.epochs=10", "uci.predictive_samples=20"), tmp_path)
    for method in (
        "closed_form_diagonal",
        "closed_form_full",
        "local_reparameterization",
        "pyro",
        "pyro_local_reparameterization",
        "plain_mlp",
    ):
        assert torch.isfinite(torch.tensor(result["metrics"][f"uci/{method}/test_ll_mean"])), method


def test_imagenet_predict_runs_on_cuda_and_resnet50_features_match_cpu(tmp_path, imagenet_cfg):
    from cfbnn_cli.pipelines import imagenet

    result = imagenet.run(imagenet_cfg("device=cuda"), tmp_path / "run")
    assert str(result["device"]).startswith("cuda") and result["metrics"]["deterministic/top1"] > 0.5
    cpu = imagenet.compute_features(imagenet_cfg(*FAKE, f"features.cache_dir={tmp_path / 'cpu'}"), torch.device("cpu"))[
        "train"
    ][0].float()
    gpu = imagenet.compute_features(
        imagenet_cfg(*FAKE, f"features.cache_dir={tmp_path / 'gpu'}"), torch.device("cuda")
    )["train"][0].float()
    torch.testing.assert_close(gpu, cpu, rtol=2e-2, atol=2e-2)


def test_head_prediction_on_cuda_matches_cpu_float64():
    """``output_mean`` on CUDA (mean-only ReLU kernel, cached variances) in float32 and float64."""

    torch.manual_seed(0)
    head = bayesian_head(64, [128, 128], 10, init_scale=0.3).double()
    x = torch.randn(512, 64, dtype=torch.float64)
    with torch.no_grad():
        reference = head.output_mean(x)
        for dtype, tolerance in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
            on_gpu = _copy_to(head, "cuda").to(dtype)
            for _ in range(2):  # the second call reuses the cached variances
                logits = on_gpu.output_mean(x.to("cuda", dtype))
                assert logits.device.type == "cuda" and logits.dtype == dtype
                torch.testing.assert_close(logits.cpu().double(), reference, rtol=tolerance, atol=tolerance)


# ----------------------------------------------------------------------------- CUDA graphs


def _graph_failures(caplog):
    return [r.getMessage() for r in caplog.records if "CUDA graph capture" in r.getMessage()]


def _train_on_cuda(
    cuda_graphs, loss_hook=None, estimator="sampling", epochs=3, optimizer_factory=None, batch_loss=False
):
    """The Table 1 step on CUDA through the loop: 29 rows in batches of 8 (a last batch of 5),
    with the pipelines' Adam (fused) unless ``optimizer_factory`` says otherwise; with
    ``batch_loss`` a :class:`~cfbnn_cli.train.graphs.BatchLoss` (the gather outside the graph)."""
    from cfbnn_cli.train import TrainingLoop, optimizers
    from cfbnn_cli.train.graphs import BatchLoss

    g = torch.Generator().manual_seed(0)
    x = torch.randn(29, 5, generator=g).cuda()
    y = torch.randn(29, generator=g).cuda()
    model = BayesianNetwork(5, [16, 16], generator=torch.Generator().manual_seed(0)).cuda()
    optimizer = (optimizer_factory or optimizers.adam)(model.parameters(), lr=0.01)
    sampler = torch.Generator(device="cuda").manual_seed(3)

    def on_batch(xb, yb):
        noise = model.sample_noise(xb.shape[0], estimator=estimator, generator=sampler)
        value = -model.elbo(xb, yb, num_data=len(y), estimator=estimator, noise=noise)
        return loss_hook(value) if loss_hook is not None else value

    loop = TrainingLoop(
        model,
        optimizer,
        BatchLoss((x, y), on_batch) if batch_loss else (lambda rows: on_batch(x[rows], y[rows])),
        len(y),
        8,
        torch.device("cuda"),
        epochs=epochs,
        data_generator=torch.Generator().manual_seed(1),
        generators={"sampler": sampler},
        cuda_graphs=cuda_graphs,
    )
    loop.run()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, loop


@pytest.mark.parametrize("estimator", ["sampling", "analytic", "deterministic"])
def test_graphed_training_gives_the_eager_parameters_after_k_steps(caplog, estimator):
    eager, _ = _train_on_cuda(False, estimator=estimator)
    graphed, loop = _train_on_cuda(True, estimator=estimator)
    assert loop.graphed is not None and loop.graphed.enabled, _graph_failures(caplog)
    assert set(loop.graphed.graphs) == {8, 5}  # the last partial batch has a graph of its own
    for name in eager:
        torch.testing.assert_close(graphed[name], eager[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("estimator", ["sampling", "analytic"])
def test_a_graphed_batch_loss_gathers_outside_the_graph_and_gives_the_eager_parameters(caplog, estimator):
    """The static batch buffers filled before each replay: the parameters of eager training."""
    eager, _ = _train_on_cuda(False, estimator=estimator)
    graphed, loop = _train_on_cuda(True, estimator=estimator, batch_loss=True)
    assert loop.graphed is not None and loop.graphed.enabled, _graph_failures(caplog)
    assert set(loop.graphed.graphs) == {8, 5}
    for name in eager:
        torch.testing.assert_close(graphed[name], eager[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("dim, hidden", [(90, 200), (2048, 1000)])
def test_a_graphed_closed_form_step_launches_at_most_eighteen_kernels(dim, hidden):
    """The profiler's count of the work a step's CUDA graph holds (batch 500): the twin's count
    (tests/test_kernel_count.py, 15) plus room for cuBLAS's split-K reductions; the gather before
    each replay two kernels."""
    from torch.profiler import ProfilerActivity, profile

    from cfbnn_cli.train.graphs import BatchLoss, GraphedTrainingStep, make_capturable
    from cfbnn_cli.train.optimizers import adam

    torch.manual_seed(0)
    x, y = torch.randn(2000, dim, device="cuda"), torch.randn(2000, device="cuda")
    model = BayesianNetwork(dim, [hidden]).cuda()
    optimizer = adam(model.parameters(), lr=1e-3)
    loss = BatchLoss((x, y), lambda xb, yb: -model.elbo(xb, yb, num_data=2000))
    step = GraphedTrainingStep(model, optimizer, loss, "cuda")
    make_capturable(optimizer)
    rows = torch.randperm(2000, device="cuda")[:500]
    value = loss(rows)
    value.backward()
    optimizer.step()
    fill, work = step.captured_step(rows, value.detach())
    counts = []
    for call in (lambda: fill(rows), work):
        optimizer.zero_grad(set_to_none=True)
        call()
        torch.cuda.synchronize()
        optimizer.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        counts.append(sum(event.device_type == torch.autograd.DeviceType.CUDA for event in prof.events()))
    assert counts[0] == 2 and counts[1] <= 18, counts


def test_graphed_fused_adam_gives_the_parameters_of_eager_default_adam(caplog):
    """The pipelines' Adam is torch's fused one, captured in the step's graph: after k steps the
    parameters of torch's default Adam run eagerly."""
    eager, _ = _train_on_cuda(False, estimator="analytic", optimizer_factory=torch.optim.Adam)
    graphed, loop = _train_on_cuda(True, estimator="analytic")
    assert loop.graphed is not None and loop.graphed.enabled, _graph_failures(caplog)
    assert loop.optimizer.param_groups[0]["fused"] is True
    for name in eager:
        torch.testing.assert_close(graphed[name], eager[name], rtol=1e-5, atol=1e-6, msg=name)


def test_graph_replays_draw_new_numbers_and_a_seed_reproduces_them():
    first, _ = _train_on_cuda(True, epochs=2)
    again, _ = _train_on_cuda(True, epochs=2)
    for name in first:
        assert torch.equal(first[name], again[name]), name
    from cfbnn_cli.runtime.cuda_graphs import GraphedCall

    generator = torch.Generator(device="cuda").manual_seed(0)
    draw = GraphedCall(
        lambda x: x + torch.randn(x.shape, generator=generator, device="cuda"), "cuda", generators=(generator,)
    )
    zeros = torch.zeros(1000, device="cuda")
    draws = [draw(zeros) for _ in range(4)]  # eager, then three replays
    assert draw.graphs and all(not torch.equal(a, b) for a, b in zip(draws, draws[1:]))
    generator.manual_seed(0)
    eager = [zeros + torch.randn(1000, generator=generator, device="cuda") for _ in range(4)]
    for a, b in zip(draws, eager):
        torch.testing.assert_close(a, b)


def test_a_step_that_cannot_be_captured_falls_back_with_one_log_line(caplog):
    def synchronizes(value):
        float(value)  # a host synchronization: not allowed inside a capture
        return value

    eager, _ = _train_on_cuda(False, loss_hook=synchronizes)
    with caplog.at_level("WARNING"):
        graphed, loop = _train_on_cuda(True, loss_hook=synchronizes)
    assert not loop.graphed.enabled and len(_graph_failures(caplog)) == 1
    for name in eager:
        torch.testing.assert_close(graphed[name], eager[name], rtol=1e-5, atol=1e-6, msg=name)


def test_graphed_prediction_and_evaluation_equal_eager():
    from cfbnn_cli.bnn.vae import BayesianDecoderVAE
    from cfbnn_cli.pipelines.vae import importance_weighted_test_ll
    from cfbnn_cli.runtime.cuda_graphs import GraphedCall

    torch.manual_seed(0)
    head = bayesian_head(64, [128, 128], 10, init_scale=0.3).cuda().eval()
    x = torch.randn(300, 64, device="cuda")
    with torch.no_grad():
        graphed = GraphedCall(head.output_moments, "cuda")
        for rows in (x[:128], x[128:256], x[:128], x[256:]):
            for a, b in zip(graphed(rows), head.output_moments(rows)):
                torch.testing.assert_close(a, b)
        assert len(graphed.graphs) == 2 and graphed.enabled
    vae = BayesianDecoderVAE(12, 3, [16], 8, "v3", init_scale=0.3, generator=torch.Generator().manual_seed(0)).cuda()
    data = torch.randn(50, 12, device="cuda")
    with_graphs = importance_weighted_test_ll(vae, data, 20, 3, 40, seed=5, cuda_graphs=True)
    without = importance_weighted_test_ll(vae, data, 20, 3, 40, seed=5, cuda_graphs=False)
    torch.testing.assert_close(with_graphs, without, rtol=1e-6, atol=1e-6)


def test_graphed_gradient_draws_equal_eager():
    torch.manual_seed(0)
    model = BayesianNetwork(8, [16, 16]).cuda()
    x, y = torch.randn(64, 8, device="cuda"), torch.randn(64, device="cuda")
    results = [
        gradient_variance(
            model, x, y, 640, "sampling", 100, 25, torch.Generator(device="cuda").manual_seed(0), cuda_graphs=flag
        )
        for flag in (True, False)
    ]
    for name in results[0]:
        assert results[0][name] == pytest.approx(results[1][name], rel=1e-4), name


@pytest.mark.parametrize("command", ["regression", "vae", "imagenet"])
def test_every_pipeline_trains_graphed_on_cuda_without_a_fallback(
    tmp_path, caplog, regression_cfg, vae_cfg, imagenet_cfg, command
):
    from cfbnn_cli.pipelines import imagenet, regression, vae

    with caplog.at_level("WARNING"):
        if command == "regression":
            regression.run(regression_cfg("device=cuda"), tmp_path)
        elif command == "vae":
            vae.run(vae_cfg("device=cuda", "trainer.epochs=2"), tmp_path)
        else:
            imagenet.run(imagenet_cfg("device=cuda"), tmp_path / "run")
    assert not _graph_failures(caplog)


def test_own_data_fit_classification_and_predict_on_cuda_match_the_cpu(tmp_path):
    """protocol=fit and train classification with device=cuda, and `cfbnn predict --device cuda`:
    the CPU's numbers (float32 arithmetic on both; L-BFGS paths may part in late digits)."""
    import csv

    import numpy as np
    import pandas as pd

    from cfbnn_cli.cli import compose_config
    from cfbnn_cli.pipelines import classification, regression
    from cfbnn_cli.pipelines.predict import predict_run

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3))
    frame = pd.DataFrame(
        {"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "y": x[:, 0] - x[:, 1] + 0.3 * rng.normal(size=200)}
    )
    frame.to_csv(tmp_path / "t.csv", index=False)
    metrics = {}
    for device in ("cpu", "cuda"):
        cfg = compose_config(
            "train_regression", ["data=csv", f"data.path={tmp_path / 't.csv'}", "data.target=y", f"device={device}"]
        )
        (tmp_path / device).mkdir()
        metrics[device] = regression.run(cfg, tmp_path / device)["metrics"]
        (tmp_path / device / "results.json").write_text("{}")
        (tmp_path / device / "done").write_text("")
    assert metrics["cuda"]["fit/test_ll"] == pytest.approx(metrics["cpu"]["fit/test_ll"], abs=0.02)
    frame.drop(columns="y").to_csv(tmp_path / "new.csv", index=False)
    outputs = [
        predict_run(tmp_path / "cpu", tmp_path / "new.csv", out=tmp_path / f"p_{device}.csv", device=device)
        for device in ("cpu", "cuda")
    ]
    tables = [list(csv.DictReader(open(path))) for path in outputs]
    for column in ("mean", "sd", "lower_90"):
        np.testing.assert_allclose(
            [float(r[column]) for r in tables[1]], [float(r[column]) for r in tables[0]], rtol=1e-4, atol=1e-5
        )
    cfg = compose_config("train_classification", ["data=iris", "fit.refit=false", "device=cuda"])
    (tmp_path / "iris").mkdir()
    assert classification.run(cfg, tmp_path / "iris")["metrics"]["fit/test_accuracy"] > 0.8
