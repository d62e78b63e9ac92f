"""cfbnn's C++ CPU kernels, built when the package is installed: the torch extension
``cfbnn_cli/moments/_C`` (a shared library beside the package's Python files, which
``torch.ops.load_library`` loads when ``cfbnn_cli.moments`` is imported; an editable install builds
it in place). Everything else about the package is in ``pyproject.toml``.

Three translation units (``cfbnn_cli/moments/csrc``) compile side by side, then one link:

* ``kernels.cpp``, the kernels: plain C++ without torch headers, with the fastest flags the
  compiler and the machine take (``-march=native``, OpenMP, glibc's vector math library), then
  plainer ones; each flag set's build must pass ``self_test.cpp`` (ReLU's moments against their
  closed forms) before it is used;
* ``moment_ops.cpp`` and ``elbo_ops.cpp``, the operators' CPU kernels: torch's core headers
  (``torch/library.h``, ``ATen/core``; not ``torch/extension.h``, about a minute a unit), their
  ``TORCH_LIBRARY_IMPL(cfbnn, CPU, m)`` static registration, linked with ``libc10`` and
  ``libtorch_cpu`` (``torch.utils.cpp_extension``'s include and library paths).

Beside the library, ``_C.build.json`` records the torch version and the CPU it was built for
(``cfbnn_cli/moments/build_record.py``); a library built for another is not loaded.

Where no compiler works (none installed, ``CXX=/bin/false``), or torch does not import in the build
environment (pip's build isolation: install with ``--no-build-isolation`` after torch), the install
still succeeds, says so in one line, and the operators' reference kernels serve the CPU.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
SOURCES = Path("cfbnn_cli", "moments", "csrc")  # relative to HERE, as setuptools wants them
KERNELS, OPERATORS, SELF_TEST = "kernels.cpp", ("moment_ops.cpp", "elbo_ops.cpp"), "self_test.cpp"
EXTENSION = "cfbnn_cli.moments._C"
COMPILE_TIMEOUT_SECONDS = 900
SERVE = "the reference kernels will serve the CPU (several times slower)"


def _build_record_module():
    """``cfbnn_cli/moments/build_record.py`` (loaded by its path: the package is not installed yet)."""
    spec = importlib.util.spec_from_file_location(
        "cfbnn_build_record", HERE / "cfbnn_cli" / "moments" / "build_record.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(line: str) -> None:
    """One line for the person installing: on the terminal where there is one (pip shows a build's
    output only when it fails, or with ``-v``), and on the build's stderr."""
    print(line, file=sys.stderr, flush=True)
    if os.isatty(2):
        return
    try:
        with open("/dev/tty", "w") as terminal:
            terminal.write("\n" + line + "\n")  # (after pip's spinner)
    except OSError:
        pass  # no terminal (CI): the build log has it


