"""How every ``cfbnn::`` operator is declared: one :class:`Operator`, registered by :func:`define`.

An operator is its schema, its reference kernel (the torch formula: the default kernel of every
device, ``CompositeExplicitAutograd``, and the tests' oracle), its fake (``torch.compile``,
``opcheck``) and, where it has them, its CUDA kernel (Triton), its autograd and its vmap rule. The
C++ library (:mod:`.extension`) adds the CPU kernels by static registration when it is loaded.
Nothing else chooses a kernel: torch's dispatcher picks it by device. :data:`OPERATORS` is the one
list of them; they are declared in ``moment_ops.py``, ``elbo_ops.py``, ``predict_ops.py`` and
``bnn/fused/nodes.py``.

Autograd. ``torch.library``'s own autograd registration does not run under ``torch.func``
transforms (pytorch/pytorch#168393): an operator's autograd here is a kernel of its own for the
``Autograd`` key, :class:`OperatorAutograd`, applied at the level torch.func's interpreter is
processing, so ``grad``, ``vmap(grad)``, ``jacrev`` and nested ``grad`` reach the operator's
backward, and ``vmap`` its vmap rule. Two kinds:

* a kernel operator (``setup_context`` + ``backward``): the forward is the operator's kernel on the
  next dispatch key (the device's), and the backward calls the backward operator, whose own
  autograd makes it differentiable again where a graph of the backward is wanted;
* a node (``forward`` + ``backward``, the fused nodes of ``bnn/fused``): the forward runs the node's
  body with the autograd context at hand, which keeps what the backward needs (``ctx.wants``: which
  inputs want a gradient); its backward returns first derivatives only (``bnn/fused/nodes.py``
  passes them through ``cfbnn::first_order``, whose derivative raises).

An operator whose schema takes tensor lists (a deep network's layers) reaches autograd with the
lists flattened: its node's backward returns one gradient per tensor of the flattened inputs.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor
from torch._functorch.utils import get_single_level_autograd_function_allowed as _single_level_allowed
from torch._functorch.utils import set_single_level_autograd_function_allowed as _allow_single_level
from torch.utils import _pytree as pytree

__all__ = [
    "HAVE_TRITON",
    "OPERATORS",
    "LazyModule",
    "Operator",
    "absent_gradient",
    "batch_first",
    "check_operands",
    "define",
    "differentiable_by_formula",
    "elementwise_vmap",
]

FLOATS = (torch.float32, torch.float64)

# Triton comes with torch's CUDA wheels; a CPU-only install may lack it, and then the reference
# kernels serve CUDA too. Decided once, at registration, without importing Triton.
HAVE_TRITON = importlib.util.find_spec("triton") is not None

LIBRARY = torch.library.Library("cfbnn", "DEF")
OPERATORS: Dict[str, "Operator"] = {}  # name -> declaration: every cfbnn:: operator
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset


class LazyModule:
    """A module imported on its first attribute access: ``triton`` and the Triton kernel modules,
    which importing :mod:`cfbnn_cli.moments` does not pull in (``import triton`` costs about 0.3 s
    of a CPU-only start-up). They are imported by the first Triton launch (a CUDA tensor; the CPU in
    the tests' CUDA twin, whose ``TRITON_INTERPRET=1`` must be set before Triton is imported)."""

    _name = ""
    _module = None

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str):
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attribute)

    def __repr__(self) -> str:
        return f"<LazyModule {self._name!r}{' (imported)' if self._module is not None else ''}>"


@dataclasses.dataclass(frozen=True)
class Operator:
    """One ``cfbnn::`` operator (see the module doc). ``schema`` is ``"name(arguments) -> results"``;
    ``reference``, ``fake`` and ``cuda`` take the operator's arguments. Autograd: ``setup_context(ctx,
    inputs, output)`` and ``backward(ctx, *grads)`` (one gradient per input), or for a node
    ``forward(ctx, *inputs)`` and ``backward``; ``for_gradient(inputs) -> inputs`` changes the
    arguments of a forward whose gradient will be taken (a piecewise polynomial's saved partial
    derivatives). ``vmap(info, in_dims, *inputs) -> (outputs, out_dims)``."""

    schema: str
    reference: Callable
    fake: Callable
    cuda: Optional[Callable] = None
    setup_context: Optional[Callable] = None
    forward: Optional[Callable] = None
    backward: Optional[Callable] = None
    for_gradient: Optional[Callable] = None
    vmap: Optional[Callable] = None
    op: Optional[torch._ops.OpOverload] = dataclasses.field(default=None, compare=False)

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]


class OperatorAutograd(torch.autograd.function._SingleLevelFunction):
    """The autograd kernel of every ``cfbnn::`` operator that has a derivative (the module doc). A
    single-level function: torch.func's interpreter has already brought the call to its level when
    the ``Autograd`` key runs it (:func:`_autograd_kernel`), so it records one node there; the
    forward passes the call on to the next key (kernel operators) or runs the node's body (nodes).
    ``spec``: how the inputs were flattened (``None``: they were not)."""

    @staticmethod
    def forward(ctx, operator: Operator, keyset, spec, *flat):
        ctx.operator = operator
        inputs = flat if spec is None else tuple(pytree.tree_unflatten(list(flat), spec))
        if operator.forward is not None:  # a node: its body, keeping what its backward needs
            ctx.wants = ctx.needs_input_grad[3:]
            with torch._C._AutoDispatchBelowAutograd():
                return operator.forward(ctx, *inputs)
        if operator.for_gradient is not None:
            inputs = operator.for_gradient(inputs)
        # (grad mode on: an outer torch.func.grad level records the kernel's call on its way down)
        with torch.enable_grad(), torch._C._AutoDispatchBelowAutograd():
            output = operator.op.redispatch(keyset & _AFTER_AUTOGRAD, *inputs)
        operator.setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, *ctx.operator.backward(ctx, *grads))


