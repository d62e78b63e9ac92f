"""Build, cache and load the CPU kernel library (``csrc/``).

Two translation units are compiled side by side (two compiler processes) and linked into one
shared library with the system C++ compiler (``$CXX``, else ``g++``/``c++``/``clang++``):

* ``cfbnn_moments.cpp``, the kernels: plain C++ without torch headers, entry points declared in
  ``cfbnn_kernels.h`` (10-20 s on a laptop core, the flag sets below);
* ``cfbnn_ops.cpp``, the ``cfbnn::`` operators' CPU kernels registered with torch's dispatcher:
  torch's core tensor and library headers only (a few seconds, beside the kernels), linked with
  ``libc10`` and ``libtorch_cpu``. Not torch's ``cpp_extension``: its ``torch/extension.h``
  includes the whole C++ API and Python bindings (about a minute per unit), and its build
  directory has no per-user ownership checks. The kernels are reached only through these
  operators: if this unit does not compile or link, there is no library, and the operators run
  their reference kernels (``fast_path_info()["error"]`` says why).

:mod:`cfbnn_cli.moments.kernel_library` loads the library (here, the only place a compiled library
of cfbnn's is loaded: a ``dlopen`` through :mod:`ctypes`, as ``torch.ops.load_library`` does); once
it has passed its self-test (``cfbnn_self_test()``), it calls ``cfbnn_register_cpu_kernels()``.

The cache (``$CFBNN_CACHE_DIR``, default ``$XDG_CACHE_HOME/cfbnn`` or ``~/.cache/cfbnn``):

* one folder per build, named by a hash of the sources, the compiler and its version, the
  flags, the CPU (``-march=native``), torch's version and the kernels' ABI number;
* the directory must be the user's own (mode 0700; :func:`~cfbnn_cli.runtime.safefs.private_directory`),
  and every directory above it owned by root or the user and writable by nobody else (a
  sticky ``/tmp`` excepted; :func:`~cfbnn_cli.runtime.safefs.check_parents`); otherwise the
  cache is refused and the torch path serves, with a warning;
* each library is recorded beside it at build time (:func:`record_of`: an HMAC under the
  cache's own secret key, ``.record-key``, of the folder's name and the library's SHA-256);
  a library is opened once without following a link, its bytes are read from that open file
  and checked against the record (:func:`read_verified`), and exactly those bytes are loaded,
  from a sealed in-memory copy (:func:`load_bytes`), never the path again: a file planted
  (with or without a plain hash beside it), truncated or altered is rebuilt, and a file
  swapped after the check never reaches the loader;
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
import hmac
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
    PathLike,
    UnsafePathError,
    cache_root,
    check_parents,
    open_no_follow,
    private_directory,
    read_private_file,
    sealed_copy,
)

log = logging.getLogger(__name__)

SOURCE_FOLDER = Path(__file__).with_name("csrc")
SOURCE_PATH = SOURCE_FOLDER / "cfbnn_moments.cpp"  # the kernels
HEADER_PATH = SOURCE_FOLDER / "cfbnn_kernels.h"  # their entry points, included by both units
OPERATORS_PATH = SOURCE_FOLDER / "cfbnn_ops.cpp"  # the operators' CPU kernels (torch headers)
SOURCES = (SOURCE_PATH, HEADER_PATH, OPERATORS_PATH)
LIBRARY_NAME = "cfbnn_moments.so"
HASH_SUFFIX = ".record"  # the library's record (record_of): an HMAC under the cache's key
KEY_NAME = ".record-key"  # the cache's secret key of those records (record_key)
KEY_BYTES = 32
LIBRARY_LIMIT = 256 << 20  # a library larger than this is not read (nor loaded)
RECORD_FORMAT = 2  # how libraries are recorded: part of the cache key (an older cache's folders are not read)
FAILED_NAME = "failed"  # a flag set that did not compile: its compiler message, kept beside its key
LOCK_NAME = ".build.lock"
COMPILE_TIMEOUT_SECONDS = 300
_LOADED = []  # the sealed copies loaded: open for the process's life (see load_bytes)


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
    parts.append(f"record format {RECORD_FORMAT}")
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


def record_key(root: PathLike, create: bool = False) -> bytes:
    """The cache's secret key (``root/.record-key``, 32 random bytes, mode 0600), under which
    each library's record is made (:func:`record_of`). ``create=True`` makes it where it is
    missing, and replaces one that is damaged, a link, or not a private file of ours (every
    record made under the old key then fails, and those libraries are rebuilt)."""
    path = os.path.join(os.fspath(root), KEY_NAME)
    try:
        key = read_private_file(path, 4 * KEY_BYTES)
        if len(key) == KEY_BYTES:
            return key
        problem = f"{path} is damaged"
    except FileNotFoundError:
        problem = f"{path} is missing"
    except OSError as error:
        problem = str(error)
    if not create:
        raise UnsafePathError(f"no usable record key: {problem}")
    temporary = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)
    descriptor = open_no_follow(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(os.urandom(KEY_BYTES))
    os.replace(temporary, path)  # replaces a link or a damaged key itself, never what a link points to
    return record_key(root)


def record_of(key: bytes, folder: str, data: bytes) -> str:
    """The record of a library's bytes ``data`` built into the cache folder named ``folder``:
    HMAC-SHA256 under the cache's key of the folder's name and the bytes' SHA-256 (so a
    library moved to another key's folder, or planted with a plain hash beside it, fails)."""
    message = os.path.basename(folder).encode() + b"\0" + hashlib.sha256(data).digest()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def compile_library(compiler: str, flags, target: str, sources: Dict[str, str]) -> Optional[str]:
    """Build ``sources`` (:func:`read_sources`) into ``target`` and record it beside it: the
    compiler's message where either unit did not build or the link failed, else ``None``.
    :func:`build` does the same and also returns the bytes built."""
    return build(compiler, flags, target, sources)[0]


