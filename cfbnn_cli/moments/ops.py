"""The ReLU family's moments as one torch operator: ``torch.ops.cfbnn.relu_family_moments``.

Registered through :mod:`torch.library`, so the dispatcher (not hand-written checks)
picks the kernel by device, and ``torch.compile``, CUDA graphs, ``torch.func`` and
``opcheck`` see one operator:

``cfbnn::relu_family_moments(Tensor mean, Tensor spread, int activation, float negative_slope, bool from_variance) -> (Tensor phi, Tensor upsilon, Tensor variance)``
    ``(E[g(z)], E[g(z)^2], Var[g(z)])`` for ``z ~ N(mean, std^2)`` elementwise, ``g`` the ReLU
    family's member ``activation`` (:data:`.relu_family.ACTIVATION_KINDS`: 0 ReLU, paper eq. (20);
    1 leaky ReLU of slope ``negative_slope``, eqs. (21), (22); 2 ReLU^2, eqs. (28), (29));
    ``spread`` the standard deviation, or with ``from_variance`` the variance (the square root
    taken inside the kernel, the variance floored at the dtype's smallest normal number: the
    propagated hidden layers of the deterministic estimator). ``mean`` and ``spread`` of one
    shape, dtype float32 or float64; for float32 the slope is the float32 number torch's float32
    arithmetic multiplies by.
``cfbnn::relu_family_moments_backward(mean, spread, phi, grad_phi, grad_upsilon, grad_variance, activation, negative_slope, from_variance) -> (grad_mean, grad_spread)``
    its vector-Jacobian product (the Gaussian factors recomputed; no gradient through Var where its
    clamp at 0 bites; from the variances ``phi`` is unread).
(The KL of a mean-field matrix: :mod:`.kl_ops`.)

Kernels:

* CPU: the C++ kernels of ``csrc/cfbnn_moments.cpp`` (:mod:`cfbnn_cli.moments.kernel_build`),
  or the reference torch ops where they did not build;
* CUDA (and any device Triton targets): the Triton kernels of
  :mod:`cfbnn_cli.moments.triton_kernels` (one launch each way); without Triton, the
  reference torch ops.

Autograd: the backward op (on the CPU the C++ ``MomentsAutograd``). Where a graph of the backward
is wanted (``create_graph=True``, and always under ``torch.func.grad``) the backward is still its
kernel, inside :class:`~.operator_registration.KernelVJP`, whose own derivative is the formula
:func:`.relu_family.family_moments_vjp` in differentiable torch ops. ``vmap``: elementwise, so a
batched call is one call on the batch. The activation is an argument, so every member shares one
schema, one set of registrations and one kernel each way per device.
"""

from __future__ import annotations

import importlib
import logging
from typing import Callable, Dict, Tuple

import torch
from torch import Tensor

from . import kernel_library
from .operator_registration import (
    _FLOATS,
    HAVE_TRITON,
    define_moments_operators,
    moments_function,
)
from .relu_family import (
    ACTIVATION_KINDS,
    check_activation,
    family_moments_vjp,
    reference_family_moments,
    slope_for,
    variance_floor,
)


class LazyModule:
    """A module imported on its first attribute access: ``triton`` and the Triton kernel modules,
    which importing :mod:`cfbnn_cli.moments` does not pull in (``import triton`` costs about 0.3 s
    of a CPU-only start-up; ``tests/moments/test_import_cost.py``). They are imported by the first
    Triton launch (a CUDA tensor, or a CPU tensor inside :func:`.cuda_twin.cuda_twin`, whose
    ``TRITON_INTERPRET=1`` must be set before Triton is imported)."""

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


triton = LazyModule("triton")
triton_kernels = LazyModule(f"{__package__}.triton_kernels")
triton_tail_kernels = LazyModule(f"{__package__}.triton_tail_kernels")
triton_kl_kernels = LazyModule(f"{__package__}.triton_kl_kernels")

__all__ = [
    "ACTIVATION_KINDS",
    "HAVE_TRITON",
    "family_moments_function",
    "launch_moments",
    "launch_moments_backward",
    "relu_family_moments",
    "relu_family_moments_backward",
    "slope_for",
    "triton_family_moments",
    "triton_family_moments_backward",
    "variance_floor",
]

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- Triton launches


def slope_operand(mean: Tensor, activation: int, negative_slope: float) -> Tensor:
    """The Triton kernels' slope operand for ``activation``: leaky ReLU's :func:`slope_tensor`; the
    others read no slope and get ``mean`` (unread), not one more fill kernel."""
    return slope_tensor(mean, negative_slope) if activation == ACTIVATION_KINDS["leaky_relu"] else mean


