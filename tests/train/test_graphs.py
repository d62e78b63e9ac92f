"""The CUDA-graph bookkeeping on the CPU: train/graphs.py and runtime/cuda_graphs.py with a stand-in
for the capture.

A CUDA graph records a computation once and replays its kernels on the same memory. The
stand-in below does what a replay does (runs the recorded step again on the static
buffers, gradients written afresh as the captured backward writes them), so what is
tested here is everything around the capture: one graph per batch size, the eager first
step, the static row buffer, outputs copied out, the fallback when capture fails, and the
loop's end-of-epoch NaN check. The real capture is tested on a GPU (tests/test_cuda.py).
"""

import logging

import pytest
import torch

from cfbnn_cli.bnn import BayesianNetwork
from cfbnn_cli.runtime.cuda_graphs import GraphedCall
from cfbnn_cli.runtime.numerics import NonFiniteLossError
from cfbnn_cli.train import TrainingLoop
from cfbnn_cli.train.graphs import BatchLoss, GraphedTrainingStep


class StandIn:
    """Captures by keeping the step; each replay runs it again (counting captures and replays)."""

    def __init__(self, optimizer=None, fail=None):
        self.optimizer, self.fail = optimizer, fail
        self.captures = self.replays = 0

    def __call__(self, function, generators):
        if self.fail is not None:
            raise self.fail
        self.captures += 1

        def replay():
            self.replays += 1
            if self.optimizer is not None:  # a captured backward writes its gradients, it does not add to them
                self.optimizer.zero_grad(set_to_none=True)
            return function()

        return replay


def _problem(seed=0, rows=29):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 5, generator=g)
    y = torch.randn(rows, generator=g)
    model = BayesianNetwork(5, [8, 8], generator=torch.Generator().manual_seed(seed))
    return x, y, model


def _train(graphed: bool, epochs=3, fail=None, nan_at=None, label="toy", batch_loss=False):
    """The Table 1 step (sampling estimator: random draws in every step), 29 rows in batches of 8
    (a last batch of 5), through the loop; returns the parameters, the history and the stand-in.
    With ``batch_loss`` the loss is a :class:`BatchLoss` (the rows gathered outside the graph)."""
    x, y, model = _problem()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    sampler = torch.Generator().manual_seed(3)
    calls = {"n": 0}

    def on_batch(xb, yb):
        calls["n"] += 1
        noise = model.sample_noise(xb.shape[0], estimator="sampling", generator=sampler)
        value = -model.elbo(xb, yb, num_data=len(y), estimator="sampling", noise=noise)
        return value * float("nan") if nan_at is not None and calls["n"] == nan_at else value

    loss = BatchLoss((x, y), on_batch) if batch_loss else (lambda rows: on_batch(x[rows], y[rows]))

    loop = TrainingLoop(
        model,
        optimizer,
        loss,
        len(y),
        8,
        torch.device("cpu"),
        epochs=epochs,
        label=label,
        data_generator=torch.Generator().manual_seed(1),
        generators={"sampler": sampler},
    )
    stand_in = StandIn(optimizer, fail)
    if graphed:
        loop.graphed = GraphedTrainingStep(model, optimizer, loss, "cpu", [sampler], label, capture=stand_in)
    loop.run()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, loop, stand_in


def test_graphed_training_equals_eager_training_including_the_last_partial_batch():
    eager, eager_loop, _ = _train(graphed=False)
    graphed, graphed_loop, stand_in = _train(graphed=True)
    assert stand_in.captures == 2  # one graph for batches of 8, one for the last batch of 5
    assert stand_in.replays == 3 * 4 - 2  # every step but the first of each size (the eager warm-up)
    assert set(graphed_loop.graphed.graphs) == {8, 5}
    for name in eager:
        torch.testing.assert_close(graphed[name], eager[name], rtol=0, atol=0, msg=name)
    # the epoch's objective, summed on the device and read once, is the eager one
    for a, b in zip(eager_loop.history, graphed_loop.history):
        assert a["train_elbo_per_point"] == pytest.approx(b["train_elbo_per_point"], rel=1e-12)