def build(compiler: str, flags, target: str, sources: Dict[str, str]) -> Tuple[Optional[str], bytes]:
    """:func:`compile_library`, returning also the library's bytes as this process read them
    once from the linker's output: what it records, and what :func:`load_library` loads.

    The kernels' unit (``flags``) and the operators' unit (:func:`operator_flags`) compile side by
    side, then one link. Both files are written atomically (a temporary file, then a rename)
    inside a private directory; the record (:func:`record_of`, under the cache's key in the
    folder above) is what :func:`read_verified` checks before a later process loads the library.
    """
    directory = str(private_directory(os.path.dirname(target)))
    key = record_key(os.path.dirname(directory), create=True)
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
            return compiler_message(kernels_stderr), b""
        if operators != 0:  # (the kernels are reached only through the operators this unit registers)
            return compiler_message(operators_stderr), b""
        output = os.path.join(work, LIBRARY_NAME)
        returncode, stderr = _run_all(
            [
                [compiler, "-shared", kernels_object, operators_object, "-o", output, *compile_only, *libraries]
                + operators_link
            ]
        )[0]
        if returncode != 0:
            return compiler_message(stderr), b""
        os.chmod(output, 0o700)
        data = read_private_file(output, LIBRARY_LIMIT)
        record = os.path.join(work, LIBRARY_NAME + HASH_SUFFIX)
        with open(record, "w") as handle:
            handle.write(record_of(key, directory, data) + "\n")
        # the library first: a reader that finds the new record finds the new library too
        os.replace(output, target)
        os.replace(record, target + HASH_SUFFIX)
    return None, data