def find_compiler():
    explicit = os.environ.get("CXX")
    if explicit:
        return shutil.which(explicit) or (explicit if os.path.isfile(explicit) else None)
    for name in ("g++", "c++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def flag_sets():
    """The kernels' compiler flags, from the fastest to the plainest (the first that builds and
    passes the self-test wins)."""
    base = ["-O3", "-std=c++14", "-fPIC", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    native = ["-march=native", "-mprefer-vector-width=512"] if x86 else ["-mcpu=native"]
    sets = []
    if x86 and platform.system() == "Linux":
        sets.append(base + native + ["-fopenmp", "-DCFBNN_MVEC", "-lmvec"])
    return sets + [base + native + ["-fopenmp"], base + ["-fopenmp"], base + native, base]


def compiler_message(stderr: str, limit: int = 6) -> str:
    """The compiler's first error line (a long template error stays one line)."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    if not lines:
        return "the compiler failed without a message"
    return next((line for line in lines if "error" in line.lower()), lines[-1])[:300]


def run_all(commands):
    """Run ``commands`` side by side: ``(returncode, stderr)`` of each (-1 and the reason where one
    did not start or ran past the timeout)."""
    processes = []
    for command in commands:
        try:
            processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        except OSError as error:
            processes.append(f"{command[0]}: {error.strerror or error}")
    results = []
    deadline = time.monotonic() + COMPILE_TIMEOUT_SECONDS
    for process in processes:
        if isinstance(process, str):
            results.append((-1, process))
            continue
        try:
            _, stderr = process.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            results.append((process.returncode, stderr.decode(errors="replace")))
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            results.append((-1, f"the compiler ran past {COMPILE_TIMEOUT_SECONDS} s"))
    return results


def torch_settings():
    """``(compile flags, link flags, torch version)`` of the operators' units, or a string: why torch
    does not build them here."""
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception as error:  # noqa: BLE001 - any failure means: no kernels, said in one line
        return (
            f"torch does not import in the build environment ({type(error).__name__}); with pip, install "
            "torch first and then cfbnn with --no-build-isolation"
        )
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    compile_flags = ["-O1", "-std=c++20", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    compile_flags += [f"-I{path}" for path in cpp_extension.include_paths()]
    link_flags = []
    for path in cpp_extension.library_paths():
        link_flags += [f"-L{path}", f"-Wl,-rpath,{path}"]
    return compile_flags, link_flags + ["-lc10", "-ltorch_cpu"], torch.__version__


def build_library(target: Path):
    """Build the library into ``target`` (its build record beside it): ``None``, or why it was not built."""
    compiler = find_compiler()
    if compiler is None:
        return "no C++ compiler found ($CXX, g++, c++ or clang++)"
    settings = torch_settings()
    if isinstance(settings, str):
        return settings
    operator_flags, link_flags, torch_version = settings
    sources = HERE / SOURCES
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cfbnn-build-") as work:
        work = Path(work)
        probe = work / "probe.cpp"
        probe.write_text("int main() { return 0; }\n")
        code, stderr = run_all([[compiler, str(probe), "-o", str(work / "probe")]])[0]
        if code != 0:
            return f"the C++ compiler {compiler} does not build a program: {compiler_message(stderr)}"
        operator_objects = [work / (Path(name).stem + ".o") for name in OPERATORS]
        flag_trials = flag_sets()
        reason = ""
        for number, flags in enumerate(flag_trials):
            compile_only = [flag for flag in flags if not flag.startswith("-l")]
            libraries = [flag for flag in flags if flag.startswith("-l")]
            kernels_object = work / "kernels.o"
            commands = [[compiler, "-c", str(sources / KERNELS), "-o", str(kernels_object), *compile_only]]
            if number == 0:  # the operators' units once, beside the first flag set's kernels
                commands += [
                    [compiler, "-c", str(sources / name), "-o", str(obj), *operator_flags]
                    for name, obj in zip(OPERATORS, operator_objects)
                ]
            results = run_all(commands)
            for code, stderr in results[1:]:
                if code != 0:  # (the kernels are reached only through the operators' units)
                    return f"the operators' units do not compile with {compiler}: {compiler_message(stderr)}"
            code, stderr = results[0]
            if code != 0:
                reason = f"{compiler} does not compile the kernels: {compiler_message(stderr)}"
                continue
            test = work / "self_test"
            code, stderr = run_all(
                [[compiler, str(sources / SELF_TEST), str(kernels_object), "-o", str(test), *compile_only, *libraries]]
            )[0]
            if code == 0:
                code, stderr = run_all([[str(test)]])[0]
                if code != 0:
                    reason = f"the kernels built with {' '.join(flags)} fail their self-test"
                    continue
            else:
                reason = f"the kernels' self-test does not link: {compiler_message(stderr)}"
                continue
            library = work / target.name
            link = [compiler, "-shared", str(kernels_object), *map(str, operator_objects), "-o", str(library)]
            code, stderr = run_all([link + compile_only + libraries + link_flags])[0]
            if code != 0:
                reason = f"the library does not link: {compiler_message(stderr)}"
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(library, target)
            os.chmod(target, 0o755)
            seconds = round(time.monotonic() - started, 1)
            details = dict(compiler=compiler, flags=flags, seconds=seconds)
            record_path = target.with_name(_build_record_module().RECORD_NAME)
            digest = _build_record_module().sources_digest(sources)
            record_path.write_bytes(
                _build_record_module().record(target.read_bytes(), torch_version, digest, **details)
            )
            os.chmod(record_path, 0o644)
            print(f"cfbnn: built the C++ CPU kernels in {seconds} s ({' '.join(flags)})", file=sys.stderr)
            return None
        return reason


class BuildKernels(build_ext):
    """``build_ext`` for the one extension: :func:`build_library`, which never fails the install."""

    def build_extension(self, ext):
        target = Path(self.get_ext_fullpath(ext.name))
        for stale in (target, target.with_name(_build_record_module().RECORD_NAME)):
            if stale.exists():
                stale.unlink()
        reason = build_library(target)
        if reason is not None:
            report(f"cfbnn: the C++ CPU kernels were not built ({reason}); {SERVE}")

    def get_outputs(self):
        outputs = super().get_outputs()
        record = _build_record_module().RECORD_NAME
        return outputs + [str(Path(path).with_name(record)) for path in outputs if Path(path).exists()]

    def copy_extensions_to_source(self):
        """An editable install: the library and its record into the source tree; where this build made
        none, the source tree's old ones removed (the reference kernels serve, as the install said)."""
        build_py = self.get_finalized_command("build_py")
        record = _build_record_module().RECORD_NAME
        for ext in self.extensions:
            inplace, regular = (Path(path) for path in self._get_inplace_equivalent(build_py, ext))
            for source, destination in ((regular, inplace), (regular.with_name(record), inplace.with_name(record))):
                if source.exists():
                    self.copy_file(str(source), str(destination), level=self.verbose)
                elif destination.exists():
                    destination.unlink()


if __name__ == "__main__":  # (pip's build backend runs this file as __main__; the tests import it)
    setup(
        ext_modules=[
            Extension(EXTENSION, sources=[str(SOURCES / name) for name in (KERNELS, *OPERATORS)], optional=True)
        ],
        cmdclass={"build_ext": BuildKernels},
    )