def test_a_batch_loss_trains_as_the_gather_inside_with_its_gather_outside_the_graph():
    """A :class:`BatchLoss`: the same parameters as the eager loop and as a loss that gathers its
    rows itself; the captured work gathers nothing, the fill before each replay gathers the batch
    into the static buffers (one gather a data tensor) and nothing else."""
    from kernel_count import count_kernels

    eager, _, _ = _train(graphed=False)
    graphed, loop, stand_in = _train(graphed=True, batch_loss=True)
    assert stand_in.captures == 2 and stand_in.replays == 10
    for name in eager:
        torch.testing.assert_close(graphed[name], eager[name], rtol=0, atol=0, msg=name)
    step = loop.graphed
    rows = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    value = step.loss(rows)
    fill, work = step.captured_step(rows, value.detach())
    other = rows.flip(0)
    with count_kernels() as filled:
        fill(other)
    step.optimizer.zero_grad(set_to_none=True)
    with count_kernels() as captured:
        work()
    assert dict(filled) == {"aten::index_select": 2}, filled
    assert not {"aten::index", "aten::index_select", "aten::ones_like"} & set(captured), captured


def test_each_replay_reads_the_rows_its_fill_gathered():
    """The static batch buffers hold the rows of the step that replays: the captured loss of the
    batch filled last, whatever rows the capture saw."""
    g = torch.Generator().manual_seed(5)
    x, y, weight = torch.randn(20, 3, generator=g), torch.randn(20, generator=g), torch.randn(3, requires_grad=True)
    loss = BatchLoss((x, y), lambda xb, yb: (xb @ weight - yb).square().sum())
    step = GraphedTrainingStep(torch.nn.Module(), torch.optim.SGD([weight], lr=0.0), loss, "cpu", capture=StandIn())
    seen = [step(torch.tensor(rows)) for rows in ([0, 1, 2], [0, 1, 2], [7, 3, 19], [5, 5, 6])]
    for rows, value in zip(([0, 1, 2], [0, 1, 2], [7, 3, 19], [5, 5, 6]), seen):
        torch.testing.assert_close(value, (x[rows] @ weight - y[rows]).square().sum().detach(), rtol=0, atol=0)


def test_a_failed_capture_says_why_once_and_training_goes_on_eagerly(caplog):
    eager, _, _ = _train(graphed=False)
    with caplog.at_level(logging.WARNING, logger="cfbnn_cli.train.graphs"):
        graphed, loop, _ = _train(graphed=True, fail=RuntimeError("operation not permitted when stream is capturing"))
    warnings = [r.getMessage() for r in caplog.records if "CUDA graph capture" in r.getMessage()]
    assert len(warnings) == 1 and "operation not permitted when stream is capturing" in warnings[0]
    assert not loop.graphed.enabled and loop.graphed.failure.startswith("RuntimeError")
    for name in eager:
        torch.testing.assert_close(graphed[name], eager[name], rtol=0, atol=0, msg=name)


def test_a_nan_loss_in_a_graphed_epoch_is_caught_at_the_epochs_end_naming_its_step():
    """No step waits for the GPU: the losses stay on the device and are checked once per epoch."""
    with pytest.raises(NonFiniteLossError, match=r"toy loss became nan at epoch 2, step 2"):
        _train(graphed=True, nan_at=4 + 3)  # epoch 2 (4 steps each), its third step


def test_off_cuda_the_loop_builds_no_graphs():
    x, y, model = _problem()
    loop = TrainingLoop(
        model,
        torch.optim.Adam(model.parameters()),
        lambda rows: model(x[rows], y[rows]).sum(),
        len(y),
        8,
        torch.device("cpu"),
    )
    assert loop.graphed is None


def test_graphed_call_copies_inputs_in_and_outputs_out():
    stand_in = StandIn()
    weight = torch.randn(3, 4)
    call = GraphedCall(lambda x: (x @ weight, x.sum()), "cpu", label="toy", capture=stand_in)
    inputs = [torch.randn(6, 3) for _ in range(3)] + [torch.randn(2, 3)]
    outputs = [call(x) for x in inputs]
    assert stand_in.captures == 2 and stand_in.replays == 2  # one per input shape, after its eager first call
    for x, (product, total) in zip(inputs, outputs):  # kept across calls: copies, not the graph's buffers
        torch.testing.assert_close(product, x @ weight)
        torch.testing.assert_close(total, x.sum())


def test_graphed_call_falls_back_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="cfbnn_cli.runtime.cuda_graphs"):
        call = GraphedCall(lambda x: x * 2, "cpu", label="doubling", capture=StandIn(fail=RuntimeError("no")))
        results = [call(torch.ones(2)) for _ in range(3)]
    assert all(torch.equal(r, torch.full((2,), 2.0)) for r in results)
    assert (
        not call.enabled
        and sum("doubling: CUDA graph capture failed (RuntimeError: no)" in r.getMessage() for r in caplog.records) == 1
    )
    assert GraphedCall(lambda x: x, "cpu").enabled is False  # off CUDA, no stand-in: the function itself
