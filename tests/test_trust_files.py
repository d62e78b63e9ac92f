"""Trust, files: the kernel cache loads only what this user built, no link inside a run dir or
the cache is written through, temporary-file cleanup touches only the CLI's own names, and
the config fingerprint covers input files by content. Each test first builds the fault the
issue "Trust, second pass" reproduced (a planted library, a link, a swapped data file), then
checks the named error or the correct result."""

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap

import pytest
from conftest import TRUST_REGRESSION as REGRESSION
from conftest import finish_all, one_line_error
from omegaconf import open_dict

from cfbnn_cli.cli import compose_config
from cfbnn_cli.moments import kernel_build, kernel_library
from cfbnn_cli.runtime import safefs
from cfbnn_cli.runtime.errors import ConfigError
from cfbnn_cli.runtime.io import atomic_write_text, remove_stale_temporary_files
from cfbnn_cli.runtime.rundir import claim_run_dir, config_fingerprint
from cfbnn_cli.runtime.threads import JobRegistry

AS_ROOT = os.geteuid() == 0


# ----------------------------------------------------------------------------- the kernel cache

needs_kernels = pytest.mark.skipif(
    kernel_library.load_kernels() is None, reason="fast CPU kernels unavailable (no C++ compiler?)"
)

LOAD_KERNELS = """
    import warnings
    warnings.simplefilter("always")
    from cfbnn_cli.moments import kernel_library
    info = kernel_library.fast_path_info()
    print("AVAILABLE", info["available"], "CACHED", info.get("cached"))
    print("ERROR", info.get("error"))
    """


COPYING_COMPILER = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "copying-c++ 1.0"; exit 0; fi
out=""; previous=""
for argument in "$@"; do [ "$previous" = "-o" ] && out="$argument"; previous="$argument"; done
cp {good} "$out"
"""  # a stand-in compiler that 'builds' by copying the library this test process built: what the
# cache does around a build is tested without a real 20-second build per test


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory):
    """A cache as a first run leaves it (built by the copying compiler), copied by each test."""
    folder = tmp_path_factory.mktemp("built")
    compiler = folder / "copying-c++"
    good = kernel_library.fast_path_info()["library"]
    compiler.write_text(COPYING_COMPILER.format(good=good))
    compiler.chmod(0o755)
    out = _load_in_subprocess(folder / "cache", compiler)
    assert "AVAILABLE True CACHED False" in out.stdout, out.stdout + out.stderr
    return folder / "cache", compiler


def _copy_of(built_cache, tmp_path):
    cache, compiler = built_cache
    shutil.copytree(cache, tmp_path / "cache")
    return tmp_path / "cache", compiler


def _load_in_subprocess(cache, compiler):
    env = dict(os.environ, CFBNN_CACHE_DIR=str(cache), CXX=str(compiler))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(LOAD_KERNELS)], env=env, capture_output=True, text=True, timeout=300
    )


def _built_library(cache):
    libraries = list(cache.glob("moments-*/cfbnn_moments.so"))
    assert len(libraries) == 1, libraries
    return libraries[0]


def _planted_library(tmp_path, marker):
    """A shared library whose constructor creates ``marker`` when it is loaded."""
    source = tmp_path / "planted.c"
    source.write_text(
        f"#include <stdio.h>\n__attribute__((constructor)) static void run(void) {{\n"
        f'  FILE *f = fopen("{marker}", "w"); if (f) fclose(f);\n}}\nint cfbnn_abi(void) {{ return 15; }}\n'
    )
    library = tmp_path / "planted.so"
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler to build the planted library")
    subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    return library


def _plain_hash_record(library):
    """A planted library with a plain SHA-256 record beside it that matches it (under both the
    old and the current record names): what a planter without the cache's key can write."""
    for suffix in (".sha256", kernel_build.HASH_SUFFIX):
        (library.parent / f"cfbnn_moments.so{suffix}").write_text(safefs.sha256_of_file(library) + "\n")


