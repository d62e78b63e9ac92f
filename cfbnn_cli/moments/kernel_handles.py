"""Each activation's handle on the C++ kernels (:mod:`.kernel_library`): its forward pass (Phi,
Upsilon, Var) and its backward pass, with what it saves between them -- inputs and Phi,
recomputing the Gaussian factors block by block (ReLU, leaky ReLU, ReLU^2, the float32 hard
sigmoid), or the four partial derivatives (the general piecewise-polynomial engine).
:mod:`.fast` wraps a handle in autograd functions."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .gaussian import (
    standard_normal_cdf,
    standard_normal_pdf,
    standardize,
)
from .kernel_library import DTYPE_SUFFIX, KernelState, data_pointer, gradient_pointer, kernel_function, plain_tensors
from .piecewise_tables import coefficient_tables

__all__ = [
    "KernelHandle",
    "ReLUOp",
    "LeakyReLUOp",
    "ReLUSquaredOp",
    "IdentityOp",
    "PiecewiseOp",
    "HardSigmoidOp",
    "placeholder",
    "reference_vjp",
]


class KernelHandle:
    """One activation's kernels: forward -> (phi, ups, var, *saved); backward -> (d mean, d std)."""

    tail_kind: Optional[int] = None  # the kernel of :func:`normal_tail` for this activation (None: none)
    # the backward kernel needs only (mean, std, Phi, grads): it can be a function of its own
    # (:class:`~.fast._KernelBackward`), which a backward pass that builds a graph still runs
    backward_from_inputs = False

    def kernel_parameters(self, dtype):
        """The activation's parameters, as its kernels take them (none by default)."""
        return ()

    def __init__(self, reference):
        # reference(mean, std) -> (phi, ups, var) through the eager torch path (differentiable)
        self.reference = reference

    def forward(self, mean, std, want_var, need_grad):  # pragma: no cover - abstract
        raise NotImplementedError

    def backward(self, mean, std, phi, saved, grads):  # pragma: no cover - abstract
        raise NotImplementedError

    def differentiable_backward(self, mean, std, phi, grads):
        """(d mean, d std) built from differentiable ops (double backward, torch.func): by default
        the vector-Jacobian product of the reference path."""
        return reference_vjp(self, mean, std, grads)


def backward_call(function, like: torch.Tensor, leading, grads):
    """``(d mean, d std)`` shaped as ``like`` from a backward kernel ``function(*leading, <the
    gradients of Phi, Upsilon and Var as (pointer, is_scalar) pairs>, gm, gs, threads)``."""
    gm = torch.empty(like.shape, dtype=like.dtype)
    gs = torch.empty(like.shape, dtype=like.dtype)
    # (pointer, is_scalar, the tensor behind the pointer: held in `pointers` until the call ends)
    pointers = [gradient_pointer(g) for g in grads]
    arguments = [value for pointer, scalar, _ in pointers for value in (pointer, scalar)]
    function(*leading, *arguments, gm.data_ptr(), gs.data_ptr(), torch.get_num_threads())
    return gm, gs


def _outputs(mean, count):
    return [torch.empty(mean.shape, dtype=mean.dtype) for _ in range(count)]


def _partials_backward(phi, saved, grads, torch_ops=False, plain=False):
    """(d mean, d std) from the partials (dPhi/dm, dPhi/ds, dVar/dm, dVar/ds); Ups = Var + Phi^2."""
    pm, ps, vm, vs = saved
    gp, gu, gv = grads
    if not torch_ops and (plain or (plain_tensors(phi, pm, gp, gu, gv) and KernelState.library is not None)):
        leading = (phi.numel(), phi.data_ptr(), pm.data_ptr(), ps.data_ptr(), vm.data_ptr(), vs.data_ptr())
        return backward_call(kernel_function("partials_backward", phi.dtype), phi, leading, grads)
    first = _combine(gp, None if gu is None else 2.0 * phi * gu)
    second = _combine(gu, gv)
    return _combine(_mul(pm, first), _mul(vm, second)), _combine(_mul(ps, first), _mul(vs, second))


def _mul(a, b):
    return None if b is None else a * b


