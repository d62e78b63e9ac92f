"""The C++ CPU kernels as a torch extension: built at install by ``setup.py`` (where no compiler works,
the install succeeds with one line and the reference kernels serve), loaded once at import from the
package's own file after its checks, and nothing of ``ctypes`` or ``extern "C"`` left."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from reference_kernels import PRELUDE, package_without_library

from cfbnn_cli.moments import build_record, extension

REPO = Path(__file__).resolve().parents[2]
MOMENTS = REPO / "cfbnn_cli" / "moments"
LOADED = extension.status()["loaded"]
needs_library = pytest.mark.skipif(not LOADED, reason="the C++ CPU kernels were not built at install here")


def _setup_module():
    """``setup.py`` as a module (its ``setup()`` runs only as ``__main__``, as pip's backend runs it)."""
    spec = importlib.util.spec_from_file_location("cfbnn_setup", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_ctypes_and_no_extern_c_in_the_kernels():
    python = "\n".join(path.read_text() for path in MOMENTS.rglob("*.py"))
    assert "import ctypes" not in python and "CDLL" not in python
    for path in (MOMENTS / "csrc").iterdir():
        assert 'extern "C"' not in path.read_text(), path.name
    registrations = "".join((MOMENTS / "csrc" / name).read_text() for name in ("moment_ops.cpp", "elbo_ops.cpp"))
    assert registrations.count("TORCH_LIBRARY_IMPL(cfbnn, CPU, m)") == 2


@pytest.mark.parametrize("compiler", ["/bin/false", "missing"])
def test_an_install_without_a_working_compiler_says_so_in_one_line_and_builds_nothing(
    compiler, tmp_path, monkeypatch, capfd
):
    setup = _setup_module()
    if compiler == "missing":
        monkeypatch.delenv("CXX", raising=False)
        monkeypatch.setattr(setup.shutil, "which", lambda name: None)
    else:
        monkeypatch.setenv("CXX", compiler)
    target = tmp_path / "_C.so"
    reason = setup.build_library(target)
    assert reason is not None and not target.exists()
    assert ("does not build a program" if compiler == "/bin/false" else "no C++ compiler found") in reason
    setup.report(f"cfbnn: the C++ CPU kernels were not built ({reason}); {setup.SERVE}")
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("cfbnn:")]
    assert len(lines) == 1 and "the reference kernels will serve" in lines[0]


def test_the_package_works_on_the_reference_kernels_without_the_library(tmp_path):
    """The state an install without a compiler leaves: no library beside the package (a copy of it
    without one), every operator's reference kernel serves the CPU."""
    code = """
        import warnings, torch
        warnings.simplefilter("ignore")
        from cfbnn_cli.moments import extension, get_activation
        print("LOADED", extension.status()["loaded"])
        phi = get_activation("relu").moments(torch.zeros(3), torch.ones(3))[0]
        print("PHI", round(float(phi[0]), 6))
        table = torch._C._dispatch_dump_table("cfbnn::relu_tail")
        print("CPP", "elbo_ops.cpp" in table)
    """
    env = dict(os.environ, CFBNN_TEST_PACKAGE=package_without_library(tmp_path))
    command = [sys.executable, "-c", PRELUDE + textwrap.dedent(code)]
    out = subprocess.run(command, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "LOADED False" in out.stdout and "PHI 0.398942" in out.stdout and "CPP False" in out.stdout


@needs_library
def test_the_loaded_library_is_the_packages_own_and_registers_the_cpu_kernels():
    status = extension.status()
    assert Path(status["path"]).parent == MOMENTS and status["reason"] == ""
    table = torch._C._dispatch_dump_table("cfbnn::relu_family_moments")
    assert "CPU: registered at" in table and "moment_ops.cpp" in table


def _copy_library(tmp_path: Path) -> Path:
    """The package's library and its record, copied into ``tmp_path`` (what a check reads)."""
    source = Path(extension.status()["path"])
    copy = tmp_path / source.name
    shutil.copyfile(source, copy)
    shutil.copyfile(source.with_name(build_record.RECORD_NAME), tmp_path / build_record.RECORD_NAME)
    os.chmod(copy, 0o755)
    return copy


def _refusal(path: Path) -> str:
    """Why :func:`extension.load` refuses ``path`` (checked here without loading anything: this
    process has the package's library loaded already)."""
    fd = None
    try:
        fd = extension._open_checked(path)
        extension._check_record(path, fd)
    except extension.Refused as refusal:
        return str(refusal)
    finally:
        if fd is not None:
            os.close(fd)
    return ""


@needs_library
def test_a_symlinked_or_others_writable_library_is_refused(tmp_path):
    """The library file a symbolic link: refused; a folder on its path a link: loaded."""
    library = _copy_library(tmp_path)
    assert _refusal(library) == ""
    link = tmp_path / "elsewhere" / library.name
    link.parent.mkdir()
    link.symlink_to(library)
    shutil.copyfile(tmp_path / build_record.RECORD_NAME, link.parent / build_record.RECORD_NAME)
    assert "is a symbolic link" in _refusal(link)
    # a link among the folders on the way (a symlinked home, say) is not refused: the file is checked
    through = tmp_path / "linked-folder"
    through.symlink_to(tmp_path, target_is_directory=True)
    assert _refusal(through / library.name) == ""
    os.chmod(library, 0o775)
    assert "writable by other users" in _refusal(library)
    os.chmod(library, 0o755)
    os.chmod(tmp_path / build_record.RECORD_NAME, 0o666)
    assert "writable by other users" in _refusal(library)


@needs_library
@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another user can be made only as root")
def test_a_library_of_another_user_is_refused(tmp_path):
    library = _copy_library(tmp_path)
    os.chown(library, 12345, 12345)
    assert "owned by uid 12345" in _refusal(library)


@needs_library
@pytest.mark.parametrize("damage", ["truncated", "random bytes", "another torch", "another CPU", "other sources"])
def test_a_damaged_library_or_one_built_for_another_torch_or_cpu_is_refused_not_mapped(tmp_path, damage):
    """A truncated library would end the process with SIGBUS once mapped; the record's SHA-256 refuses
    it first, as it refuses one built for another torch (its C++ ABI) or CPU (-march=native)."""
    library = _copy_library(tmp_path)
    record = tmp_path / build_record.RECORD_NAME
    if damage == "truncated":
        library.write_bytes(library.read_bytes()[: library.stat().st_size // 3])
        want = "damaged, truncated or changed"
    elif damage == "random bytes":
        library.write_bytes(os.urandom(library.stat().st_size))
        want = "damaged, truncated or changed"
    elif damage == "another torch":
        sources = build_record.sources_digest(MOMENTS / "csrc")
        record.write_bytes(build_record.record(library.read_bytes(), "1.0.0", sources))
        want = "built for torch 1.0.0"
    elif damage == "another CPU":
        record.write_bytes(record.read_bytes().replace(build_record.cpu_signature().encode(), b"0" * 16))
        want = "built on another CPU"
    else:
        digest = build_record.sources_digest(MOMENTS / "csrc")
        record.write_bytes(record.read_bytes().replace(digest.encode(), b"0" * 64))
        want = "built from other C++ sources"
    assert want in _refusal(library)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = dict(extension._STATUS)
        extension._STATUS.update(loaded=False)
        try:
            status = extension.load(library)
        finally:
            extension._STATUS.clear()
            extension._STATUS.update(saved)
    assert not status["loaded"] and want in status["reason"]
    assert len([w for w in caught if "the reference kernels serve the CPU" in str(w.message)]) == 1


LOAD_ELSEWHERE = """
    import sys, torch
    from cfbnn_cli.moments import extension, get_activation
    status = extension.load(sys.argv[1])
    phi = get_activation("relu").moments(torch.zeros(3), torch.ones(3))[0]
    maps = open("/proc/self/maps").read()
    print("LOADED", status["loaded"], "PHI", round(float(phi[0]), 6), "MAPPED", sys.argv[2] in maps)
"""


@needs_library
def test_a_hard_link_to_the_library_is_loaded(tmp_path):
    """uv and conda install files as hard links: the inode's owner and mode are what is checked."""
    source = Path(extension.status()["path"])
    link = tmp_path / source.name
    os.link(source, link)
    shutil.copyfile(source.with_name(build_record.RECORD_NAME), tmp_path / build_record.RECORD_NAME)
    package = package_without_library(tmp_path / "package")  # (a package that has no library of its own)
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(LOAD_ELSEWHERE), str(link), "never-mapped"],
        env=dict(os.environ, CFBNN_TEST_PACKAGE=package),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "LOADED True PHI 0.398942" in out.stdout


PLANTED = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
  FILE* f = fopen("%s", "w");
  if (f) fclose(f);
}
"""


@needs_library
def test_a_library_planted_where_the_old_kernel_cache_was_is_never_loaded(tmp_path):
    """The old run-time loader read ``$CFBNN_CACHE_DIR`` (or ``~/.cache/cfbnn``); nothing reads it now."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the planted library")
    marker = tmp_path / "planted-code-ran"
    source = tmp_path / "planted.c"
    source.write_text(PLANTED % marker)
    caches = [tmp_path / "cache", tmp_path / "home" / ".cache" / "cfbnn"]
    for cache in caches:
        (cache / "moments-0123").mkdir(parents=True)
        library = cache / "moments-0123" / "cfbnn_moments.so"
        subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
        (library.parent / "cfbnn_moments.so.record").write_text("0" * 64 + "\n")
    env = dict(os.environ, CFBNN_CACHE_DIR=str(caches[0]), HOME=str(tmp_path / "home"))
    code = LOAD_ELSEWHERE.replace("status = extension.load(sys.argv[1])", "status = extension.status()")
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), "unused", "cfbnn_moments.so"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "LOADED True PHI 0.398942 MAPPED False" in out.stdout
    assert not marker.exists(), "the planted library's code ran"
