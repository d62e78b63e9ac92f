"""Trust, files: no link inside a run dir or the per-user cache is written through, temporary-file cleanup touches only the CLI's own names, and
the config fingerprint covers input files by content. Each test first builds the fault the
issue "Trust, second pass" reproduced (a planted library, a link, a swapped data file), then
checks the named error or the correct result."""

import json
import os
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
from cfbnn_cli.runtime import safefs
from cfbnn_cli.runtime.errors import ConfigError
from cfbnn_cli.runtime.io import atomic_write_text, remove_stale_temporary_files
from cfbnn_cli.runtime.rundir import claim_run_dir, config_fingerprint
from cfbnn_cli.runtime.threads import JobRegistry

AS_ROOT = os.geteuid() == 0


# ----------------------------------------------------------------------------- the per-user cache's folders
# (the C++ kernels no longer live there: tests/moments/test_extension.py checks what is loaded instead)


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


def test_a_cache_under_a_parent_others_can_write_is_refused(tmp_path):
    """The fault: a user who could write the cache dir's parent renamed the cache away and put
    their own in its place between the check and the use. The parents were never checked."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone may rename what is in it
    with pytest.raises(safefs.UnsafePathError, match="writable by other users"):
        safefs.check_parents(shared / "cache")
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
        env=dict(os.environ, CFBNN_CACHE_DIR=str(cache)),
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
