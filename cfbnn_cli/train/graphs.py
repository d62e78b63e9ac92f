"""The training step (forward, backward, optimizer) as one CUDA graph per batch size.

:class:`GraphedTrainingStep` is what :class:`~cfbnn_cli.train.loop.TrainingLoop` calls on
CUDA (``trainer.cuda_graphs=true``, the default). For each batch size it meets:

1. the first step runs eagerly, on a side stream: it is a real training step (the same
   kernels, data and random draws as without graphs), and it makes the optimizer's
   lazily created state and every workspace before the capture;
2. the step is then captured (not run) on static inputs: the loss, ``backward()`` (from a
   static seed) into gradient buffers of the graph's own and ``optimizer.step()`` (Adam with
   ``capturable=True``: its step count lives on the GPU);
3. every later step of that size fills the static inputs and replays.

The static inputs are a :class:`BatchLoss`'s batch buffers -- its rows of the data, gathered
before each replay (``index_select`` into the buffers), so the graph holds the step alone -- or,
for any other ``loss(rows)``, a buffer of row indices (the gather then inside the graph).

A last, smaller batch gets a graph of its own the same way, so every batch trains as
without graphs: nothing is dropped or padded, and the parameters after k steps equal
the eager ones (tests/test_cuda.py). Random draws inside the step come from the
generators registered with the graph (the pipeline's ``generators``): each replay
draws new numbers, and the seed reproduces them.

Nothing in a step waits for the GPU: the loss stays on the device (the loop checks the
epoch's losses for NaN/Inf once, at the epoch's end, naming the step), and argument
validation (a host synchronization) is off inside the graph. Where capture fails, one
log line says why and every later step runs eagerly.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional, Sequence

import torch

from ..moments import validate_args
from ..runtime.cuda_graphs import Capture, GraphedCall, capture, cuda_graphs_available, on_side_stream

log = logging.getLogger(__name__)


def make_capturable(optimizer: torch.optim.Optimizer) -> bool:
    """Switch ``optimizer`` to its graph-safe form (``capturable=True``: the step count on the
    device, no host read of it); ``False`` for an optimizer without that form."""
    if not all("capturable" in group for group in optimizer.param_groups):
        return False
    for group in optimizer.param_groups:
        group["capturable"] = True
        for parameter in group["params"]:
            state = optimizer.state.get(parameter, {})
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.device != parameter.device:
                # a state restored from a checkpoint keeps its step on the CPU unless capturable
                state["step"] = step.to(device=parameter.device, dtype=torch.float32)
    return True


class BatchLoss:
    """A minibatch loss on rows of fixed data tensors: ``loss(rows) = on_batch(*(t[rows] for t in
    data))``. :class:`GraphedTrainingStep` gathers its rows into static batch buffers before each
    replay, outside the graph (``loss(rows)`` is the same number as with the gather inside)."""

    def __init__(self, data: Sequence[torch.Tensor], on_batch: Callable[..., torch.Tensor]):
        self.data, self.on_batch = tuple(data), on_batch

    def gather(self, rows: torch.Tensor, out: Optional[Sequence[torch.Tensor]] = None):
        """Each data tensor's ``rows``, into ``out`` where given (buffers of the batch's shapes)."""
        if out is None:
            return tuple(t.index_select(0, rows) for t in self.data)
        for tensor, buffer in zip(self.data, out):
            torch.index_select(tensor, 0, rows, out=buffer)
        return out

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return self.on_batch(*self.gather(rows))


class GraphedTrainingStep:
    """``step(rows) -> loss`` (a 0-d tensor on the device; see the module doc).

    ``loss(rows)`` is the pipeline's minibatch loss (a :class:`BatchLoss` keeps its gather out of
    the graph); ``generators`` the CUDA generators
    it draws from. ``capture`` replaces :func:`~cfbnn_cli.runtime.cuda_graphs.capture`
    (tests). ``enabled`` is False off CUDA, for an optimizer without a capturable
    form, or after a failed capture.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss: Callable[[torch.Tensor], torch.Tensor],
        device,
        generators: Sequence[torch.Generator] = (),
        label: str = "train",
        capture: Optional[Capture] = None,
    ):
        self.model, self.optimizer, self.loss = model, optimizer, loss
        self.device = torch.device(device)
        self.generators = tuple(generators)
        self.label = label
        self._capture = capture
        self.graphs: Dict[int, tuple] = {}
        self.failure: Optional[str] = None
        self.enabled = capture is not None or cuda_graphs_available(self.device)

    def _eager(self, rows: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(rows)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return self._eager(rows)
        entry = self.graphs.get(rows.numel())
        if entry is None:
            # here, not at construction: a checkpoint restored since may have replaced the param groups
            if self.device.type == "cuda" and not make_capturable(self.optimizer):
                self.enabled = False
                log.info(
                    "%s: %s has no capturable form; training steps run eagerly",
                    self.label,
                    type(self.optimizer).__name__,
                )
                return self._eager(rows)
            with validate_args(False):
                loss = on_side_stream(lambda: self._eager(rows), self.device)
                self._record(rows, loss)
            return loss
        fill, replay = entry
        fill(rows)
        return replay()

    def captured_step(self, rows: torch.Tensor, loss: torch.Tensor):
        """``(fill, step)`` for batches of ``rows``' size, ``loss`` an eager step's loss (its shape
        and dtype): ``step()`` is the work the graph holds -- the loss on static inputs,
        ``backward()`` from a static seed, ``optimizer.step()`` -- and ``fill(rows)`` what runs
        before each replay, outside the graph: the batch's gather into those inputs (a
        :class:`BatchLoss`), else the rows' copy into a static buffer. The benchmarks count each
        one's kernels (benchmarks/bench_operators.py)."""
        seed = torch.ones_like(loss)  # backward()'s own seed would be a fill kernel inside the graph
        if isinstance(self.loss, BatchLoss):
            batch = self.loss.gather(rows)

            def fill(rows):
                self.loss.gather(rows, out=batch)

            def value():
                return self.loss.on_batch(*batch)

        else:
            static_rows = rows.detach().clone()

            def fill(rows):
                static_rows.copy_(rows)

            def value():
                return self.loss(static_rows)

        def step():
            loss = value()
            loss.backward(seed)
            self.optimizer.step()
            return loss.detach()

        return fill, step

    def _record(self, rows: torch.Tensor, loss: torch.Tensor) -> None:
        fill, step = self.captured_step(rows, loss)
        # gradients of the graph's own: backward() inside the capture writes (not adds) them
        self.optimizer.zero_grad(set_to_none=True)
        try:
            replay = (self._capture or capture)(step, self.generators)
        except Exception as error:  # noqa: BLE001 - any capture failure means: train eagerly
            self.optimizer.zero_grad(set_to_none=True)  # what a failed capture left is no gradient
            self.enabled = False
            self.graphs.clear()
            self.failure = GraphedCall.describe(error)
            log.warning(
                "%s: CUDA graph capture of the training step failed (%s); training steps run eagerly",
                self.label,
                self.failure,
            )
            return
        self.graphs[rows.numel()] = (fill, replay)
        log.debug("%s: training step of %d rows captured as a CUDA graph", self.label, rows.numel())
