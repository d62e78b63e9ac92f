"""The operators' reference kernels for tests and benchmarks, the dispatcher's way: inside
``with reference_kernels():`` every ``cfbnn::`` operator runs its reference kernel (the torch formula
it was declared with, :mod:`cfbnn_cli.moments.operators`) on the CPU, in place of the C++ library's,
through a ``torch.library`` registration that is removed on exit (the C++ kernels come back). Nothing
in the package is switched: the dispatcher picks the kernel registered last.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Dict, List

import torch

from cfbnn_cli.moments.operators import OPERATORS

_OPEN: List[list] = []  # the blocks of kernels_for open now, outermost first: [kernels, key, libraries]


def _register(kernels: Dict[str, Callable], key: str) -> torch.library.Library:
    library = torch.library.Library("cfbnn", "IMPL")
    with warnings.catch_warnings():  # (replacing a registered kernel is the point here)
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
        for name, kernel in kernels.items():
            library.impl(name, kernel, key)
    return library


@contextlib.contextmanager
def kernels_for(kernels: Dict[str, Callable], key: str = "CPU"):
    """``kernels`` (``{operator name: kernel}``) registered for the dispatch key ``key`` for the block;
    the kernels registered before come back on exit. Blocks nest: on an inner block's exit the
    enclosing block's kernels are registered again, since torch calls a Python kernel under a
    ``TorchDispatchMode`` through a table of the one registered last for each operator and key,
    which removing a registration does not restore."""
    entry = [kernels, key, [_register(kernels, key)]]
    _OPEN.append(entry)
    try:
        yield
    finally:
        _OPEN.remove(entry)
        for library in entry[2]:
            library._destroy()
        outer = next((e for e in reversed(_OPEN) if e[1] == key), None)
        if outer is not None:
            outer[2].append(_register(outer[0], key))


def reference_kernels(*keys: str):
    """Every ``cfbnn::`` operator's reference kernel registered for ``keys`` (the CPU by default) for
    the block (``with reference_kernels(): ...``)."""
    references = {name: operator.reference for name, operator in OPERATORS.items()}
    stack = contextlib.ExitStack()
    for key in keys or ("CPU",):
        stack.enter_context(kernels_for(references, key))
    return stack


def package_without_library(folder) -> str:
    """A copy of the ``cfbnn_cli`` package in ``folder`` without the C++ library (what an install
    without a compiler leaves): the ``sys.path`` entry that imports it, first, for a child process to
    put in front with :data:`PRELUDE` (an editable install's finder would otherwise find the checkout)."""
    import shutil
    from pathlib import Path

    import cfbnn_cli

    source = Path(cfbnn_cli.__file__).parent
    target = Path(folder) / "cfbnn_cli"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("_C*.so", "_C.build.json", "__pycache__"))
    return str(folder)


# a child process's first lines: the package from the folder in $CFBNN_TEST_PACKAGE, the editable
# install's finder out of the way
PRELUDE = """
import os, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()]
sys.path.insert(0, os.environ["CFBNN_TEST_PACKAGE"])
"""
