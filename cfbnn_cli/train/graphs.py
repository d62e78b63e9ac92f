"""The training step (forward, backward, optimizer) as one CUDA graph per batch size.

:class:`GraphedTrainingStep` is what :class:`~cfbnn_cli.train.loop.TrainingLoop` calls on
CUDA (``trainer.cuda_graphs=true``, the default). For each batch size it meets:

1. the first step runs eagerly, on a side stream: it is a real training step (the same
   kernels, data and random draws as without graphs), and it makes the optimizer's
   lazily created state and every workspace before the capture;
2. the step is then captured (not run) with a static buffer of row indices: the loss,
   ``backward()`` into gradient buffers of the graph's own and ``optimizer.step()``
   (Adam with ``capturable=True``: its step count lives on the GPU);
3. every later step of that size copies its row indices into the buffer and replays.

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


class GraphedTrainingStep:
    """``step(rows) -> loss`` (a 0-d tensor on the device; see the module doc).

    ``loss(rows)`` is the pipeline's minibatch loss; ``generators`` the CUDA generators
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
                self._record(rows)
            return loss
        static_rows, replay = entry
        static_rows.copy_(rows)
        return replay()

    def _record(self, rows: torch.Tensor) -> None:
        static_rows = rows.detach().clone()

        def step():
            loss = self.loss(static_rows)
            loss.backward()
            self.optimizer.step()
            return loss.detach()

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
        self.graphs[rows.numel()] = (static_rows, replay)
        log.debug("%s: training step of %d rows captured as a CUDA graph", self.label, rows.numel())
