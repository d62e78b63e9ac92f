"""The CPU kernels' build: real source file, cache key, one builder at a time, recorded failures,
the compiler's message, and a CLI that runs where no compiler exists."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import TRUST_REGRESSION

from cfbnn_cli.moments import kernel_build

REPO = Path(__file__).resolve().parents[2]


def _python(code, env_update, timeout=300):
    env = dict(os.environ)
    env.update(env_update)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _fake_compiler(tmp_path: Path, body: str) -> Path:
    """A shell script standing in for the compiler: it logs each call's arguments (one line a
    call, in ``calls``), then runs ``body``."""
    script = tmp_path / "fake-c++"
    script.write_text(
        f'#!/bin/sh\nif [ "$1" = "--version" ]; then echo "fake 1.0"; exit 0; fi\necho "$*" >> "{tmp_path}/calls"\n{body}\n'
    )
    script.chmod(0o755)
    return script


def _kernel_compiles(tmp_path: Path) -> int:
    """How many times the fake compiler compiled the kernels' unit."""
    return sum("cfbnn_moments.cpp" in line for line in (tmp_path / "calls").read_text().splitlines())


def test_the_source_is_a_real_file_shipped_with_the_package():
    assert kernel_build.SOURCE_PATH.suffix == ".cpp" and kernel_build.SOURCE_PATH.is_file()
    source = kernel_build.read_source()
    assert 'extern "C" int cfbnn_abi(void)' in source
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"cfbnn_cli.moments" = ["csrc/*.cpp", "csrc/*.h"]' in pyproject
    assert set(kernel_build.read_sources()) == {"cfbnn_moments.cpp", "cfbnn_kernels.h", "cfbnn_ops.cpp"}


def test_an_operators_unit_that_does_not_build_leaves_no_library(tmp_path):
    """The two units compile side by side; the kernels are reached only through the operators
    that unit registers, so where it fails nothing is linked and its compiler message comes back
    (the operators then run their reference kernels)."""
    compiler = _fake_compiler(
        tmp_path,
        'case "$*" in *cfbnn_ops.cpp*) echo "cfbnn_ops.cpp:3:10: fatal error: torch/library.h: No such file" >&2; '
        'exit 1;; esac\nout=""; prev=""; for a in "$@"; do if [ "$prev" = "-o" ]; then out="$a"; fi; prev="$a"; done\n'
        'echo built > "$out"',
    )
    target = tmp_path / "cache" / "build" / kernel_build.LIBRARY_NAME
    target.parent.mkdir(parents=True, mode=0o700)
    flags = kernel_build.flag_sets()[-1]
    error = kernel_build.compile_library(str(compiler), flags, str(target), kernel_build.read_sources())
    assert "torch/library.h: No such file" in error
    calls = (tmp_path / "calls").read_text().splitlines()
    assert not [line for line in calls if " -c " not in f" {line} "]  # nothing linked
    assert not target.exists()


def test_the_cache_key_follows_source_compiler_flags_and_torch(monkeypatch):
    flags = kernel_build.flag_sets()[0]
    key = kernel_build.cache_key("src", "/usr/bin/g++", "g++ 12", flags, 15)
    assert key == kernel_build.cache_key("src", "/usr/bin/g++", "g++ 12", flags, 15)
    others = {
        kernel_build.cache_key("src2", "/usr/bin/g++", "g++ 12", flags, 15),
        kernel_build.cache_key("src", "/usr/bin/clang++", "g++ 12", flags, 15),
        kernel_build.cache_key("src", "/usr/bin/g++", "g++ 13", flags, 15),
        kernel_build.cache_key("src", "/usr/bin/g++", "g++ 12", kernel_build.flag_sets()[-1], 15),
        kernel_build.cache_key("src", "/usr/bin/g++", "g++ 12", flags, 16),
    }
    monkeypatch.setattr(kernel_build.torch, "__version__", "0.0.0-other")
    others.add(kernel_build.cache_key("src", "/usr/bin/g++", "g++ 12", flags, 15))
    assert key not in others and len(others) == 6


