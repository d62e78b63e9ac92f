"""Build, cache and load the CPU kernel library (``csrc/``).

Two translation units are compiled side by side (two compiler processes) and linked into one
shared library with the system C++ compiler (``$CXX``, else ``g++``/``c++``/``clang++``):

* ``cfbnn_moments.cpp``, the kernels: plain C++ without torch headers, entry points declared in
  ``cfbnn_kernels.h`` (10-20 s on a laptop core, the flag sets below);
* ``cfbnn_ops.cpp``, the ``cfbnn::`` operators' CPU kernels registered with torch's dispatcher:
  torch's core tensor and library headers only (a few seconds, beside the kernels), linked with
  ``libc10`` and ``libtorch_cpu``. Not torch's ``cpp_extension``: its ``torch/extension.h``
  includes the whole C++ API and Python bindings (about a minute per unit), and its build
  directory has no per-user ownership checks. If this unit does not compile or link, the
  kernels are linked alone (``fast_path_info()["operators_error"]`` says why) and the ELBO
  takes the routes that do not need the operators.

:mod:`cfbnn_cli.moments.fast` loads the library with :mod:`ctypes`; once it has passed its
self-test, :mod:`cfbnn_cli.moments.kernel_library` calls ``cfbnn_register_cpu_kernels()``.

The cache (``$CFBNN_CACHE_DIR``, default ``$XDG_CACHE_HOME/cfbnn`` or ``~/.cache/cfbnn``):

* one folder per build, named by a hash of the sources, the compiler and its version, the
  flags, the CPU (``-march=native``), torch's version and the kernels' ABI number;
* the directory must be the user's own (mode 0700; :func:`~cfbnn_cli.runtime.safefs.private_directory`);
  each library's SHA-256, recorded beside it at build time, is checked before the dynamic
  loader ever sees it: a file planted by someone else, truncated or altered is rebuilt;
* one builder at a time across processes (an exclusive ``flock`` on ``.build.lock``): a
  second process with a cold cache waits and then loads what the first built;
* a flag set that failed to compile records the compiler's message (``failed``) and is not
  retried at the next start (``load_library(rebuild=True)`` retries);
* the first line of the compiler's error and its last lines reach the warning and
  ``fast_path_info()["error"]``.

Flag sets are tried from the fastest (``-march=native``, OpenMP, glibc's vector math
library) to the plainest; the first that compiles, loads and passes ``self_test`` wins.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch

from ..runtime.safefs import (
    UnsafePathError,
    cache_root,
    open_no_follow,
    owned_regular_file,
    private_directory,
    sha256_of_file,
)

log = logging.getLogger(__name__)

SOURCE_FOLDER = Path(__file__).with_name("csrc")
SOURCE_PATH = SOURCE_FOLDER / "cfbnn_moments.cpp"  # the kernels
HEADER_PATH = SOURCE_FOLDER / "cfbnn_kernels.h"  # their entry points, included by both units
OPERATORS_PATH = SOURCE_FOLDER / "cfbnn_ops.cpp"  # the operators' CPU kernels (torch headers)
SOURCES = (SOURCE_PATH, HEADER_PATH, OPERATORS_PATH)
LIBRARY_NAME = "cfbnn_moments.so"
OPERATORS_FAILED_NAME = "operators-failed"  # why a library was linked without its operators
HASH_SUFFIX = ".sha256"
FAILED_NAME = "failed"  # a flag set that did not compile: its compiler message, kept beside its key
LOCK_NAME = ".build.lock"
COMPILE_TIMEOUT_SECONDS = 300


def read_sources() -> Dict[str, str]:
    """``{file name: text}`` of the library's sources (what is hashed into the cache key and built)."""
    return {path.name: path.read_text(encoding="utf-8") for path in SOURCES}


def source_text(sources: Dict[str, str]) -> str:
    """The sources as one text: what the cache key hashes."""
    return "\n".join(sources.values())


def read_source() -> str:
    """All the sources as one text (the cache key's)."""
    return source_text(read_sources())


