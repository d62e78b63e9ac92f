"""Every Triton kernel launch of the CUDA route, recorded on the CPU, and each one compiled for an
H100/H200 (sm_90a) without a GPU: test_every_kernel_compiles.py's helpers.

Run as a script in a process started with ``TRITON_INTERPRET=1``, it runs a small workload inside
the CUDA twin (:func:`cuda_twin.cuda_twin`, tests/cuda_twin.py: the ELBOs of
one and two hidden layers and their gradients, the per-point ELL, the predictions, the KL
operators, the moments and their backward passes) and prints each distinct launch as JSON: the
kernel, the type of each argument as Triton's JIT binds it for a CUDA device (``*fp32``,
``i32``/``i64`` by value, ``fp64`` where the kernel annotates one, tuples of these), the value of
each constexpr and the launch options (``num_warps``), from the JIT's own binder
(:func:`triton.runtime.jit.create_function_from_signature`), not from signatures written by hand.
What the JIT adds on a GPU from the data's sizes (an int argument equal to 1 as a constexpr, but
inside a tuple, which the JIT always specializes; divisibility hints) is left out: one compilation
per route, whatever the sizes.
:func:`compile_launch` compiles one such launch with Triton's compiler and its bundled ptxas."""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

KERNEL_MODULES = ("triton_kernels", "triton_tail_kernels", "triton_kl_kernels", "triton_predict_kernels")
PACKAGE = "cfbnn_cli.moments"
SOURCES = Path(__file__).resolve().parents[2] / "cfbnn_cli" / "moments"
ACTIVATIONS = {"relu": {}, "leaky_relu": {"negative_slope": -0.5}, "relu_squared": {}}


def _is_jit(function: ast.FunctionDef) -> bool:
    return any(ast.unparse(decorator).startswith("triton.jit") for decorator in function.decorator_list)