def read_verified(target: str, key: bytes) -> bytes:
    """The bytes of the cached library ``target``, read from one open file and checked against
    its record; :class:`OSError` (:class:`UnsafePathError` for a refusal) says why not.

    The library and its record must be regular files of this user that nobody else can
    write, opened without following a link; the library's bytes, as read from that open file,
    must match the record made under the cache's key (:func:`record_of`): a file planted by
    someone else, with or without a plain hash beside it, truncated (which would crash the
    process with SIGBUS when loaded) or altered fails. Only these bytes are ever loaded
    (:func:`load_bytes`), never the path again.
    """
    data = read_private_file(target, LIBRARY_LIMIT)
    recorded = read_private_file(target + HASH_SUFFIX, 200).decode("ascii", errors="replace").strip()
    if not hmac.compare_digest(recorded, record_of(key, os.path.dirname(target), data)):
        raise UnsafePathError(
            f"{target} does not match the content hash recorded when it was built (planted, truncated or altered)"
        )
    return data


def verified(target: str) -> Optional[str]:
    """Why the cached library ``target`` must not be loaded (:func:`read_verified`), or ``None``."""
    try:
        read_verified(target, record_key(os.path.dirname(os.path.dirname(target))))
    except OSError as error:
        return str(error) if isinstance(error, UnsafePathError) else f"{type(error).__name__}: {error}"
    return None


def _before_load(target: str) -> None:
    """Called between a library's verification and its load (nothing here; a test swaps the
    file on disk at this point to show that the swap does not reach the loader)."""


def load_bytes(data: bytes, target: str) -> Tuple[ctypes.CDLL, str]:
    """``(library, how)``: the verified bytes ``data`` (of ``target``) loaded, never the path again.

    Where the system has them, from a sealed in-memory copy (:func:`~cfbnn_cli.runtime.safefs.sealed_copy`,
    loaded as ``/proc/self/fd/N``): nobody, this user included, can change those bytes between
    the check and the load. Elsewhere (not Linux, or ``vm.memfd_noexec=2``), from a private
    copy written to a new 0700 directory beside ``target``, read back and compared first; a
    process of this same user could change that copy between the comparison and the load.
    """
    try:
        descriptor = sealed_copy(data, LIBRARY_NAME)
    except OSError as error:
        log.debug("no sealed in-memory copy of the kernels (%s); loading a private copy", error)
    else:
        try:
            _before_load(target)
            library = ctypes.CDLL(f"/proc/self/fd/{descriptor}")
        except OSError as error:
            os.close(descriptor)
            log.debug("the sealed copy of the kernels did not load (%s); loading a private copy", error)
        else:
            _LOADED.append(descriptor)  # open for the process's life: its name is never reused for another library
            return library, "a sealed in-memory copy"
    digest = hashlib.sha256(data).hexdigest()
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as private:
        copy = os.path.join(private, LIBRARY_NAME)
        descriptor = open_no_follow(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o700)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
        if hashlib.sha256(read_private_file(copy, LIBRARY_LIMIT)).hexdigest() != digest:
            raise UnsafePathError(f"the private copy of {target} changed before it was loaded")
        _before_load(target)
        return ctypes.CDLL(copy), "a private copy"


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
        text = read_private_file(path, 64 * 1024)
    except OSError:
        return None  # not trustworthy: build again
    return text.decode("utf-8", errors="replace")[:4000].strip() or "failed earlier"


def _record_failure(folder: str, message: Optional[str], name: str = FAILED_NAME) -> None:
    """Record ``message`` under ``name`` in ``folder``; ``None`` removes an earlier record."""
    path = os.path.join(folder, name)
    if message is None:
        with contextlib.suppress(OSError):
            if os.path.lexists(path) and not os.path.isdir(path):
                os.unlink(path)
        return
    try:
        descriptor = open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(message + "\n")
    except OSError:
        pass  # only a cache of a failure: the next start compiles again


def _summary(flags, message: str) -> str:
    return f"[{' '.join(flags)}] {message}"