def _constants(mean: Tensor, activation: int, from_variance: bool) -> tuple:
    # the moments kernels' compile-time arguments, after their operands
    floor, depth = variance_floor(mean.dtype), triton_kernels.cf_depth(mean.dtype)
    return activation, from_variance, floor, triton_kernels.BLOCK, depth


def launch_moments(mean: Tensor, spread: Tensor, activation: int, negative_slope: float = 0.0, from_variance=False):
    """``(Phi, Upsilon, Var)`` of the ReLU family's ``activation`` (:data:`ACTIVATION_KINDS`) by the
    Triton :func:`~.triton_kernels.moments_kernel` on ``mean``'s device (CUDA; the CPU under
    ``TRITON_INTERPRET=1``); ``spread`` the standard deviation, or with ``from_variance`` the variance."""
    mean, spread = mean.contiguous(), spread.contiguous()
    phi, ups, var = (torch.empty_like(mean) for _ in range(3))
    n = mean.numel()
    slope = slope_operand(mean, activation, negative_slope)
    operands = (mean, spread, slope, phi, ups, var, n)
    triton_kernels.moments_kernel[triton_kernels.grid(n)](*operands, *_constants(mean, activation, from_variance))
    return phi, ups, var


def launch_moments_backward(mean, spread, phi, grads, activation: int, negative_slope=0.0, from_variance=False):
    """The Triton vector-Jacobian product of :func:`launch_moments` for ``grads = (grad_phi,
    grad_upsilon, grad_variance)`` (``phi`` unread with ``from_variance``: recomputed)."""
    tensors = [t.contiguous() for t in (mean, spread, phi, *grads)]
    grad_mean, grad_spread = torch.empty_like(tensors[0]), torch.empty_like(tensors[0])
    n = mean.numel()
    slope = slope_operand(tensors[0], activation, negative_slope)
    operands = (*tensors[:2], slope, *tensors[2:], grad_mean, grad_spread, n)
    triton_kernels.moments_backward_kernel[triton_kernels.grid(n)](
        *operands, *_constants(mean, activation, from_variance)
    )
    return grad_mean, grad_spread


def triton_family_moments(mean, spread, activation, negative_slope, from_variance):
    """The operator's Triton forward on ``mean``'s device (CUDA; the CPU under ``TRITON_INTERPRET=1``)."""
    check_activation("relu_family_moments", activation)  # (a kernel would read any other number as ReLU^2)
    return launch_moments(mean, spread, activation, negative_slope, from_variance)


def triton_family_moments_backward(
    mean, spread, phi, grad_phi, grad_ups, grad_var, activation, negative_slope, from_variance
):
    """Its Triton vector-Jacobian product."""
    check_activation("relu_family_moments_backward", activation)
    return launch_moments_backward(
        mean, spread, phi, (grad_phi, grad_ups, grad_var), activation, negative_slope, from_variance
    )


# ----------------------------------------------------------------------------- the operator

# One operator with a kernel per device (torch.library.custom_op), not torch.library.triton_op:
# a triton_op has one implementation for every device and is decomposed into its Triton launch
# under torch.compile whatever the tensors' device, so it cannot hold the C++ CPU kernel beside it.
relu_family_moments, relu_family_moments_backward = define_moments_operators(
    "relu_family_moments",
    ", int activation, float negative_slope, bool from_variance",
    triton_family_moments,
    triton_family_moments_backward,
    reference_family_moments,
    family_moments_vjp,
    spread="spread",
)


def family_moments_function(mean: Tensor, std: Tensor, activation: int, negative_slope=0.0, from_variance=False):
    """``(Phi, Upsilon, Var)`` of broadcastable ``mean``, ``std`` (or variance, ``from_variance``)
    through the operator (autograd and ``torch.func`` included)."""
    parameters = (int(activation), float(negative_slope), bool(from_variance))
    return moments_function(
        relu_family_moments, relu_family_moments_backward, family_moments_vjp, mean, std, *parameters
    )


# the device types whose cfbnn:: operators run the Triton kernels: CUDA; the CPU as well inside
# :func:`cfbnn_cli.moments.cuda_twin.cuda_twin` (the CUDA route on the CPU, for the tests)
TRITON_DEVICE_TYPES = {"cuda"}


def triton_device(device: torch.device) -> bool:
    """Whether the ``cfbnn::`` operators take their Triton kernels on ``device`` (CUDA; see
    :data:`TRITON_DEVICE_TYPES`): every route decision asks this, not the device type."""
    return device.type in TRITON_DEVICE_TYPES