def launched_kernels() -> set:
    """``{(module, name)}``: the ``@triton.jit`` functions of the kernel modules that no other one
    calls -- the kernels a launcher gives a grid; the others are helpers, compiled inside them."""
    functions, called = {}, set()
    for module in KERNEL_MODULES:
        tree = ast.parse((SOURCES / f"{module}.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and _is_jit(node):
                functions[node.name] = f"{PACKAGE}.{module}"
                for call in ast.walk(node):
                    if isinstance(call, ast.Call):
                        target = call.func
                        called.add(target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", ""))
    return {(module, name) for name, module in functions.items() if name not in called}


# ----------------------------------------------------------------------------- recording


def _plain(value):
    """A type or a constexpr's value as JSON keeps it (str, bool, int, float, None), tuples as lists."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise TypeError(f"a value of type {type(value).__name__} is not recorded: {value!r}")


_BINDERS = {}  # a kernel's JITFunction and binder, made once


def _describe_launch(function, jit_options: dict, args, kwargs) -> dict:
    """The kernel of ``function[grid](*args, **kwargs)``, its arguments' types and its constexprs'
    values as Triton's JIT binds them for a CUDA device (its binder, packed as
    ``JITFunction._pack_args`` packs it), every argument unspecialized: a type by value (an int
    equal to 1 stays ``i32``, no divisibility hints), as :func:`triton.runtime.jit.mangle_type` names
    it, or the kernel's own annotation (``prior_variance: tl.float64``)."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, create_function_from_signature, find_paths_if, get_iterable_path

    if function not in _BINDERS:
        unspecialized = dict(jit_options, do_not_specialize=list(inspect.signature(function).parameters))
        jit = JITFunction(function, **unspecialized)
        _BINDERS[function] = jit, create_function_from_signature(jit.signature, jit.params, CUDABackend)
    jit, binder = _BINDERS[function]
    bound, specialization, options = binder(*args, **kwargs)
    types = [kind for kind, _ in specialization]
    constexpr_paths = find_paths_if(types, lambda _, kind: kind == "constexpr")
    return {
        "module": function.__module__,
        "kernel": function.__name__,
        "signature": dict(zip(jit.arg_names, (_plain(kind) for kind in types))),
        "constexprs": [[list(path), _plain(get_iterable_path(list(bound.values()), path))] for path in constexpr_paths],
        "options": {name: _plain(value) for name, value in options.items()},  # num_warps, ...
    }


def record_launches(launches: list):
    """Append each interpreted launch's description to ``launches`` (patches the interpreter's
    launch path, ``InterpretedFunction.run``); returns the function that restores it."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recorded(self, *args, grid, warmup, **kwargs):
        if not warmup:
            launches.append(_describe_launch(self.fn, self.kwargs, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recorded
    return lambda: setattr(InterpretedFunction, "run", run)


# ----------------------------------------------------------------------------- the workload


def _network(hidden, dtype, activation, output_bias=True):
    import torch

    from cfbnn_cli.bnn import BayesianNetwork
    from cfbnn_cli.bnn.likelihoods import NormalLikelihood
    from cfbnn_cli.moments import get_activation

    torch.manual_seed(0)
    net = BayesianNetwork(
        4,
        hidden,
        likelihood=NormalLikelihood(2.0, True),
        prior_scale=0.9,
        activation=get_activation(activation, **ACTIVATIONS[activation]),
        output_bias=output_bias,
    )
    with torch.no_grad():
        for layer in net.layers:
            layer.loc.normal_(0.0, 1.0)
            layer.log_scale.uniform_(-4.0, 0.5)
    return net.to(dtype)


def _objectives(dtype, activation, rows: int, width: int) -> None:
    """The ELBO of one hidden layer (``NormalELBO``) and of two (``NormalELL`` under ``analytic``,
    ``DeepNormalELBO`` under ``deterministic``), the per-point ELL, with and without the output
    bias, each with its gradients and without (the tail pass with its gradients taken ahead or not)."""
    import torch

    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randn(rows, *shape, generator=generator, dtype=dtype) for shape in ((4,), ()))
    for output_bias in (True, False):
        for hidden, estimator in (([width], "analytic"), ([6, width], "analytic"), ([6, width], "deterministic")):
            net = _network(hidden, dtype, activation, output_bias)
            noise = net.sample_noise(rows, estimator=estimator, generator=torch.Generator().manual_seed(4)) or None
            for value in (
                net.elbo(x, y, num_data=100, noise=noise, estimator=estimator),
                net.expected_log_likelihood_per_point(x, y, noise=noise, estimator=estimator).sum(),
            ):
                torch.autograd.grad(value, list(net.parameters()))
            with torch.no_grad():
                net.elbo(x, y, num_data=100, noise=noise, estimator=estimator)


def _predictions(dtype, activation, rows: int, width: int) -> None:
    """The moments propagated through two hidden layers, the exact mean of one (with and without
    the output bias), the predictive, and the Figure 1 head's deterministic prediction (its point
    layer's activation folded into the prediction operand)."""
    import torch

    from cfbnn_cli.bnn import bayesian_head
    from cfbnn_cli.moments import get_activation

    x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(2), dtype=dtype)
    torch.manual_seed(0)
    head = bayesian_head(4, [6, width], 3, activation=get_activation(activation, **ACTIVATIONS[activation]))
    with torch.no_grad():
        deep = _network([6, width], dtype, activation)
        deep.output_moments(x, estimator="deterministic")
        deep.predict(x, estimator="deterministic")
        for output_bias in (True, False):
            _network([width], dtype, activation, output_bias).output_mean(x)
        head.to(dtype).output_mean(x)


def _prediction_tiles(dtype, activation, widths) -> None:
    """The prediction operators over layers of each of ``widths``, with the column of ones and
    without: their tile, ``(1024 / BLOCK_C, BLOCK_C)`` with ``BLOCK_C`` the next power of two of the
    columns up to 128 (:func:`~cfbnn_cli.moments.triton_predict_kernels.tile`), is a constexpr a
    layer's width picks."""
    import torch

    from cfbnn_cli.moments.predict_ops import NO_ACTIVATION
    from cfbnn_cli.moments.relu_family import ACTIVATION_KINDS

    cfbnn, code = torch.ops.cfbnn, ACTIVATION_KINDS[activation]
    slope = ACTIVATIONS[activation].get("negative_slope", 0.0)
    generator = torch.Generator().manual_seed(5)
    for width in widths:
        inputs = torch.randn(3, width, generator=generator, dtype=dtype)
        for bias in (True, False):
            for folded in {NO_ACTIVATION, code}:
                cfbnn.prediction_operand(inputs, folded, slope, bias)
            cfbnn.prediction_hidden_mean(torch.stack([inputs, inputs.square()]), code, slope, bias)


def _operators(dtype, activation, count: int) -> None:
    """The moments operators with their backward passes (from the std; ReLU's from the variance
    too), the activation's mean alone, and the mean-field KL with its backward."""
    import torch

    from cfbnn_cli.moments import get_activation

    cfbnn = torch.ops.cfbnn
    generator = torch.Generator().manual_seed(3)
    mean = (torch.randn(count, generator=generator, dtype=dtype) * 3).requires_grad_()
    std = (torch.rand(count, generator=generator, dtype=dtype) + 0.1).requires_grad_()
    function = get_activation(activation, **ACTIVATIONS[activation])
    moments = list(function.moments(mean, std, return_variance=True))
    if activation == "relu":
        moments += list(cfbnn.relu_family_moments(mean, std.square(), 0, 0.0, True))
    torch.autograd.grad(sum(m.sum() for m in moments), [mean, std])
    with torch.no_grad():
        function.mean(mean, std)
    loc = torch.randn(3, count, generator=generator, dtype=dtype).requires_grad_()
    log_scale = (torch.randn(3, count, generator=generator, dtype=dtype) - 2).requires_grad_()
    torch.autograd.grad(cfbnn.diagonal_kl(loc, log_scale, 0.8), [loc, log_scale])


def record(dtypes, activations, tile_widths, rows: int = 5, width: int = 8) -> list:
    """The distinct launches of the workload in each of ``dtypes`` (torch dtype names) and
    ``activations`` (:data:`ACTIVATIONS`' names), the prediction operators over layers of each of
    ``tile_widths`` too, in the order first launched."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (tests/: the CUDA twin)
    from cuda_twin import cuda_twin

    launches = []
    restore = record_launches(launches)
    try:
        with cuda_twin():
            for dtype in (getattr(torch, name) for name in dtypes):
                for activation in activations:
                    _objectives(dtype, activation, rows, width)
                    _predictions(dtype, activation, rows, width)
                    _prediction_tiles(dtype, activation, tile_widths)
                    _operators(dtype, activation, 40)
    finally:
        restore()
    distinct = {json.dumps(launch, sort_keys=True): launch for launch in launches}
    return list(distinct.values())


def recorded_launches(dtypes, activations, tile_widths, repo: Path) -> list:
    """:func:`record` in a process of its own (the interpreter must be chosen before Triton is
    imported)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    command = [sys.executable, __file__, ",".join(dtypes), ",".join(activations), ",".join(map(str, tile_widths))]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("LAUNCHES "))
    return json.loads(line[len("LAUNCHES ") :])