def _combine(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def recomputing_forward(function, mean, std, parameters, want_var: bool, empty_slots: int):
    """``(Phi, Upsilon, Var or a placeholder)`` from a forward kernel that saves nothing:
    ``function(n, mean, std, *parameters, phi, ups, var, <empty_slots NULLs>, threads)``."""
    phi = torch.empty(mean.shape, dtype=mean.dtype)
    ups = torch.empty(mean.shape, dtype=mean.dtype)
    var = torch.empty(mean.shape, dtype=mean.dtype) if want_var else None
    function(
        mean.numel(),
        mean.data_ptr(),
        std.data_ptr(),
        *parameters,
        phi.data_ptr(),
        ups.data_ptr(),
        data_pointer(var),
        *(None,) * empty_slots,
        torch.get_num_threads(),
    )
    return phi, ups, var if var is not None else placeholder(mean)


def recomputing_backward(function, mean, std, phi, parameters, grads):
    """``(d mean, d std)`` from a backward kernel that recomputes the partial derivatives from the
    inputs and Phi: ``function(n, mean, std, *parameters, phi, <three gradients>, gm, gs, threads)``."""
    leading = (mean.numel(), mean.data_ptr(), std.data_ptr(), *parameters, phi.data_ptr())
    return backward_call(function, mean, leading, grads)


class _RecomputingOp(KernelHandle):
    """ReLU, leaky ReLU and ReLU^2: nothing saved but the inputs and Phi; the backward kernel
    recomputes the partial derivatives per block (one cheap forward pass) instead of allocating,
    writing and re-reading four buffers."""

    saved_count = 0
    kernel = ""
    backward_from_inputs = True
    forward_slots = 4  # the forward kernel's trailing outputs left empty (partials it need not save)

    def forward(self, mean, std, want_var, need_grad):
        function = kernel_function(self.kernel + "_forward", mean.dtype)
        return recomputing_forward(
            function, mean, std, self.kernel_parameters(mean.dtype), want_var, self.forward_slots
        )

    def backward(self, mean, std, phi, saved, grads, plain=False):
        if plain or (plain_tensors(mean, *grads) and KernelState.library is not None):
            function = kernel_function(self.kernel + "_backward", mean.dtype)
            return recomputing_backward(function, mean, std, phi, self.kernel_parameters(mean.dtype), grads)
        return self.fallback_backward(mean, std, phi, grads)

    def fallback_backward(self, mean, std, phi, grads):
        # wrapped tensors without create_graph: the reference's vector-Jacobian product
        return reference_vjp(self, mean, std, grads, create_graph=False)


class ReLUOp(_RecomputingOp):
    """ReLU: the forward saves nothing beyond its inputs and Phi; the backward kernel recomputes
    the two Gaussian factors block by block (cheaper than allocating, writing and re-reading
    them: on this path memory traffic and fresh pages cost more than an exp)."""

    kernel = "relu"
    tail_kind = 0
    forward_slots = 2

    def fallback_backward(self, mean, std, phi, grads):
        with torch.no_grad():
            return self.differentiable_backward(mean, std, phi, grads)

    def differentiable_backward(self, mean, std, phi, grads):
        # as relu_reference.ReLUMomentsReference: the Gaussian factors recomputed differentiably, the saved
        # Phi (an output of this Function, so itself differentiable) reused
        t, _, _ = standardize(mean, std)
        cdf, cdf_neg, pdf = standard_normal_cdf(t), standard_normal_cdf(-t), standard_normal_pdf(t)
        partials = (cdf, pdf, 2.0 * phi * cdf_neg, 2.0 * (std * cdf - phi * pdf))
        return _partials_backward(phi, partials, grads, torch_ops=True)


class _PartialsOp(KernelHandle):
    """Kernels that save the four partial derivatives (leaky relu, relu squared, piecewise)."""

    saved_count = 4

    def backward(self, mean, std, phi, saved, grads, plain=False):
        return _partials_backward(phi, saved, grads, plain=plain)


def slope_for(negative_slope: float, dtype: torch.dtype) -> float:
    """Leaky ReLU's slope as its kernels take it: for float32 tensors the float32 number float32
    torch arithmetic multiplies by."""
    return float(np.float32(negative_slope)) if dtype == torch.float32 else float(negative_slope)


class LeakyReLUOp(_RecomputingOp):
    kernel = "leaky"
    tail_kind = 1

    def __init__(self, reference, negative_slope):
        super().__init__(reference)
        self.negative_slope = negative_slope

    def kernel_parameters(self, dtype):
        return (slope_for(self.negative_slope, dtype),)


class ReLUSquaredOp(_RecomputingOp):
    kernel = "relusq"
    tail_kind = 2


class IdentityOp(KernelHandle):
    saved_count = 0

    def forward(self, mean, std, want_var, need_grad):
        return recomputing_forward(kernel_function("identity_forward", mean.dtype), mean, std, (), want_var, 0)

    def differentiable_backward(self, mean, std, phi, grads):
        return self.backward(mean, std, phi, (), grads)

    def backward(self, mean, std, phi, saved, grads, plain=False):
        gp, gu, gv = grads
        # Phi = mean, Var = std^2, Ups = Var + Phi^2
        grad_mean = _combine(gp, None if gu is None else 2.0 * phi * gu)
        second = _combine(gu, gv)
        grad_std = None if second is None else 2.0 * std * second
        return grad_mean, grad_std


class PiecewiseOp(_PartialsOp):
    def __init__(self, reference, breakpoints, polynomials):
        super().__init__(reference)
        self.tables = {dtype: coefficient_tables(breakpoints, polynomials, dtype) for dtype in DTYPE_SUFFIX}

    def forward(self, mean, std, want_var, need_grad):
        phi, ups = _outputs(mean, 2)
        var = torch.empty(mean.shape, dtype=mean.dtype) if want_var else None
        saved = _outputs(mean, 4) if need_grad else [None] * 4
        tables = self.tables[mean.dtype]
        kernel_function("pw_forward", mean.dtype)(
            mean.numel(),
            mean.data_ptr(),
            std.data_ptr(),
            tables["B"],
            tables["D"],
            *(
                tables[key].ctypes.data
                for key in ("bp", "coef", "deriv", "side", "tails", "jumps", "gl", "coef32", "bp32")
            ),
            phi.data_ptr(),
            ups.data_ptr(),
            data_pointer(var),
            *(data_pointer(t) for t in saved),
            torch.get_num_threads(),
        )
        return (phi, ups, var if var is not None else placeholder(mean), *(t for t in saved if t is not None))


class HardSigmoidOp(PiecewiseOp):
    """The hard sigmoid: the engine's sums unrolled in one float32 kernel (the engine itself for
    float64 and, inside the kernel, for the rare elements it hands over). In float32 nothing is
    saved: the backward kernel recomputes the partials per block."""

    def __init__(self, reference, alpha, breakpoints, polynomials):
        super().__init__(reference, breakpoints, polynomials)
        self.a = float(np.float32(abs(alpha)))
        self.sign = 1.0 if alpha >= 0 else -1.0

    def _tables(self, dtype):
        tables = self.tables[dtype]
        return (tables["B"], tables["D"]) + tuple(
            tables[key].ctypes.data for key in ("bp", "coef", "deriv", "side", "tails", "jumps", "gl", "coef32", "bp32")
        )

    def forward(self, mean, std, want_var, need_grad):
        if mean.dtype != torch.float32:
            return super().forward(mean, std, want_var, need_grad)
        parameters = (*self._tables(mean.dtype), self.a, self.sign)
        return recomputing_forward(KernelState.library.hs_forward_f32, mean, std, parameters, want_var, 4)

    def backward(self, mean, std, phi, saved, grads, plain=False):
        if mean.dtype != torch.float32:
            return super().backward(mean, std, phi, saved, grads, plain=plain)
        if not (plain or (plain_tensors(mean, *grads) and KernelState.library is not None)):
            return reference_vjp(self, mean, std, grads, create_graph=False)
        parameters = (*self._tables(mean.dtype), self.a, self.sign)
        return recomputing_backward(KernelState.library.hs_backward_f32, mean, std, phi, parameters, grads)


def placeholder(mean):
    """Stands in for an output that was not asked for (the variance)."""
    return mean.new_empty((0,))


def reference_vjp(op, mean, std, grads, create_graph=True):
    """The vector-Jacobian product of the reference path (differentiable with create_graph)."""
    inputs = [t for t in (mean, std) if t.requires_grad]
    if not inputs:
        return None, None
    with torch.enable_grad():
        outputs = op.reference(mean, std)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        if not pairs:
            return None, None
        found = torch.autograd.grad(
            [o for o, _ in pairs], inputs, [g for _, g in pairs], create_graph=create_graph, allow_unused=True
        )
    found = iter(found)
    grad_mean = next(found) if mean.requires_grad else None
    grad_std = next(found) if std.requires_grad else None
    return grad_mean, grad_std
