"""Whole computations as CUDA graphs: one launch instead of the ~180 small kernels of a step.

On a GPU a closed-form training step or a batched prediction is bound by launching
kernels, not by arithmetic. A CUDA graph records the kernels once and replays them
with one launch. This module holds what every graphed computation shares:

* :func:`capture` records ``function()`` into a :class:`torch.cuda.CUDAGraph` and returns a
  ``replay()`` that runs it again and returns the same output tensors. Generators the
  function draws from are registered with the graph, so each replay draws new numbers
  (the generator's offset advances by the whole graph's increment, as eager calls
  would advance it) and a seed still reproduces a run.
* :class:`GraphedCall` wraps a function of tensors (a prediction, an evaluation pass, a
  chunk of gradient draws): the first call at each input signature runs eagerly (the
  warm-up), then the function is captured once with static input buffers; later
  calls copy their inputs in and replay. Outputs are returned as copies, so that a
  caller may keep them across calls. Off CUDA it is the function itself.

Why hand-made graphs and not ``torch.compile(mode="reduce-overhead")``: compiling the
step costs tens of seconds per shape, more than a default run's whole training on a
GPU, and the graphs here capture the eager kernels unchanged, so graphed and eager
numbers agree to the last bit wherever the kernels are deterministic.

Where capture fails (an operation that synchronizes with the host, a generator that
is not registered, a tensor created on the CPU inside), one log line says why and the
computation runs eagerly from then on: never a failed run.

``capture`` is replaceable (the ``capture=`` argument) so that the bookkeeping around
it -- static buffers, one graph per input signature, the eager warm-up, the fallback --
is tested on the CPU with a stand-in that re-runs the function (tests/train/test_graphs.py).
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_map

log = logging.getLogger(__name__)

Replay = Callable[[], object]
Capture = Callable[[Callable[[], object], Sequence[torch.Generator]], Replay]


def cuda_graphs_available(device) -> bool:
    """Whether computations on ``device`` can be graphed (a CUDA device, CUDA present)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def capture(function: Callable[[], object], generators: Sequence[torch.Generator] = ()) -> Replay:
    """Record ``function()`` (CUDA work on the current device) as one CUDA graph.

    Returns ``replay()``, which re-runs the recorded kernels on the same memory and
    returns the tensors ``function()`` returned at capture. Each CUDA generator in
    ``generators`` is registered, so every replay draws fresh numbers from it (the
    default CUDA generator is registered by torch itself). Raises whatever the capture
    raises (the caller falls back to eager), the generators released first
    (:func:`release_generators`).
    """
    graph = torch.cuda.CUDAGraph()
    registered = [generator for generator in generators if generator.device.type == "cuda"]
    for generator in registered:
        graph.register_generator_state(generator)
    try:
        # capture on a side stream, as torch.cuda.graph does; the caller's warm-up ran already
        with torch.cuda.graph(graph):
            outputs = function()
    except BaseException:
        release_generators([torch.cuda.default_generators[torch.cuda.current_device()], *registered])
        raise

    def replay():
        graph.replay()
        return outputs

    replay.graph = graph  # kept alive with the replay function (its memory pool holds the outputs)
    return replay


def release_generators(generators: Sequence[torch.Generator]) -> None:
    """Give each CUDA generator a fresh copy of its state (same seed and offset) after a failed capture.

    A capture that fails ends before torch's capture epilogue runs, and the generators'
    states stay marked as capturing: every later draw in the process then fails ("Offset
    increment outside graph capture encountered unexpectedly"), eager or not. The copy is
    not marked, so the eager fallback draws on where the generator stood.
    """
    for generator in generators:
        generator.graphsafe_set_state(generator.clone_state())


_SIDE_STREAMS: Dict[torch.device, "torch.cuda.Stream"] = {}


def on_side_stream(function: Callable[[], object], device):
    """``function()`` on a side CUDA stream, ordered after and before the current stream's work.

    The eager warm-up before a capture runs there, as PyTorch's capture recipe asks: the
    lazily made resources of the first run (cuBLAS workspaces, the autograd engine's
    stream bookkeeping) then belong to a stream other than the one captured on. Off
    CUDA it is ``function()``.
    """
    device = torch.device(device)
    if not cuda_graphs_available(device):
        return function()
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        outputs = function()
    torch.cuda.current_stream(device).wait_stream(stream)
    return outputs


def _signature(tensors: Iterable[torch.Tensor]) -> Tuple:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)


class GraphedCall:
    """``function(*tensors)`` run as a CUDA graph per input signature (see the module doc).

    ``generators`` are the CUDA generators ``function`` draws from. ``label`` names the
    computation in the one log line a failed capture gives. With ``enabled=False``, or
    off CUDA, calls go straight to ``function``.
    """

    def __init__(
        self,
        function: Callable,
        device,
        generators: Sequence[torch.Generator] = (),
        label: str = "",
        enabled: bool = True,
        capture: Optional[Capture] = None,
    ):
        self.function = function
        self.generators = tuple(generators)
        self.label = label or getattr(function, "__name__", "computation")
        self._capture = capture
        self.device = torch.device(device)
        self.enabled = enabled and (capture is not None or cuda_graphs_available(device))
        self.graphs: Dict[Tuple, Tuple[Tuple[torch.Tensor, ...], Replay]] = {}
        self.failure: Optional[str] = None

    def __call__(self, *tensors: torch.Tensor):
        if not self.enabled:
            return self.function(*tensors)
        key = _signature(tensors)
        entry = self.graphs.get(key)
        if entry is None:
            # the warm-up: the first call of this signature runs eagerly (its result is a real one)
            outputs = on_side_stream(lambda: self.function(*tensors), self.device)
            self._record(key, tensors)
            return outputs
        static, replay = entry
        for buffer, tensor in zip(static, tensors):
            buffer.copy_(tensor)
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, replay())

    def _record(self, key, tensors) -> None:
        static = tuple(t.detach().clone() for t in tensors)
        try:
            replay = (self._capture or capture)(lambda: self.function(*static), self.generators)
        except Exception as error:  # noqa: BLE001 - any capture failure means: run this eagerly
            self.disable(error)
            return
        self.graphs[key] = (static, replay)

    def disable(self, error: BaseException) -> None:
        """Run eagerly from now on, saying why once."""
        self.enabled = False
        self.graphs.clear()
        self.failure = self.describe(error)
        log.warning("%s: CUDA graph capture failed (%s); running it eagerly", self.label, self.failure)

    @staticmethod
    def describe(error: BaseException) -> str:
        """A capture error in one short line (for the one log line)."""
        text = str(error).strip()
        return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:300]