def _autograd_kernel(operator: Operator) -> Callable:
    op = operator.op
    lists = "[]" in operator.schema.split("->")[0]  # (decided once: its inputs reach autograd flattened)

    def kernel(keyset, *inputs):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*inputs):
            spec = None
            if lists:
                flat, spec = pytree.tree_flatten(inputs)
                inputs = flat
            allowed = _single_level_allowed()
            _allow_single_level(True)
            try:
                return OperatorAutograd.apply(operator, keyset, spec, *inputs)
            finally:
                _allow_single_level(allowed)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & _AFTER_AUTOGRAD, *inputs)

    return kernel


def define(operator: Operator) -> torch._ops.OpOverload:
    """Register ``operator`` (every part it has) and return ``torch.ops.cfbnn.<name>.default``."""
    name = operator.name
    if name in OPERATORS:
        raise ValueError(f"cfbnn::{name} is declared twice")
    LIBRARY.define(operator.schema)
    LIBRARY.impl(name, operator.reference, "CompositeExplicitAutograd")
    if operator.cuda is not None and HAVE_TRITON:
        LIBRARY.impl(name, operator.cuda, "CUDA")
    torch.library.register_fake(f"cfbnn::{name}", operator.fake, lib=LIBRARY)
    op = getattr(torch.ops.cfbnn, name).default
    object.__setattr__(operator, "op", op)
    if operator.backward is not None:
        LIBRARY.impl(name, _autograd_kernel(operator), "Autograd", with_keyset=True)
    if operator.vmap is not None:
        torch.library.register_vmap(f"cfbnn::{name}", operator.vmap, lib=LIBRARY)
    OPERATORS[name] = operator
    return op


# ----------------------------------------------------------------------------- what operators share


def check_operands(name: str, *tensors: Tensor) -> None:
    """Every tensor of the first one's shape and of one dtype, float32 or float64 (a ``ValueError``
    naming ``cfbnn::<name>``)."""
    first = tensors[0]
    for tensor in tensors:
        if tensor.shape != first.shape:
            raise ValueError(f"cfbnn::{name}: every tensor must have the shape of `mean` {tuple(first.shape)}")
        if tensor.dtype != first.dtype or tensor.dtype not in FLOATS:
            raise ValueError(f"cfbnn::{name}: tensors must share one dtype, float32 or float64; got {tensor.dtype}")


def absent_gradient(like: Tensor) -> Tensor:
    """The gradient of an output nothing used: one zero expanded to ``like``'s shape, which the
    kernels read as a scalar (the C++ one as no gradient at all) instead of a block of zeros."""
    return like.new_zeros(()).expand(like.shape)


def differentiable_by_formula(formula: Callable, tensor_count: int) -> Dict[str, Callable]:
    """The autograd of a backward operator whose own derivative is that of ``formula`` (its arguments,
    its results, in differentiable torch ops) through ``torch.func.vjp``: a graph of a backward
    (``create_graph=True``, nested ``torch.func.grad``) is then differentiable to any order. The first
    ``tensor_count`` arguments are tensors (``None`` allowed), the rest numbers. ``{"setup_context":
    ..., "backward": ...}`` for :class:`Operator`."""

    def setup_context(ctx, inputs, output):
        ctx.parameters = inputs[tensor_count:]
        ctx.save_for_backward(*inputs[:tensor_count])

    def backward(ctx, *grads):
        inputs = ctx.saved_tensors
        outputs, vjp = torch.func.vjp(lambda *tensors: formula(*tensors, *ctx.parameters), *inputs)
        cotangents = tuple(torch.zeros_like(out) if g is None else g for g, out in zip(grads, outputs))
        return (*vjp(cotangents), *(None,) * len(ctx.parameters))

    return {"setup_context": setup_context, "backward": backward}


def batch_first(info, in_dims, *tensors: Tensor) -> Tuple[Tensor, ...]:
    """A vmap rule's operands with the vmapped dimension first (an unbatched one expanded to the batch)."""
    return tuple(
        t.movedim(d, 0) if d is not None else t.unsqueeze(0).expand(info.batch_size, *t.shape)
        for t, d in zip(tensors, in_dims)
    )


def elementwise_vmap(name: str, count: int, tensors: int) -> Callable:
    """The vmap rule of the elementwise operator ``cfbnn::<name>`` with ``count`` outputs: its first
    ``tensors`` arguments with the vmapped dimension first (an unbatched one expanded), made
    contiguous, one call on the batch; the other arguments (a slope, a table) as they are."""

    def rule(info, in_dims, *arguments):
        if any(d is not None for d in in_dims[tensors:]):
            raise NotImplementedError(f"cfbnn::{name}: vmap over its non-elementwise arguments is not supported")
        moved = [t.contiguous() for t in batch_first(info, in_dims[:tensors], *arguments[:tensors])]
        output = getattr(torch.ops.cfbnn, name)(*moved, *arguments[tensors:])
        return output, (0 if count == 1 else (0,) * count)

    return rule