def _forge(library):
    """A planted library with a hash record that matches it, the library owned by another user."""
    _plain_hash_record(library)
    os.chown(library, 12345, 12345)


SCENARIOS = {  # name -> what is done to a copy of a built cache before a process loads from it
    "as built": None,
    "planted": "plant",
    "planted, with a matching plain hash record, by the same user": "plant+record",
    "planted, hash record forged, owned by another user": "plant+forge",
    "truncated": "truncate",
    "random bytes": "randomize",
}


@pytest.fixture(scope="module")
def cache_outcomes(built_cache, tmp_path_factory):
    """Every scenario prepared on its own copy of the cache, then loaded by processes started at
    once: ``{name: (completed process, library path, marker path)}``."""
    folder = tmp_path_factory.mktemp("scenarios")
    processes, files = {}, {}
    for index, (name, action) in enumerate(SCENARIOS.items()):
        if action == "plant+forge" and not AS_ROOT:
            continue  # a file of another user can be made only as root
        place = folder / f"s{index}"
        place.mkdir()
        cache, compiler = _copy_of(built_cache, place)
        library = _built_library(cache)
        marker = place / "planted-code-ran"
        if action and action.startswith("plant"):
            shutil.copy(_planted_library(place, marker), library)
            if action == "plant+forge":
                _forge(library)
            elif action == "plant+record":
                _plain_hash_record(library)
        elif action == "truncate":
            library.write_bytes(library.read_bytes()[: library.stat().st_size // 3])
        elif action == "randomize":
            library.write_bytes(os.urandom(library.stat().st_size))
        env = dict(os.environ, CFBNN_CACHE_DIR=str(cache), CXX=str(compiler))
        processes[name] = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(LOAD_KERNELS)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        files[name] = (library, marker)
    return {name: (out, *files[name]) for name, out in finish_all(processes).items()}


@needs_kernels
def test_a_fresh_cache_is_private_and_records_each_librarys_hash(built_cache, cache_outcomes):
    cache, compiler = built_cache
    library = _built_library(cache)
    for folder in (cache, library.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    key = kernel_build.record_key(cache)
    record = (library.parent / f"cfbnn_moments.so{kernel_build.HASH_SUFFIX}").read_text().strip()
    assert record == kernel_build.record_of(key, str(library.parent), library.read_bytes())
    assert stat.S_IMODE((cache / kernel_build.KEY_NAME).stat().st_mode) == 0o600
    again = cache_outcomes["as built"][0]
    assert "AVAILABLE True CACHED True" in again.stdout and "rebuilding" not in again.stderr


@needs_kernels
@pytest.mark.parametrize(
    "scenario",
    [
        "planted",
        "planted, with a matching plain hash record, by the same user",
        "planted, hash record forged, owned by another user",
    ],
)
def test_a_planted_library_is_never_loaded(cache_outcomes, scenario):
    """The fault: a .so with a constructor at the cache path ran as the user, even one planted
    by the same user with a matching SHA-256 beside it. Now its bytes must match the record
    made at build time under the cache's own key (and the library must be the user's own and
    writable by nobody else) before anything loads it."""
    if scenario not in cache_outcomes:
        pytest.skip("a file of another user can be made only as root")
    out, library, marker = cache_outcomes[scenario]
    assert out.returncode == 0, out.stderr
    assert not marker.exists(), "the planted library's code ran"
    reason = "owned by uid 12345" if "forged" in scenario else "does not match the content hash"
    assert reason in out.stderr and "rebuilding it" in out.stderr
    assert "AVAILABLE True" in out.stdout  # rebuilt, and the fast path still serves
    assert safefs.sha256_of_file(library) == safefs.sha256_of_file(kernel_library.fast_path_info()["library"])


@needs_kernels
@pytest.mark.parametrize("damage", ["truncated", "random bytes"])
def test_a_damaged_library_is_rebuilt_with_one_warning_instead_of_sigbus(cache_outcomes, damage):
    out = cache_outcomes[damage][0]
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])  # was 135 (SIGBUS) for a truncated file
    warnings = [line for line in out.stderr.splitlines() if "not loading the cached kernel library" in line]
    assert len(warnings) == 1 and "does not match the content hash" in warnings[0]
    assert "AVAILABLE True CACHED False" in out.stdout


def test_a_cache_directory_owned_by_someone_else_is_refused_and_the_torch_path_serves(tmp_path, monkeypatch):
    cache = tmp_path / "shared-cache"
    cache.mkdir(mode=0o777)
    monkeypatch.setenv("CFBNN_CACHE_DIR", str(cache))
    monkeypatch.setattr(safefs, "_this_user", lambda: os.geteuid() + 1)  # the directory is now "someone else's"
    library, info = kernel_library.load_library(rebuild=False)
    assert library is None and "kernel cache refused" in info["error"] and "not by you" in info["error"]
    assert not any(cache.iterdir())  # nothing built, nothing loaded from there


def test_a_cache_directory_of_ours_is_narrowed_to_0700_and_a_link_is_refused(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    os.chmod(mine, 0o777)
    safefs.private_directory(mine)
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    link = tmp_path / "link"
    link.symlink_to(mine)
    with pytest.raises(safefs.UnsafePathError, match="is a symbolic link"):
        safefs.private_directory(link)


def test_a_cache_under_a_parent_others_can_write_is_refused_and_the_torch_path_serves(tmp_path, monkeypatch):
    """The fault: a user who could write the cache dir's parent renamed the cache away and put
    their own in its place between the check and the load. The parents were never checked."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone may rename what is in it
    monkeypatch.setenv("CFBNN_CACHE_DIR", str(shared / "cache"))
    library, info = kernel_library.load_library(rebuild=False)
    assert library is None and "kernel cache refused" in info["error"]
    assert f"{shared} (a parent of" in info["error"] and "writable by other users" in info["error"]
    assert not list((shared / "cache").iterdir())  # nothing built, nothing loaded from there
    # below a link to such a directory: the directory the link leads to is judged too
    link = tmp_path / "mine"
    link.symlink_to(shared)
    with pytest.raises(safefs.UnsafePathError, match="writable by other users"):
        safefs.check_parents(link / "cache")


def test_the_parents_of_a_cache_may_be_roots_or_yours_and_sticky_ones_are_allowed(tmp_path):
    sticky = tmp_path / "tmp-like"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # like /tmp: others may add entries, not rename or remove ours
    safefs.check_parents(sticky / "cache" / "below")
    os.chmod(sticky, 0o775)
    with pytest.raises(safefs.UnsafePathError, match=r"writable by other users \(mode 775\)"):
        safefs.check_parents(sticky / "cache")
    os.chmod(sticky, 0o755)
    if AS_ROOT:
        os.chown(sticky, 12345, 12345)
        with pytest.raises(safefs.UnsafePathError, match="owned by uid 12345, neither root nor you"):
            safefs.check_parents(sticky / "cache")


# ----------------------------------------------------------------------------- links are not written through


def test_the_job_registry_neither_writes_through_nor_removes_a_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    jobs = tmp_path / "cache" / "jobs"
    jobs.mkdir(parents=True)
    (jobs / f"{socket.gethostname()}-{os.getpid()}").symlink_to(victim)
    with pytest.raises(safefs.UnsafePathError, match="symbolic link"):
        JobRegistry(jobs).register()
    assert victim.read_text() == "precious"  # was truncated
    (jobs / f"{socket.gethostname()}-{os.getpid()}").unlink()
    other = jobs / f"{socket.gethostname()}-999999"
    other.symlink_to(victim)
    registry = JobRegistry(jobs)
    registry.register()
    assert registry.count() == 1
    assert other.is_symlink() and victim.read_text() == "precious"


COUNT_JOBS = """
    import sys
    from cfbnn_cli.runtime.threads import JobRegistry
    registry = JobRegistry(sys.argv[1])
    registry.register()
    print("JOBS", registry.count())
    """


def _odd_entries(jobs, tmp_path):
    """A FIFO, a link, a directory and a socket among the registry's entries (another host's
    FIFO, and a link to a FIFO, too): none of them is a job, none must block a count."""
    host = socket.gethostname()
    os.mkfifo(jobs / f"{host}-999999")
    os.mkfifo(tmp_path / "elsewhere-fifo")
    (jobs / f"{host}-999998").symlink_to(tmp_path / "elsewhere-fifo")
    (jobs / f"{host}-999997").mkdir()
    bound = socket.socket(socket.AF_UNIX)
    bound.bind(str(jobs / f"{host}-999996"))
    bound.close()


def test_a_fifo_or_link_in_the_job_registry_is_ignored_and_never_blocks(tmp_path):
    """The fault: a FIFO named like a job's file hung every run with runtime.threads=auto,
    forever and silently (its open for reading waited for a writer)."""
    jobs = tmp_path / "cache" / "jobs"
    jobs.mkdir(parents=True, mode=0o700)
    _odd_entries(jobs, tmp_path)
    (jobs / f"{socket.gethostname()}-999995").write_text("")  # a finished job's file: removed
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(COUNT_JOBS), str(jobs)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "JOBS 1" in out.stdout
    left = sorted(path.name.rsplit("-", 1)[1] for path in jobs.iterdir())
    assert "999995" not in left and {"999999", "999998", "999997", "999996"} <= set(left)  # not removed


def test_a_fifo_at_this_jobs_own_name_is_refused_not_waited_on(tmp_path):
    jobs = tmp_path / "jobs"
    jobs.mkdir(mode=0o700)
    os.mkfifo(jobs / f"{socket.gethostname()}-999999")
    code = """
        import os, sys
        from cfbnn_cli.runtime.threads import JobRegistry
        os.getpid = lambda: 999999  # this job's own name is taken by the FIFO
        try:
            JobRegistry(sys.argv[1]).register()
        except OSError as error:
            print("REFUSED", error)
        """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(jobs)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "REFUSED" in out.stdout, out.stdout + out.stderr


@pytest.mark.slow
def test_a_run_with_threads_auto_finishes_despite_a_fifo_in_the_registry(tmp_path):
    cache = tmp_path / "cache"
    (cache / "jobs").mkdir(parents=True, mode=0o700)
    _odd_entries(cache / "jobs", tmp_path)
    run = tmp_path / "run"
    command = [sys.executable, "-m", "cfbnn_cli.cli", "train", "regression", *REGRESSION, "runtime.threads=auto"]
    out = subprocess.run(
        [*command, f"hydra.run.dir={run}"],
        env=dict(os.environ, CFBNN_CACHE_DIR=str(cache), CFBNN_FAST_MOMENTS="0"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (run / "done").exists()


LINKS = [".cfbnn/lock", "train_regression.log", "checkpoints"]


@pytest.fixture(scope="module")
def link_outcomes(tmp_path_factory):
    """A run into a run dir (a cfbnn run's: it holds ``.cfbnn/``; cfbnn writes no run into a folder of
    other files) holding each link, all started at once: ``{link: (process, run, victim dir)}``."""
    folder = tmp_path_factory.mktemp("links")
    processes, dirs = {}, {}
    for index, link in enumerate(LINKS):
        run, victim_dir = folder / f"run{index}", folder / f"victim{index}"
        (run / ".cfbnn").mkdir(parents=True)
        victim_dir.mkdir()
        (victim_dir / "file.txt").write_text("precious\n")
        (run / link).parent.mkdir(parents=True, exist_ok=True)
        (run / link).symlink_to(victim_dir if link == "checkpoints" else victim_dir / "file.txt")
        processes[link] = subprocess.Popen(
            [sys.executable, "-m", "cfbnn_cli.cli", "train", "regression", f"hydra.run.dir={run}", *REGRESSION],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, HYDRA_FULL_ERROR="0"),
        )
        dirs[link] = (run, victim_dir)
    return {link: (out, *dirs[link]) for link, out in finish_all(processes).items()}


@pytest.mark.parametrize("link", LINKS)
def test_a_link_in_a_run_dir_is_refused_with_one_line_and_its_target_is_untouched(link_outcomes, link):
    out, run, victim_dir = link_outcomes[link]
    text = one_line_error(out)
    assert "symbolic link" in text and link.split("/")[-1] in text
    assert (victim_dir / "file.txt").read_text() == "precious\n"
    assert sorted(p.name for p in victim_dir.iterdir()) == ["file.txt"]  # nothing written into a linked folder
    if link != "train_regression.log":  # refused before any output: the log it made is gone with it
        assert not (run / "train_regression.log").exists()


# ----------------------------------------------------------------------------- temporary files


def test_cleanup_removes_only_the_clis_own_temporary_names_in_its_own_folders(tmp_path):
    atomic_write_text(tmp_path / "kept.txt", "x")  # how the CLI names its temporary files
    stale = tmp_path / ".results.json.cfbnn-x1y2z3.tmp"
    stale.write_text("half")
    mine = [tmp_path / ".notes.tmp", tmp_path / ".results.json.k1ll3d.tmp", tmp_path / "sub" / ".a.cfbnn-q.tmp"]
    for path in mine:
        path.parent.mkdir(exist_ok=True)
        path.write_text("the user's")
    assert remove_stale_temporary_files(tmp_path) == [stale.name]
    assert all(path.read_text() == "the user's" for path in mine)


# ----------------------------------------------------------------------------- the fingerprint covers input files


def _claim(run, data_path, resume):
    cfg = compose_config("train_regression", ["data=csv", "data.target=y", f"resume={str(resume).lower()}"])
    with open_dict(cfg):
        cfg.data.path = str(data_path)
    return claim_run_dir(cfg, run)


def test_resuming_with_another_data_file_is_refused_wherever_the_file_lies(tmp_path):
    """The fault: with the first run's `done` removed, resume trained on a.csv and recorded b.csv
    (paths inside the run dir were left out of the fingerprint)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "a.csv").write_text("x,y\n1,2\n3,4\n5,7\n")
    (run / "b.csv").write_text("x,y\n1,2\n3,4\n5,9\n")
    _claim(run, run / "a.csv", resume=False)
    with pytest.raises(ConfigError, match=r"data.path#content"):
        _claim(run, run / "b.csv", resume=True)
    (run / "a.csv").write_text("x,y\n1,2\n3,4\n5,8\n")  # the same name, edited in place
    with pytest.raises(ConfigError, match=r"data.path#content"):
        _claim(run, run / "a.csv", resume=True)
    outside = tmp_path / "data.csv"
    outside.write_text("x,y\n1,2\n")
    _claim(run, outside, resume=False)
    outside.write_text("x,y\n1,3\n")
    with pytest.raises(ConfigError, match=r"data.path#content"):
        _claim(run, outside, resume=True)


def test_the_fingerprint_records_an_input_files_size_and_hash_but_not_the_runs_own_checkpoints(tmp_path):
    data = tmp_path / "d.csv"
    data.write_text("x,y\n1,2\n")
    cfg = compose_config("train_regression", REGRESSION)
    with open_dict(cfg):
        cfg.data.path = str(data)
        cfg.evaluation.checkpoint = str(tmp_path / "run" / "checkpoints" / "best.pt")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "best.pt").write_bytes(b"one")
    before = config_fingerprint(cfg, tmp_path / "run")
    (tmp_path / "run" / "checkpoints" / "best.pt").write_bytes(b"two: the run itself rewrites it")
    assert config_fingerprint(cfg, tmp_path / "run") == before
    data.write_text("x,y\n1,3\n")
    assert config_fingerprint(cfg, tmp_path / "run") != before
    record = json.dumps(claim_run_dir(cfg, tmp_path / "run"))
    assert record  # claimed without error
    stored = json.loads((tmp_path / "run" / ".cfbnn" / "config.json").read_text())["config"]
    assert stored["data.path#content"].startswith(f"{data.stat().st_size}:")