def test_a_failing_flag_set_is_recorded_with_the_compilers_message_and_not_retried(tmp_path, monkeypatch):
    compiler = _fake_compiler(tmp_path, 'echo "cfbnn_moments.cpp:1:1: error: no such intrinsic" >&2\nexit 1')
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("CFBNN_CACHE_DIR", str(tmp_path / "cache"))
    library, info = kernel_build.load_library(15, lambda lib: None, lambda lib: None)
    calls = _kernel_compiles(tmp_path)
    assert calls == len(kernel_build.flag_sets())  # each flag set compiled once
    assert library is None and "error: no such intrinsic" in info["error"]  # the compiler's own words
    # the next start (a new process would read the same records) does not compile again
    library, info = kernel_build.load_library(15, lambda lib: None, lambda lib: None)
    assert _kernel_compiles(tmp_path) == calls
    assert library is None and "recorded at an earlier start" in info["error"]
    assert "error: no such intrinsic" in info["error"]
    # rebuild=True tries again
    kernel_build.load_library(15, lambda lib: None, lambda lib: None, rebuild=True)
    assert _kernel_compiles(tmp_path) == 2 * calls


WARNING_CHECK = """
    import warnings, torch
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        from cfbnn_cli.moments import get_activation
        phi, _ = get_activation("relu").moments(torch.zeros(3), torch.ones(3))
    print("WARNING", [str(w.message) for w in caught if "unavailable" in str(w.message)])
    print("PHI", float(phi[0]))
"""


@pytest.fixture(scope="module")
def without_kernels(tmp_path_factory):
    """The two processes that run without the kernels, started at once: a compiler that fails
    with a message (``warning``), and the CLI where no compiler exists (``cli``, its run dir)."""
    failing, missing = tmp_path_factory.mktemp("failing"), tmp_path_factory.mktemp("missing")
    compiler = _fake_compiler(failing, 'echo "kernels.cpp:7:3: error: unknown type name float16x" >&2\nexit 1')
    warning = _python(WARNING_CHECK, {"CXX": str(compiler), "CFBNN_CACHE_DIR": str(failing / "cache")})
    env = dict(os.environ, CXX=str(missing / "no-such-compiler"), CFBNN_CACHE_DIR=str(missing / "cache"))
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cfbnn_cli.cli",
            "train",
            "regression",
            *TRUST_REGRESSION,
            f"hydra.run.dir={missing / 'run'}",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return {"warning": warning, "cli": cli}, missing / "run"


def test_the_warning_names_the_compilers_message(without_kernels):
    process = without_kernels[0]["warning"]
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    assert "error: unknown type name float16x" in out
    assert "PHI 0.398942" in out  # the reference path served


def test_one_builder_at_a_time_the_second_process_loads_what_the_first_built(tmp_path):
    """Two processes with a cold cache: the compiler runs once (the other waits on the lock and
    then finds the library). The fake compiler copies a real build, slowly, so that both
    processes are inside the load at once."""
    real = kernel_build.find_compiler()
    if real is None:
        pytest.skip("no C++ compiler")
    from cfbnn_cli.moments import kernel_library

    built = kernel_library.fast_path_info().get("library")
    if not built:
        pytest.skip("the kernels did not build here")
    compiler = _fake_compiler(
        tmp_path,
        'out=""; prev=""; for a in "$@"; do if [ "$prev" = "-o" ]; then out="$a"; fi; prev="$a"; done\n'
        f'sleep 2; cp "{built}" "$out"',
    )
    env = {"CXX": str(compiler), "CFBNN_CACHE_DIR": str(tmp_path / "cache")}
    code = """
        from cfbnn_cli.moments import kernel_library
        info = kernel_library.fast_path_info()
        print("AVAILABLE", info["available"], "CACHED", info.get("cached"))
    """
    processes = [_python(code, env) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in processes]
    for process, (out, err) in zip(processes, outputs):
        assert process.returncode == 0, err
        assert "AVAILABLE True" in out
    assert _kernel_compiles(tmp_path) == 1
    assert sorted("CACHED True" in out for out, _ in outputs) == [False, True]


def test_the_cli_runs_on_the_reference_path_without_a_compiler(without_kernels):
    processes, run = without_kernels
    stdout, stderr = processes["cli"].communicate(timeout=600)
    assert processes["cli"].returncode == 0, stderr[-2000:]
    assert (run / "done").exists()
    assert "no C++ compiler found" in stderr