def _load_checked(data: bytes, target: str, abi: int, bind, self_test):
    """``(library, problem, seconds, how)``: ``data`` loaded (:func:`load_bytes`), bound, its ABI
    and its self-test checked; ``problem`` says why it must not be used."""
    start = time.perf_counter()
    library, how = None, None
    try:
        library, how = load_bytes(data, target)
        bind(library)
        if library.cfbnn_abi() != abi:
            raise OSError("ABI mismatch")
        problem = self_test(library)
    except (OSError, AttributeError) as failure:
        problem = str(failure) if isinstance(failure, UnsafePathError) else f"{type(failure).__name__}: {failure}"
    return library, problem, time.perf_counter() - start, how


def load_library(
    abi: int,
    bind: Callable[[ctypes.CDLL], None],
    self_test: Callable[[ctypes.CDLL], Optional[str]],
    rebuild: bool = False,
) -> Tuple[Optional[ctypes.CDLL], Dict[str, object]]:
    """``(library, info)``: the first flag set's library that is cached (and verified) or
    builds, loads, reports ``abi`` and passes ``self_test``; ``(None, {"error": ...})`` when
    none does. ``rebuild=True`` ignores cached libraries and recorded failures.

    The cache and every directory above it are checked first
    (:func:`~cfbnn_cli.runtime.safefs.private_directory`, :func:`~cfbnn_cli.runtime.safefs.check_parents`);
    what is loaded is the bytes verified (:func:`read_verified`) or built by this process, from a
    sealed copy (:func:`load_bytes`). A cached library that fails to load or its self-test is
    rebuilt, with a warning."""
    compiler = find_compiler()
    if compiler is None:
        return None, {"error": "no C++ compiler found (install g++ or set $CXX); the torch path serves"}
    try:
        root = private_directory(cache_root())
        check_parents(root)
    except OSError as error:  # someone else's directory, a link, an unsafe parent, or unwritable: never load from it
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
        try:
            key = record_key(root, create=True)
        except OSError as error:
            return None, {"error": f"kernel cache refused: {error}"}
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
            library, cached, build_seconds = None, False, 0.0
            if os.path.lexists(target) and not rebuild:
                try:
                    data = read_verified(target, key)
                except OSError as error:
                    problem = str(error) if isinstance(error, UnsafePathError) else f"{type(error).__name__}: {error}"
                else:
                    library, problem, load_seconds, how = _load_checked(data, target, abi, bind, self_test)
                    problem = problem and f"it did not load or failed its self-test ({problem})"
                if problem is None:
                    cached = True
                else:
                    library = None
                    warnings.warn(
                        f"cfbnn: not loading the cached kernel library: {problem}; rebuilding it",
                        RuntimeWarning,
                        stacklevel=4,
                    )
            if not cached:
                if compiling_since is None:
                    log.warning(
                        "compiling the CPU kernels (once per machine, about 20 s; cached in %s afterwards)", root
                    )
                    compiling_since = time.perf_counter()
                start = time.perf_counter()
                try:
                    discard(target)
                    error, data = build(compiler, flags, target, sources)
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
                library, problem, load_seconds, how = _load_checked(data, target, abi, bind, self_test)
                if problem is not None:
                    errors.append(_summary(flags, problem))
                    continue
            info = {
                "library": target,
                "loaded_from": how,
                "cached": cached,
                "build_seconds": build_seconds,
                "load_seconds": load_seconds,
                "flags": " ".join(flags),
                "compiler": f"{compiler} ({version})",
                "openmp": bool(library.cfbnn_openmp()),
                "error": None,
            }
            if compiling_since is not None:
                log.info("compiled the CPU kernels in %.1f s", time.perf_counter() - compiling_since)
            return library, info
    if compiling_since is not None:
        log.info(
            "the CPU kernels did not compile (%.1f s); the torch path serves", time.perf_counter() - compiling_since
        )
    return None, {"error": "\n".join(errors) or "no build succeeded"}
