"""Trust, outputs: no write through a link of either kind, one line for every output that cannot
be written, no run into the working directory by accident, and the small cases of issue "Trust,
third pass" (usage on stderr, a file's mode kept, a killed predict's temporary file cleaned, a
refused writer silent in the owner's log, files named by what they are, unread keys refused).
Each test first builds the fault the issue reproduced, then checks the one-line error or the
right result."""

import fcntl
import os
import shutil
import stat
import subprocess
import sys
import threading

import pytest
from conftest import TRUST_REGRESSION as REGRESSION
from conftest import one_line_error

from cfbnn_cli.runtime import safefs
from cfbnn_cli.runtime.io import atomic_write_text
from cfbnn_cli.runtime.rundir import RunDirLock
from cfbnn_cli.runtime.threads import JobRegistry

AS_ROOT = os.geteuid() == 0
# root without the capabilities that let it write anywhere: an ordinary user's permissions
AS_ORDINARY_USER = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
needs_root = pytest.mark.skipif(
    not AS_ROOT or shutil.which("setpriv") is None, reason="plays an ordinary user: needs root and setpriv"
)


def cfbnn(*args, cwd=None, prefix=(), timeout=300):
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    return subprocess.run(
        [*prefix, sys.executable, "-m", "cfbnn_cli.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=cwd,
    )


def error_line(out, code=2):
    """The one ``cfbnn: error:`` line of a process that exited ``code`` without a traceback."""
    one_line_error(out, code)
    errors = [line for line in out.stderr.splitlines() if line.startswith("cfbnn: error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A small finished `train regression` run, and a table of new rows for its model."""
    run = tmp_path_factory.mktemp("outputs") / "run"
    out = cfbnn("train", "regression", f"hydra.run.dir={run}", *REGRESSION)
    assert out.returncode == 0, out.stderr[-3000:]
    new = run.parent / "new.csv"
    new.write_text("x1,x2,x3,x4\n0.1,0.2,0.3,0.4\n1,2,3,4\n")
    return run, new


def _copy(run, target):
    shutil.copytree(run, target)
    return target


def _nobodys_folder(path):
    """A folder owned by another user (uid 65534), mode 0755: not writable by an ordinary user."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, 65534, 65534)
    path.chmod(0o755)
    return path


# ----------------------------------------------------------------------------- 2. no folder written through a symlink


@pytest.mark.slow
def test_a_symlinked_tensorboard_folder_is_refused_and_its_target_untouched(tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (run / ".cfbnn").mkdir(parents=True)  # a run dir (a folder of other files is refused before its links are met)
    elsewhere.mkdir()
    (run / "tensorboard").symlink_to(elsewhere, target_is_directory=True)
    out = cfbnn("train", "regression", f"hydra.run.dir={run}", "logger=tensorboard", *REGRESSION)
    line = error_line(out)
    assert "tensorboard is a symbolic link" in line and "remove the link" in line
    assert list(elsewhere.iterdir()) == []  # no event file written through the link
    assert sorted(p.name for p in run.iterdir()) == [".cfbnn", "tensorboard"]  # refused before any output: as it was
    assert not list((run / ".cfbnn").iterdir())


def test_every_writer_refuses_a_symlinked_folder_below_the_run_dir(tmp_path):
    """What any writer (a future logger, a new table) uses: below the folder a command writes
    under, every folder is made or checked, never followed; the root itself is the user's."""
    root, victim = tmp_path / "run", tmp_path / "victim"
    victim.mkdir()
    root.mkdir()
    (root / "figures").symlink_to(victim, target_is_directory=True)
    (root / "deep").mkdir()
    (root / "deep" / "er").symlink_to(victim, target_is_directory=True)
    with safefs.writing_under(root):
        for target in (root / "figures" / "a.csv", root / "deep" / "er" / "b" / "c.csv"):
            with pytest.raises(safefs.UnsafePathError, match="is a symbolic link"):
                atomic_write_text(target, "x")
        with pytest.raises(safefs.UnsafePathError, match="is a symbolic link"):
            safefs.output_folder(root / "figures" / "sub")
        atomic_write_text(root / "new" / "folder" / "d.csv", "fine")  # made, one folder at a time
    assert list(victim.iterdir()) == []
    assert (root / "new" / "folder" / "d.csv").read_text() == "fine"
    linked_root = tmp_path / "linked_root"
    linked_root.symlink_to(root, target_is_directory=True)
    with safefs.writing_under(linked_root):  # the folder the user named may be a link
        atomic_write_text(linked_root / "e.csv", "fine")
    assert (root / "e.csv").read_text() == "fine"


def test_a_symlink_at_a_file_written_whole_is_refused(tmp_path):
    victim = tmp_path / "victim.csv"
    victim.write_text("precious")
    (tmp_path / "out.csv").symlink_to(victim)
    with pytest.raises(safefs.UnsafePathError, match="out.csv is a symbolic link"):
        atomic_write_text(tmp_path / "out.csv", "new")
    assert victim.read_text() == "precious" and (tmp_path / "out.csv").is_symlink()


# ----------------------------------------------------------------------------- 3. no write through a hard link


@pytest.mark.slow
def test_a_run_dir_copied_with_cp_al_and_reused_leaves_the_originals_log_and_lock_alone(finished_run, tmp_path):
    run, _ = finished_run
    original = _copy(run, tmp_path / "original")
    (original / ".cfbnn" / "lock").write_text("the original's lock record")
    log, lock = (original / "train_regression.log").read_bytes(), (original / ".cfbnn" / "lock").read_bytes()
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-al", str(original), str(copy)], check=True)
    assert os.stat(copy / "train_regression.log").st_nlink == 2
    out = cfbnn("train", "regression", f"hydra.run.dir={copy}", "resume=true", *REGRESSION)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (original / "train_regression.log").read_bytes() == log  # nothing appended through the link
    assert (original / ".cfbnn" / "lock").read_bytes() == lock  # neither truncated nor rewritten
    assert "already finished, skipping" in (copy / "train_regression.log").read_text()
    assert (copy / "train_regression.log").read_bytes().startswith(log)  # the copy's own log, continued
    assert os.stat(copy / "train_regression.log").st_nlink == 1 and os.stat(copy / ".cfbnn" / "lock").st_nlink == 1


def test_a_hard_linked_lock_log_or_registry_entry_is_never_written_through(tmp_path):
    other = tmp_path / "other.txt"
    other.write_text("someone else's bytes\n")
    other.chmod(0o640)
    run = tmp_path / "run"
    (run / ".cfbnn").mkdir(parents=True)
    os.link(other, run / ".cfbnn" / "lock")
    with RunDirLock(run):
        assert "pid" in (run / ".cfbnn" / "lock").read_text()
    assert other.read_text() == "someone else's bytes\n"
    os.link(other, run / "job.log")
    handler = safefs.NoFollowFileHandler(run / "job.log")
    handler.stream.write("appended\n")
    handler.close()
    assert other.read_text() == "someone else's bytes\n"
    assert (run / "job.log").read_text() == "someone else's bytes\nappended\n"
    assert stat.S_IMODE((run / "job.log").stat().st_mode) == 0o640  # its copy keeps the mode
    jobs = tmp_path / "cache" / "jobs"
    jobs.mkdir(parents=True)
    import socket

    os.link(other, jobs / f"{socket.gethostname()}-{os.getpid()}")
    JobRegistry(jobs).register()
    assert other.read_text() == "someone else's bytes\n"


# ----------------------------------------------------------------------------- 7. outputs that cannot be written: one line


@pytest.mark.parametrize(
    "where, words",
    [("/proc/self/x", "cannot be made there"), (f"/tmp/{'a' * 300}", "too long")],
    ids=["proc", "long_name"],
)
def test_a_run_dir_that_cannot_be_made_is_one_line(where, words):
    out = cfbnn("train", "regression", f"hydra.run.dir={where}", *REGRESSION)
    line = error_line(out)
    assert words in line and "hydra.run.dir" in line and where[:40] in line
    assert len(line) < 600  # a long path is cut, and its length named
    assert "Unable to configure handler" not in out.stderr


@needs_root
def test_a_run_dir_an_ordinary_user_cannot_write_is_one_line(tmp_path):
    theirs = _nobodys_folder(tmp_path / "theirs")
    for where in (theirs, theirs / "sub" / "run"):
        out = cfbnn("train", "regression", f"hydra.run.dir={where}", *REGRESSION, prefix=AS_ORDINARY_USER)
        line = error_line(out)
        assert "permission denied" in line and str(theirs) in line and "choose a hydra.run.dir you can write" in line
    assert list(theirs.iterdir()) == []


@needs_root
@pytest.mark.slow
def test_a_folder_of_the_run_that_turns_unwritable_mid_run_is_one_line(tmp_path):
    run = tmp_path / "run"
    (run / ".cfbnn").mkdir(parents=True)  # a run dir whose checkpoints/ another user owns
    _nobodys_folder(run / "checkpoints")
    out = cfbnn("train", "regression", f"hydra.run.dir={run}", *REGRESSION, prefix=AS_ORDINARY_USER)
    line = error_line(out)
    assert "cannot write" in line and "checkpoints" in line and "permission denied" in line


@needs_root
@pytest.mark.slow
def test_predict_into_a_read_only_run_dir_or_out_folder_is_one_line(finished_run, tmp_path):
    run, new = finished_run
    theirs = _copy(run, tmp_path / "theirs")
    for path in [theirs, *theirs.rglob("*")]:
        os.chown(path, 65534, 65534, follow_symlinks=False)
    out = cfbnn("predict", str(theirs), str(new), prefix=AS_ORDINARY_USER)
    line = error_line(out)
    assert f"cannot write {theirs / 'predictions.csv'}: permission denied" in line and "--out" in line
    for target in (theirs / "p.csv", theirs / "new" / "p.csv"):
        line = error_line(cfbnn("predict", str(run), str(new), "--out", str(target), prefix=AS_ORDINARY_USER))
        assert "permission denied" in line and str(theirs) in line
    line = error_line(cfbnn("report", str(run), "--out", str(theirs / "rep"), prefix=AS_ORDINARY_USER))
    assert f"cannot write {theirs / 'rep'}: permission denied" in line and "--out a folder you can write" in line
    assert not list(theirs.glob(".*.tmp")) and not (theirs / "rep").exists()


@pytest.mark.parametrize("where", ["/proc/self/x", f"/tmp/{'b' * 300}/p.csv"], ids=["proc", "long_name"])
@pytest.mark.slow
def test_predict_and_report_outputs_that_cannot_be_made_are_one_line(finished_run, where):
    run, new = finished_run
    line = error_line(cfbnn("predict", str(run), str(new), "--out", where))
    assert "cannot write" in line and where[:40] in line and "--out" in line
    line = error_line(cfbnn("report", str(run), "--out", where))
    assert "cannot write" in line and where[:40] in line and "--out" in line


# ----------------------------------------------------------------------------- 11. an empty hydra.run.dir


@pytest.mark.parametrize(
    "override",
    ["hydra.run.dir=", "hydra.run.dir=''", "hydra.run.dir=${oc.env:CFBNN_TEST_SURELY_UNSET,''}"],
    ids=["empty", "quoted", "unset_variable"],
)
def test_an_empty_run_dir_is_refused_and_the_working_directory_left_alone(tmp_path, override):
    (tmp_path / "mine.txt").write_text("mine")
    out = cfbnn("train", "regression", override, *REGRESSION, cwd=tmp_path)
    line = error_line(out)
    assert "hydra.run.dir is empty" in line and "working directory" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]


def test_an_empty_sweep_dir_is_refused_before_any_job(tmp_path):
    out = cfbnn("train", "regression", "-m", *REGRESSION, "seed=0,1", "hydra.sweep.dir=", cwd=tmp_path)
    line = error_line(out)
    assert "hydra.sweep.dir is empty" in line
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- 15. the small cases


def test_a_bare_cfbnn_prints_its_usage_on_stderr_and_exits_2():
    out = cfbnn()
    assert out.returncode == 2 and out.stdout == ""
    assert "usage: cfbnn" in out.stderr


@pytest.mark.slow
def test_predict_over_a_0600_file_keeps_its_mode(finished_run, tmp_path):
    run, new = finished_run
    target = tmp_path / "private.csv"
    target.write_text("old\n")
    target.chmod(0o600)
    out = cfbnn("predict", str(run), str(new), "--out", str(target))
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and target.read_text().startswith("row,")


@pytest.mark.slow
def test_predict_removes_the_temporary_file_a_killed_predict_left_and_only_that(finished_run, tmp_path):
    run, new = finished_run
    out_path = tmp_path / "predictions.csv"
    stale = tmp_path / ".predictions.csv.cfbnn-k1ll3d.tmp"  # as a predict killed with -9 leaves it
    stale.write_text("half a file")
    kept = [
        tmp_path / ".predictions.csv.mine.tmp",  # a user's own name
        tmp_path / ".other.csv.cfbnn-x1y2z3.tmp",  # another output's
        tmp_path / ".predictions.csv.cfbnn-l1v3.tmp",  # a write still going on (its writer holds the lock)
    ]
    for path in kept:
        path.write_text("not stale")
    live = os.open(kept[-1], os.O_RDONLY)
    try:
        fcntl.flock(live, fcntl.LOCK_EX)
        out = cfbnn("predict", str(run), str(new), "--out", str(out_path))
    finally:
        os.close(live)
    assert out.returncode == 0, out.stderr
    assert not stale.exists() and all(path.read_text() == "not stale" for path in kept)


@pytest.mark.slow
def test_predict_after_a_kill_9_leaves_no_temporary_file_behind(finished_run, tmp_path):
    run, new = finished_run
    big = tmp_path / "big.csv"
    with big.open("w") as handle:
        handle.write("x1,x2,x3,x4\n")
        handle.writelines("0.1,0.2,0.3,0.4\n" for _ in range(400_000))
    out_path = tmp_path / "predictions.csv"
    process = subprocess.Popen(
        [sys.executable, "-m", "cfbnn_cli.cli", "predict", str(run), str(big), "--out", str(out_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(600):  # until it writes its temporary file
            if list(tmp_path.glob(".predictions.csv.cfbnn-*.tmp")):
                break
            if process.poll() is not None:
                pytest.skip("predict finished before it could be killed")
            subprocess.run(["sleep", "0.05"])
        process.kill()
    finally:
        process.wait()
    assert list(tmp_path.glob(".predictions.csv.cfbnn-*.tmp"))  # what the issue found left behind
    small = big.with_name("small.csv")
    small.write_text("x1,x2,x3,x4\n0.1,0.2,0.3,0.4\n")
    out = cfbnn("predict", str(run), str(small), "--out", str(out_path))
    assert out.returncode == 0, out.stderr
    assert not list(tmp_path.glob(".predictions.csv.cfbnn-*.tmp"))


@pytest.mark.slow
def test_a_refused_second_writer_adds_nothing_to_the_owners_log(finished_run, tmp_path):
    run, _ = finished_run
    owned = _copy(run, tmp_path / "owned")
    before = (owned / "train_regression.log").read_bytes()
    lock = RunDirLock(owned).acquire()  # the owner, writing there: its metrics.csv changes all the time
    stop = threading.Event()

    def owner_writes():
        stamp = 0
        while not stop.wait(0.002):
            stamp += 1_000_000
            os.utime(owned / "metrics.csv", ns=(stamp, stamp))

    writer = threading.Thread(target=owner_writes)
    writer.start()
    try:
        out = cfbnn("train", "regression", f"hydra.run.dir={owned}", "overwrite=true", *REGRESSION)
    finally:
        stop.set()
        writer.join()
        lock.release()
    line = error_line(out)
    assert "another cfbnn run" in line
    assert (owned / "train_regression.log").read_bytes() == before


@pytest.mark.slow
def test_a_fifo_a_directory_and_an_unfinished_run_are_named_as_such(finished_run, tmp_path):
    run, new = finished_run
    fifo, folder = tmp_path / "rows.csv", tmp_path / "folder.csv"
    os.mkfifo(fifo)
    folder.mkdir()
    assert "a FIFO, not a regular file" in error_line(cfbnn("predict", str(run), str(fifo), timeout=60))
    assert "a directory" in error_line(cfbnn("predict", str(run), str(folder)))
    assert "a FIFO, not a regular file" in error_line(cfbnn("predict", str(fifo), str(new), timeout=60))
    interrupted = _copy(run, tmp_path / "interrupted")
    for name in ("results.json", "done", "model.pt"):
        (interrupted / name).unlink()
    line = error_line(cfbnn("predict", str(interrupted), str(new)))
    assert "has not finished" in line and "resume=true" in line and "not a cfbnn run dir" not in line


@pytest.mark.parametrize("override", ["+foo=1", "++foo=1", "+trainer.momentum=0.9"])
def test_an_added_key_no_config_has_is_refused_naming_it(tmp_path, override):
    out = cfbnn("train", "regression", f"hydra.run.dir={tmp_path / 'run'}", override, *REGRESSION)
    line = error_line(out)
    key = override.lstrip("+").split("=")[0]
    assert f"adds the key '{key}'" in line and "does not read" in line
    assert not (tmp_path / "run").exists()


def test_added_keys_that_are_read_still_pass(tmp_path):
    out = cfbnn(
        "train", "regression", "++trainer.epochs=1", "+hydra.job.env_set.CFBNN_X=1", *REGRESSION, "--cfg", "job"
    )
    assert out.returncode == 0, out.stderr