def operator_flags() -> Tuple[list, list]:
    """``(compile flags, link flags)`` of the operators' unit: torch's headers (C++20, as they
    require), its C++ ABI, and its libraries (found through an rpath; torch has loaded them). -O1:
    the unit is glue around the kernels (checks, allocation, autograd nodes) and almost all of its
    compile time is torch's headers and templates; -O2 adds two seconds to the first build."""
    root = Path(torch.__file__).resolve().parent
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    compile_flags = ["-O1", "-std=c++20", "-fPIC", f"-I{root / 'include'}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    link_flags = [f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}", "-lc10", "-ltorch_cpu"]
    return compile_flags, link_flags


def find_compiler() -> Optional[str]:
    explicit = os.environ.get("CXX")
    if explicit:
        return shutil.which(explicit) or (explicit if os.path.isfile(explicit) else None)
    for name in ("g++", "c++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def compiler_version(compiler: str) -> str:
    try:
        result = subprocess.run([compiler, "--version"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
        return result.stdout.decode(errors="replace").splitlines()[0] if result.stdout else ""
    except (OSError, subprocess.SubprocessError, IndexError):
        return ""


def cpu_signature() -> str:
    """What -march=native depends on (so that a shared cache never serves a foreign CPU)."""
    parts = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith(("flags", "model name", "Features", "CPU part")):
                    parts.append(line.strip())
                if len(parts) > 6:
                    break
    except OSError:
        pass
    return "|".join(parts)


def flag_sets():
    """Compiler flags from the fastest to the plainest."""
    base = ["-O3", "-std=c++14", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    native = ["-march=native", "-mprefer-vector-width=512"] if x86 else ["-mcpu=native"]
    mvec = ["-DCFBNN_MVEC", "-lmvec"] if (x86 and platform.system() == "Linux") else None
    sets = []
    if mvec:
        sets.append(base + native + ["-fopenmp"] + mvec)
    sets += [base + native + ["-fopenmp"], base + ["-fopenmp"], base + native, base]
    return sets


def cache_key(source: str, compiler: str, version: str, flags, abi: int) -> str:
    parts = [source, compiler, version, " ".join(flags), cpu_signature(), str(abi), torch.__version__]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


@contextlib.contextmanager
def build_lock(root: Path):
    """One builder at a time across processes: an exclusive ``flock`` on ``root/.build.lock``
    (released when the process exits, however it exits)."""
    descriptor = open_no_follow(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # closing releases the lock


def compiler_message(stderr: str, limit: int = 12) -> str:
    """The compiler's first error line and its last lines (a long template error stays readable)."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    if not lines:
        return "the compiler failed without a message"
    first_error = next((line for line in lines if "error" in line.lower()), lines[0])
    tail = lines[-limit:]
    return "\n".join(([first_error, "..."] if first_error not in tail else []) + tail)


def _run_all(commands) -> list:
    """Run the compiler ``commands`` side by side; ``(returncode, stderr)`` of each (``-1`` and the
    reason where one could not run or ran past the timeout)."""
    processes = []
    for command in commands:
        try:
            processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        except OSError as error:
            processes.append(f"{type(error).__name__}: {error}")
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


def compile_library(compiler: str, flags, target: str, sources: Dict[str, str]) -> Tuple[Optional[str], Optional[str]]:
    """Build ``sources`` (:func:`read_sources`) into ``target`` and record its content hash beside
    it: ``(error, operators_error)``, the compiler's message where the kernels did not build
    (else ``None``), and where only the operators' unit did not (the kernels then linked alone).

    The kernels' unit (``flags``) and the operators' unit (:func:`operator_flags`) compile side by
    side, then one link. Both files are written atomically (a temporary file, then a rename)
    inside a private directory; the hash is what :func:`verified` checks before the library is
    ever loaded.
    """
    directory = str(private_directory(os.path.dirname(target)))
    with tempfile.TemporaryDirectory(dir=directory) as work:
        for name, text in sources.items():
            with open(os.path.join(work, name), "w") as handle:
                handle.write(text)
        kernels_object, operators_object = os.path.join(work, "kernels.o"), os.path.join(work, "operators.o")
        compile_only = [f for f in flags if not f.startswith("-l") and f != "-shared"]
        libraries = [f for f in flags if f.startswith("-l")]
        operators_compile, operators_link = operator_flags()
        (kernels, kernels_stderr), (operators, operators_stderr) = _run_all(
            [
                [compiler, "-c", os.path.join(work, SOURCE_PATH.name), "-o", kernels_object, *compile_only],
                [compiler, "-c", os.path.join(work, OPERATORS_PATH.name), "-o", operators_object, *operators_compile],
            ]
        )
        if kernels != 0:
            return compiler_message(kernels_stderr), None
        operators_error = compiler_message(operators_stderr) if operators != 0 else None
        output = os.path.join(work, LIBRARY_NAME)

        def link(objects, extra):
            return _run_all([[compiler, "-shared", *objects, "-o", output, *compile_only, *libraries, *extra]])[0]

        if operators_error is None:
            returncode, stderr = link([kernels_object, operators_object], operators_link)
            if returncode != 0:
                operators_error = compiler_message(stderr)
        if operators_error is not None:
            returncode, stderr = link([kernels_object], [])
            if returncode != 0:
                return compiler_message(stderr), None
        os.chmod(output, 0o700)
        record = os.path.join(work, LIBRARY_NAME + HASH_SUFFIX)
        with open(record, "w") as handle:
            handle.write(sha256_of_file(output) + "\n")
        # the library first: a reader that finds the new hash finds the new library too
        os.replace(output, target)
        os.replace(record, target + HASH_SUFFIX)
    return None, operators_error


def verified(target: str) -> Optional[str]:
    """Why the cached library ``target`` must not be loaded, or ``None`` if it may.

    It must be a regular file of this user that nobody else can write, with a hash
    record of the same kind, and its bytes must hash to the recorded value: a file
    planted by someone else, or truncated (which would crash the process with SIGBUS
    when loaded), or altered, is never handed to the dynamic loader.
    """
    record = target + HASH_SUFFIX
    try:
        owned_regular_file(target)
        owned_regular_file(record)
        with open(record) as handle:
            expected = handle.read(200).strip()
        actual = sha256_of_file(target)
    except OSError as error:
        return str(error) if isinstance(error, UnsafePathError) else f"{type(error).__name__}: {error}"
    if actual != expected:
        return f"{target} does not match the content hash recorded when it was built (truncated or altered)"
    return None


def discard(target: str) -> None:
    """Remove a cached library and its hash record that failed verification (only those two
    names, only if they are not directories; a link is removed, never followed)."""
    for path in (target, target + HASH_SUFFIX):
        if os.path.islink(path) or os.path.isfile(path):
            os.unlink(path)


def _recorded_failure(folder: str, name: str = FAILED_NAME) -> Optional[str]:
    """The compiler message a previous start recorded for this key (``name``: of the whole
    build, or of the operators' unit), if it is ours to trust."""
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        return None
    try:
        owned_regular_file(path)
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read(4000).strip() or "failed earlier"
    except OSError:
        return None  # not trustworthy: build again


def _record_failure(folder: str, message: Optional[str], name: str = FAILED_NAME) -> None:
    """Record ``message`` under ``name`` in ``folder``; ``None`` removes an earlier record."""
    path = os.path.join(folder, name)
    if message is None:
        with contextlib.suppress(OSError):
            if os.path.lexists(path) and not os.path.isdir(path):
                os.unlink(path)
        return
    try:
        descriptor = open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(message + "\n")
    except OSError:
        pass  # only a cache of a failure: the next start compiles again


def _summary(flags, message: str) -> str:
    return f"[{' '.join(flags)}] {message}"


def load_library(
    abi: int,
    bind: Callable[[ctypes.CDLL], None],
    self_test: Callable[[ctypes.CDLL], Optional[str]],
    rebuild: bool = False,
) -> Tuple[Optional[ctypes.CDLL], Dict[str, object]]:
    """``(library, info)``: the first flag set's library that is cached (and verified) or
    builds, loads, reports ``abi`` and passes ``self_test``; ``(None, {"error": ...})`` when
    none does. ``rebuild=True`` ignores cached libraries and recorded failures."""
    compiler = find_compiler()
    if compiler is None:
        return None, {"error": "no C++ compiler found (install g++ or set $CXX); the torch path serves"}
    try:
        root = private_directory(cache_root())
    except OSError as error:  # someone else's directory, a link, or unwritable: never load from it
        return None, {"error": f"kernel cache refused: {error}"}
    try:
        sources = read_sources()
    except OSError as error:
        return None, {"error": f"kernel source missing ({error}); reinstall cfbnn"}
    version = compiler_version(compiler)
    text = source_text(sources)
    errors = []
    compiling_since = None  # when this call began compiling (the first use with this cache): said before and after
    with build_lock(root):
        for flags in flag_sets():
            folder = os.path.join(root, f"moments-{cache_key(text, compiler, version, flags, abi)}")
            target = os.path.join(folder, LIBRARY_NAME)
            try:
                private_directory(folder)
            except OSError as error:
                errors.append(_summary(flags, str(error)))
                continue
            if not rebuild:
                failure = _recorded_failure(folder)
                if failure is not None:
                    errors.append(_summary(flags, f"(recorded at an earlier start) {failure}"))
                    continue
            cached = os.path.lexists(target) and not rebuild
            if cached:
                problem = verified(target)
                if problem is not None:
                    warnings.warn(
                        f"cfbnn: not loading the cached kernel library: {problem}; rebuilding it",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                    cached = False
            build_seconds = 0.0
            if not cached:
                if compiling_since is None:
                    log.warning("compiling the CPU kernels (first use, about 20 s; cached in %s afterwards)", root)
                    compiling_since = time.perf_counter()
                start = time.perf_counter()
                try:
                    discard(target)
                    error, operators_error = compile_library(compiler, flags, target, sources)
                    _record_failure(folder, operators_error, OPERATORS_FAILED_NAME)
                except OSError as failure:  # e.g. an unwritable or foreign cache directory
                    error = (
                        f"{type(failure).__name__}: {failure}"
                        if not isinstance(failure, UnsafePathError)
                        else str(failure)
                    )
                build_seconds = time.perf_counter() - start
                if error is not None:
                    _record_failure(folder, error)
                    errors.append(_summary(flags, error))
                    continue
                problem = verified(target)  # what was just built, as any later process will check it
                if problem is not None:
                    errors.append(_summary(flags, problem))
                    continue
            start = time.perf_counter()
            try:
                library = ctypes.CDLL(target)
                bind(library)
                if library.cfbnn_abi() != abi:
                    raise OSError("ABI mismatch")
                problem = self_test(library)
            except (OSError, AttributeError) as failure:
                problem = f"{type(failure).__name__}: {failure}"
            if problem is not None:
                errors.append(_summary(flags, problem))
                continue
            info = {
                "library": target,
                "cached": cached,
                "build_seconds": build_seconds,
                "load_seconds": time.perf_counter() - start,
                "flags": " ".join(flags),
                "compiler": f"{compiler} ({version})",
                "openmp": bool(library.cfbnn_openmp()),
                "error": None,
                "operators_error": _recorded_failure(folder, OPERATORS_FAILED_NAME),
            }
            if compiling_since is not None:
                log.info("compiled the CPU kernels in %.1f s", time.perf_counter() - compiling_since)
            return library, info
    if compiling_since is not None:
        log.info(
            "the CPU kernels did not compile (%.1f s); the torch path serves", time.perf_counter() - compiling_since
        )
    return None, {"error": "\n".join(errors) or "no build succeeded"}