def device_kernels_apply(mean: Tensor) -> bool:
    """Whether the ``cfbnn::`` operators take their Triton kernels for ``mean`` off the CPU (CUDA):
    the kernels are not switched off (:func:`cfbnn_cli.moments.fast_path`: one switch for every
    device), and Triton's first run on that device and dtype succeeded (:func:`_self_check`, once,
    for every operator and node)."""
    return (
        kernel_library.fast_path_enabled()
        and HAVE_TRITON
        and triton_device(mean.device)
        and mean.dtype in _FLOATS
        and first_use_check("the Triton kernels of the cfbnn:: operators", mean.device, mean.dtype, _self_check)
    )


def operator_route(mean: Tensor) -> bool:
    """Whether an activation's moments take its ``cfbnn::`` operator for ``mean``: on CUDA where
    :func:`device_kernels_apply`; on the CPU for float32/float64 unless the reference path is chosen
    (:func:`cfbnn_cli.moments.fast_path`): the dispatcher then runs the C++ kernels, or the
    reference kernels where the library did not build; inside ``torch.compile`` too (its graph
    calls the operators)."""
    if triton_device(mean.device):
        return device_kernels_apply(mean)
    return mean.device.type == "cpu" and mean.dtype in _FLOATS and kernel_library.fast_path_enabled()


def check_samples(device: torch.device, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """A first-use check's operands: eight well-conditioned means and spreads."""
    values = torch.linspace(-3.0, 3.0, 8, dtype=dtype, device=device)
    return values, torch.linspace(0.5, 2.0, 8, dtype=dtype, device=device)


def require_finite(*outputs: Tensor) -> None:
    """What a first-use check asks of its kernels' results (on :func:`check_samples`)."""
    if not all(bool(torch.isfinite(t).all()) for t in outputs):
        raise FloatingPointError("non-finite values on a well-conditioned problem")


def slope_tensor(mean: Tensor, negative_slope: float) -> Tensor:
    """Leaky ReLU's slope for the Triton kernels, as its kernels take it for ``mean``'s dtype
    (:func:`slope_for`): read by them as float64 (a Triton float argument would
    be float32); filled on the device, so a launch inside a CUDA graph capture needs no copy from
    the host."""
    return torch.full((1,), slope_for(negative_slope, mean.dtype), dtype=torch.float64, device=mean.device)


# (what, device, dtype) -> whether a first-use check passed there: a visible cache, filled once per
# device and dtype in an eager call (nothing is tried inside a CUDA graph capture)
FIRST_USE: Dict[Tuple[str, torch.device, torch.dtype], bool] = {}


def first_use_check(what: str, device: torch.device, dtype: torch.dtype, check: Callable) -> bool:
    """``check(device, dtype)`` once per ``(what, device, dtype)``: ``True`` where it returned,
    ``False`` where it raised (a Triton or driver that does not compile the kernels, say), with one
    warning naming the error; the callers then take their reference route -- never a failed run."""
    key = (what, device, dtype)
    if key not in FIRST_USE:
        if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return False  # nothing is tried inside a capture or a trace (the eager call before decides)
        try:
            # The first use may come inside torch.func transforms (the gradient draws'
            # vmap(grad(...))), where even the check's fresh tensors would be functorch wrappers
            # without storage, which no kernel launch can read: the check runs outside them. It
            # may also come inside a prediction (no_grad, inference_mode), where a check that
            # takes gradients would fail and rule the kernels out for the whole process.
            with torch._C._DisableFuncTorch(), torch.inference_mode(False), torch.enable_grad():
                check(device, dtype)
            FIRST_USE[key] = True
        except Exception as error:  # noqa: BLE001 - any failure means: take the other route
            FIRST_USE[key] = False
            text = str(error).strip()
            log.warning(
                "%s failed on %s (%s); the reference route is used there",
                what,
                device,
                f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:300],
            )
    return FIRST_USE[key]


def _self_check(device: torch.device, dtype: torch.dtype) -> None:
    """The first-use check of Triton on a device (:func:`device_kernels_apply`): ReLU's moments
    kernels forward and backward, from the standard deviations and from the variances, on
    :func:`check_samples` (compiling them). One check for every kernel: a device where Triton runs
    these takes every operator's Triton kernel, and a kernel that then fails raises where it is
    called rather than falling back unseen."""
    values, spread = check_samples(device, dtype)
    grads = (spread, spread, spread)
    outputs = []
    for from_variance in (False, True):
        outputs += launch_moments(values, spread, 0, from_variance=from_variance)
        outputs += launch_moments_backward(values, spread, values, grads, 0, from_variance=from_variance)
    require_finite(*outputs)