def _tiny_library(folder: Path, name: str, value: int, marker: Path) -> Path:
    """A shared library standing in for the kernels (``cfbnn_abi`` 15), whose ``value()`` returns
    ``value``, and whose constructor creates ``marker`` when it is loaded."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    source = folder / f"{name}.c"
    source.write_text(
        "#include <stdio.h>\n"
        f'__attribute__((constructor)) static void ran(void) {{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n'
        f"int cfbnn_abi(void) {{ return 15; }}\nint cfbnn_openmp(void) {{ return 0; }}\n"
        f"int value(void) {{ return {value}; }}\n"
    )
    library = folder / f"{name}.so"
    subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    return library


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed in-memory copy", "private copy"])
def test_a_library_swapped_after_verification_is_never_the_one_that_runs(tmp_path, monkeypatch, sealed):
    """The fault: the cache was checked by path, then loaded by path again; whoever swapped the
    file in between (the same user racing, or another user who could write a parent) had their
    library loaded. Here the swap is made at the worst moment, after the check and before the
    load, with a record forged to match (as an attacker who read the cache's key would): the
    library that runs is still the one verified, and the swapped one's code never runs."""
    good = _tiny_library(tmp_path, "good", 1, tmp_path / "good-ran")
    evil = _tiny_library(tmp_path, "evil", 2, tmp_path / "evil-ran")
    compiler = _fake_compiler(
        tmp_path,
        'out=""; prev=""; for a in "$@"; do if [ "$prev" = "-o" ]; then out="$a"; fi; prev="$a"; done\n'
        f'cp "{good}" "$out"',
    )
    cache = tmp_path / "cache"
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("CFBNN_CACHE_DIR", str(cache))
    library, info = kernel_build.load_library(15, lambda lib: None, lambda lib: None)  # builds (copies `good`)
    assert library is not None and library.value() == 1 and info["cached"] is False
    target = Path(info["library"])

    swaps = []

    def swap(path):
        """The attacker's move: their library at the verified path, with a matching record."""
        assert path == str(target)
        shutil.copy(evil, tmp_path / "evil-copy")
        os.replace(tmp_path / "evil-copy", target)
        key = kernel_build.record_key(cache)
        record = kernel_build.record_of(key, str(target.parent), target.read_bytes())
        Path(str(target) + kernel_build.HASH_SUFFIX).write_text(record + "\n")
        swaps.append(path)

    monkeypatch.setattr(kernel_build, "_before_load", swap)
    if not sealed:  # a system without sealed in-memory files: the private copy is loaded instead
        monkeypatch.setattr(kernel_build, "sealed_copy", lambda *args: (_ for _ in ()).throw(OSError("no memfd")))
    library, info = kernel_build.load_library(15, lambda lib: None, lambda lib: None)
    assert swaps == [str(target)] and target.read_bytes() == evil.read_bytes()  # the swap did happen
    assert info["cached"] is True and library.value() == 1  # the verified library runs, not the swapped one
    assert not (tmp_path / "evil-ran").exists()
    assert info["loaded_from"] == ("a sealed in-memory copy" if sealed else "a private copy")


def test_a_verified_cached_library_that_fails_its_self_test_is_rebuilt_with_a_warning(tmp_path, monkeypatch):
    """The fault: a cached library that passed the check but failed to load or its self-test was
    passed over for a plainer flag set without a word."""
    good = _tiny_library(tmp_path, "good", 1, tmp_path / "good-ran")
    compiler = _fake_compiler(
        tmp_path,
        'out=""; prev=""; for a in "$@"; do if [ "$prev" = "-o" ]; then out="$a"; fi; prev="$a"; done\n'
        f'cp "{good}" "$out"',
    )
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("CFBNN_CACHE_DIR", str(tmp_path / "cache"))
    kernel_build.load_library(15, lambda lib: None, lambda lib: None)
    builds = _kernel_compiles(tmp_path)
    results = iter(["self-test failed (relative error 1e+00)"])
    with pytest.warns(RuntimeWarning, match="not loading the cached kernel library: .*self-test failed"):
        library, info = kernel_build.load_library(15, lambda lib: None, lambda lib: next(results, None))
    assert library is not None and info["cached"] is False and info["flags"] == " ".join(kernel_build.flag_sets()[0])
    assert _kernel_compiles(tmp_path) == builds + 1  # the same flag set, rebuilt