# ----------------------------------------------------------------------------- compiling


def ptxas_path() -> str:
    """Triton's bundled ptxas (absent where this Triton has no NVIDIA backend)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def _as_signature(kind):
    return tuple(_as_signature(k) for k in kind) if isinstance(kind, list) else kind


def compile_launch(launch: dict, directory: Path) -> int:
    """Compile one recorded launch for sm_90a (Triton's compiler, then ptxas on its PTX); return
    ptxas' spill stores in bytes. Raises where either refuses it."""
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as compile_kernel

    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    signature = {name: _as_signature(kind) for name, kind in launch["signature"].items()}
    constexprs = {tuple(path): value for path, value in launch["constexprs"]}
    source = ASTSource(kernel, signature, constexprs=constexprs)
    compiled = compile_kernel(source, target=GPUTarget("cuda", 90, 32), options=launch["options"])
    ptx = directory / f"{launch['kernel']}.ptx"
    ptx.write_text(compiled.asm["ptx"])
    command = [ptxas_path(), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", os.devnull]
    report = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


def described(launch: dict) -> str:
    """A launch as a failure names it: the kernel, its arguments' types, its constexprs' values,
    its launch options."""
    names = list(launch["signature"])
    types = {name: kind for name, kind in launch["signature"].items() if kind != "constexpr"}
    constexprs = {".".join([names[path[0]], *map(str, path[1:])]): value for path, value in launch["constexprs"]}
    return f"{launch['kernel']} {json.dumps(types)} {json.dumps(constexprs)} {json.dumps(launch['options'])}"


def refusal(launch: dict, directory: Path) -> str:
    """Why ``launch`` does not compile for sm_90a without register spills ("" where it does)."""
    directory.mkdir()
    try:
        spills = compile_launch(launch, directory)
    except Exception as error:  # (every refusal reported, not only the first)
        return f"{described(launch)}: {type(error).__name__}: {str(error)[-600:]}"
    return f"{described(launch)}: {spills} bytes spill stores" if spills else ""


if __name__ == "__main__":
    dtype_names, activation_names, widths = (argument.split(",") for argument in sys.argv[1:4])
    print("LAUNCHES", json.dumps(record(dtype_names, activation_names, [int(w) for w in widths])))
