"""A run directory's identity and ownership: the config fingerprint and the lock.

Everything cfbnn keeps about a run dir (as opposed to the run's outputs) lives in
``<run dir>/.cfbnn/``:

* ``config.json`` -- the fingerprint of the resolved config that owns the dir and the
  flattened config it was computed from, so that a refusal can name the keys that
  differ. ``resume=true`` continues only a run with the same fingerprint; ``done``
  counts only for it (:func:`claim_run_dir`).
* ``lock`` -- held (``fcntl.flock``) by the process writing to the dir, with its pid
  inside. A second run into the dir exits naming that pid; the kernel releases the
  lock when its owner dies, so a lock left by a killed run is simply taken over.

A finished run's dir (``done`` or ``results.json``) takes a new run only with ``resume=true``
(a finished job is skipped) or ``overwrite=true`` (its outputs are replaced)
(:func:`refuse_finished_run`). A run that fails before it writes any output leaves its dir as
it found it, and leaves no dir where it made one (:class:`RunDirState`).

The fingerprint ignores the keys that do not change results (:data:`IGNORED_KEYS`:
``resume``, ``overwrite``, ``device``, ``runtime.threads``; ``runtime.matmul_precision`` at its default,
the value runs had before the key, :data:`SILENT_DEFAULTS`), records a path inside the run dir relative to
it (a moved run dir still resumes), and covers every input file a key names by its size
and SHA-256 (:func:`fingerprinted_config`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .errors import CheckpointError, ConfigError
from .io import (
    TEMPORARY_MARKER,
    TEMPORARY_SUFFIX,
    atomic_write_bytes,
    atomic_write_json,
    file_mode,
    remove_stale_temporary_files,
)
from .safefs import UnsafePathError, open_in_place, open_no_follow, output_folder, output_over_input, shown_path

log = logging.getLogger(__name__)

IGNORED_KEYS = frozenset({"resume", "overwrite", "device", "runtime.threads"})
# keys added after runs were made, at the value that every run before them had: left out of the
# fingerprint there, so that a run made before the key existed still resumes
SILENT_DEFAULTS = {"runtime.matmul_precision": "highest"}
STATE_FOLDER = ".cfbnn"


def _flatten(tree, prefix: str = "") -> Dict[str, object]:
    out: Dict[str, object] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
    else:
        out[prefix[:-1]] = tree
    return out


def _looks_like_path(value: str) -> bool:
    return bool(value) and ("/" in value or os.sep in value or bool(Path(value).suffix))


def _inside(path: Path, run_dir: Optional[Path]) -> Optional[Path]:
    """``path`` relative to ``run_dir`` if it lies inside it, else ``None``."""
    if run_dir is None:
        return None
    try:
        return path.resolve().relative_to(Path(run_dir).resolve())
    except (OSError, ValueError, RuntimeError):
        return None


_CONTENT_CACHE: Dict[Tuple[str, int, int, int], str] = {}


def file_signature(path: Path) -> Optional[str]:
    """``<size>:<sha256>`` of a regular file (``None`` for anything else), cached per process by
    (path, inode, size, mtime) so that the several fingerprints of one run hash it once."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            return None
        key = (str(path.resolve()), info.st_ino, info.st_size, info.st_mtime_ns)
        if key not in _CONTENT_CACHE:
            digest = hashlib.sha256()
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
            _CONTENT_CACHE[key] = f"{info.st_size}:{digest.hexdigest()}"
        return _CONTENT_CACHE[key]
    except OSError:
        return None


def fingerprinted_config(cfg, run_dir=None) -> Dict[str, object]:
    """The flattened resolved config that the fingerprint covers.

    The keys of :data:`IGNORED_KEYS` are left out, and those of :data:`SILENT_DEFAULTS` at that
    value. A value naming a path inside the run
    dir is recorded relative to it (``<run dir>/x.csv``), so a run dir that was moved still
    resumes. A value naming an existing regular file adds ``<key>#content``, its size and
    SHA-256: a data file edited or swapped between a run and its resume changes the
    fingerprint. Files in cfbnn's own folders of the run dir (its checkpoints) change
    while the run goes on and are covered by path only.
    """
    from omegaconf import DictConfig, OmegaConf

    container = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    container.pop("hydra", None)
    out: Dict[str, object] = {}
    for key, value in sorted(_flatten(container).items()):
        if key in IGNORED_KEYS or (key in SILENT_DEFAULTS and SILENT_DEFAULTS[key] == value):
            continue
        if isinstance(value, str) and _looks_like_path(value):
            path = Path(value).expanduser()
            relative = _inside(path, run_dir)
            if relative is not None:
                value = f"<run dir>/{relative.as_posix()}"
            own = relative is not None and relative.parts[:1] in {(name,) for name in OWN_FOLDERS}
            signature = None if own else file_signature(path)
            if signature is not None:
                out[f"{key}#content"] = signature
        out[key] = value
    return dict(sorted(out.items()))


def config_fingerprint(cfg, run_dir=None) -> str:
    """A short hash of :func:`fingerprinted_config`: equal for configs that give the same results."""
    flat = fingerprinted_config(cfg, run_dir)
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]


def differing_keys(recorded: Dict[str, object], current: Dict[str, object]) -> List[str]:
    """``key: old -> new`` for every key whose value differs (or exists in only one)."""
    missing = object()
    lines = []
    for key in sorted(set(recorded) | set(current)):
        old, new = recorded.get(key, missing), current.get(key, missing)
        if json.dumps(old, default=str) != json.dumps(new, default=str):
            show = lambda v: "(absent)" if v is missing else json.dumps(v, default=str)  # noqa: E731
            lines.append(f"{key}: {show(old)} -> {show(new)}")
    return lines


def refuse_other_config(what: str, recorded: Optional[str], current: str) -> None:
    """Raise :class:`ConfigError` unless a file's recorded fingerprint is ``current``."""
    if not isinstance(recorded, str) or recorded != current:
        shown = recorded if isinstance(recorded, str) and recorded else "none"
        raise ConfigError(
            f"{what} was written by another configuration (fingerprint {shown:.40}, this run's is {current}); "
            "resume=true continues only the same configuration: start a fresh run dir, or delete it"
        )


# the folders cfbnn writes inside a run dir (beside the run dir itself)
OWN_FOLDERS = (STATE_FOLDER, ".hydra", "checkpoints", "distributed")


def refuse_links_inside(run_dir, *names: str) -> None:
    """Raise :class:`ConfigError` if any of ``names`` inside ``run_dir`` is a symbolic link: cfbnn
    would write through it (a linked ``checkpoints/`` sends every checkpoint elsewhere)."""
    for name in names:
        path = Path(run_dir) / name
        if path.is_symlink():
            raise ConfigError(
                f"{path} is a symbolic link; cfbnn does not write through links in a run dir: "
                "remove the link, or choose another hydra.run.dir"
            )


# ----------------------------------------------------------------------------- the lock


class RunDirBusyError(ConfigError):
    """Another cfbnn run holds the run dir's lock (it is writing there)."""


class RunDirLock:
    """An exclusive, advisory lock on a run dir (``<run dir>/.cfbnn/lock``), with the owner's pid.

    ``fcntl.flock`` is released by the kernel when its owner exits, however it exits,
    so a stale lock never blocks a later run; where ``flock`` is unavailable a lock
    file whose pid is no longer alive on this host is taken over.
    """

    def __init__(self, run_dir):
        self.path = Path(run_dir) / STATE_FOLDER / "lock"
        self._handle = None
        self._found: Optional[str] = None  # the lock file's text before acquire (None: there was none)

    def _owner(self) -> str:
        try:
            info = json.loads(self.path.read_text(errors="replace")[:4096] or "{}")
        except (OSError, ValueError, RecursionError):
            return "another process"
        if not isinstance(info, dict):
            return "another process"
        return f"pid {info.get('pid', '?')} on {info.get('host', '?')} (since {info.get('started', '?')})"

    def acquire(self) -> "RunDirLock":
        refuse_links_inside(self.path.parent.parent, STATE_FOLDER)
        output_folder(self.path.parent)
        for _ in range(5):
            existed = os.path.lexists(self.path)
            # never through a link of either kind: the lock is truncated below, and its old content logged
            try:
                handle = os.fdopen(open_in_place(self.path, os.O_RDWR | os.O_CREAT, file_mode()), "r+")
            except UnsafePathError as error:
                raise ConfigError(f"{error}, or choose another hydra.run.dir") from None
            try:
                import fcntl

                try:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    handle.close()
                    raise RunDirBusyError(
                        f"another cfbnn run ({self._owner()}) is writing to {self.path.parent.parent}; wait for it "
                        "to finish, or choose another hydra.run.dir"
                    ) from None
            except ImportError:  # pragma: no cover - no fcntl (Windows): pid liveness instead
                self._acquire_by_pid()
            if self._names_this_file(handle.fileno()):
                break
            handle.close()  # the name was replaced meanwhile (a hard link broken by a run beside this one)
        else:
            raise ConfigError(
                f"{self.path} keeps being replaced while cfbnn takes it; is another program writing to "
                f"{self.path.parent.parent}? Choose another hydra.run.dir"
            )
        handle.seek(0)
        found = handle.read()
        self._found = found if existed else None
        previous = found.strip()
        if previous:
            log.info("took over the lock of a finished or killed run (%s)", previous)
        handle.seek(0)
        handle.truncate()
        handle.write(
            json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
            )
        )
        handle.flush()
        self._handle = handle
        return self

    def _names_this_file(self, fd: int) -> bool:
        """Does the lock's name still lead to the file ``fd`` holds, and only its name?"""
        try:
            now, held = os.lstat(self.path), os.fstat(fd)
        except OSError:
            return False
        return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino) and held.st_nlink == 1

    def _acquire_by_pid(self) -> None:  # pragma: no cover - exercised only without fcntl
        try:
            info = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            info = {}
        pid = info.get("pid")
        if pid and pid != os.getpid() and info.get("host") == socket.gethostname():
            try:
                os.kill(int(pid), 0)
            except OSError:
                return  # its owner is gone: take it over
            raise RunDirBusyError(
                f"another cfbnn run ({self._owner()}) is writing to {self.path.parent.parent}; wait for it to "
                "finish, or choose another hydra.run.dir"
            )

    @property
    def held(self) -> bool:
        return self._handle is not None

    def release(self) -> None:
        if self._handle is not None:
            self._handle.seek(0)
            self._handle.truncate()  # an empty lock file: nobody owns the dir
            self._handle.close()  # closing releases the flock
            self._handle = None

    def release_as_found(self) -> None:
        """Release the lock and leave its file as :meth:`acquire` found it: removed if there was
        none (while still held, so no other run holds a removed file), else its old text."""
        if self._handle is None:
            return
        if self._found is None:
            self.path.unlink(missing_ok=True)
        else:
            self._handle.seek(0)
            self._handle.truncate()
            self._handle.write(self._found)
        self._handle.close()
        self._handle = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# ----------------------------------------------------------------------------- claiming a run dir

# what a run leaves in its dir; any of them means "a run was here"
_RUN_ARTIFACTS = ("done", "results.json", "checkpoints", "uci_progress.json", "metrics.csv")
# any of them means "a run finished here" (completed, or failed with its reason recorded)
FINISHED_MARKERS = ("done", "results.json")


def refuse_finished_run(cfg, run_dir) -> None:
    """Raise :class:`ConfigError` when ``run_dir`` holds a finished run (:data:`FINISHED_MARKERS`)
    and neither ``resume=true`` (continue it; a finished job is skipped) nor ``overwrite=true``
    (replace its outputs) was given: a new run must not replace a finished one by accident.
    Reads only; the CLI calls it before the dir is locked (so a refused run changes nothing in
    it) and :func:`claim_run_dir` again under the lock."""
    if cfg.get("resume", False) or cfg.get("overwrite", False):
        return
    found = [name for name in FINISHED_MARKERS if os.path.lexists(Path(run_dir) / name)]
    if found:
        raise ConfigError(
            f"{run_dir} holds a finished run ({', '.join(found)}); add resume=true to continue it (a finished "
            "job is skipped) or overwrite=true to replace its outputs, or choose another hydra.run.dir (hydra.sweep.dir "
            "for a sweep)"
        )


# ----------------------------------------------------------------------------- whose folder it is

SHOWN_ENTRIES = 5  # entries of a foreign folder named in its refusal


def recorded_command(run_dir) -> Optional[str]:
    """The command (``train_regression``, ...) whose run owns ``run_dir``: from ``.cfbnn/config.json``
    (``command``), else from ``results.json`` (``pipeline``); ``None`` where neither says."""
    for name, key in ((f"{STATE_FOLDER}/config.json", "command"), ("results.json", "pipeline")):
        ours, content = _regular_bytes(Path(run_dir) / name)
        if not ours or content is None or len(content) > (1 << 24):
            continue
        try:
            value = json.loads(content).get(key)
        except (ValueError, AttributeError, RecursionError):
            continue
        if isinstance(value, str) and value:
            return value
    return None


def _some_entries(folder: Path, ignore=()) -> List[str]:
    """Up to :data:`SHOWN_ENTRIES` + 1 names in ``folder`` (not those of ``ignore``); a folder that
    cannot be listed counts as empty (making or writing there then says why)."""
    names: List[str] = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name not in ignore:
                    names.append(entry.name)
                    if len(names) > SHOWN_ENTRIES:
                        break
    except OSError:
        return []
    return sorted(names)


def foreign_run_dir(run_dir, command: Optional[str] = None, key: str = "hydra.run.dir", ignore=()) -> Optional[str]:
    """Why a run of ``command`` must not be written into ``run_dir``, in one line; ``None`` where it may.

    A run goes into a folder that does not exist yet, an empty folder (or one holding only the
    command's log: a run stopped before it took the dir), or a cfbnn run dir (it holds ``.cfbnn/``)
    of the same command (``resume=true`` continues it, ``overwrite=true`` replaces
    it). Anything else -- ``/``, a home, the working directory with files in it, another
    command's run -- would mix the run's files with files that are not its own. ``ignore``: names
    this run has already made there (the log Hydra opened). Reads only."""
    run_dir = Path(os.path.abspath(run_dir))
    if not os.path.isdir(run_dir):  # new (or a file in the way: making the folder says so)
        return None
    fix = f"choose another {key} (a new or empty folder, e.g. {key}=outputs/my_run; an unset shell variable?)"
    if _real_dir(run_dir / STATE_FOLDER):
        other = recorded_command(run_dir)
        if command is None or other is None or other == command:
            return None
        return (
            f"{shown_path(run_dir)} holds a `cfbnn {other.replace('_', ' ')}` run; `cfbnn {command.replace('_', ' ')}` does not "
            f"write into another command's run dir (its files would be mixed with that run's): {fix}"
        )
    names = _some_entries(run_dir, ignore)
    if not names or (command is not None and names == [f"{command}.log"]):  # a run stopped before it took the dir
        return None
    shown = ", ".join(names[:SHOWN_ENTRIES]) + (", ..." if len(names) > SHOWN_ENTRIES else "")
    return (
        f"{key}: {shown_path(run_dir)} is a folder with other files in it ({shown}) and not a cfbnn run dir; a run is "
        f"written only into a new folder, an empty one or a cfbnn run's own: {fix}"
    )


# the files a finished run holds about itself beside its bookkeeping (and the tables and figures results.json lists)
RUN_FILES = (f"{STATE_FOLDER}/lock", "metrics.csv", "model.pt", "head.pt")


def run_records(run_dir) -> List[Path]:
    """The files a run wrote about itself and its results, as far as they exist: its bookkeeping
    (``results.json``, ``done``, ``.cfbnn/``, ``.hydra/``), logs, ``metrics.csv``, model files,
    checkpoints and the tables and figures its ``results.json`` lists. What ``cfbnn predict`` and
    ``cfbnn report`` read from a run: no command's output may be written over one of them."""
    run_dir = Path(run_dir)
    names = {*BOOKKEEPING, *RUN_FILES}
    ours, content = _regular_bytes(run_dir / "results.json")
    try:
        record = json.loads(content) if ours and content is not None and len(content) < (1 << 24) else {}
    except (ValueError, RecursionError):
        record = {}
    for field in ("tables", "figures"):
        listed = record.get(field) if isinstance(record, dict) else None
        for value in listed.values() if isinstance(listed, dict) else ():
            for name in value if isinstance(value, list) else [value]:
                if isinstance(name, str) and name and not os.path.isabs(name) and ".." not in Path(name).parts:
                    names.add(name)
    paths = [run_dir / name for name in sorted(names)]
    for folder, pattern in (("", "*.log"), ("checkpoints", "*")):
        try:
            paths += sorted((run_dir / folder).glob(pattern))
        except OSError:
            pass
    return [path for path in paths if os.path.lexists(path)]


def refuse_output_over_input(out, inputs, source=None) -> None:
    """Raise :class:`ConfigError` where the output ``out`` is one of a command's ``inputs`` (``(what,
    path)`` pairs) or, where ``source`` is a run dir (or a file in one), one of that run's records
    (:func:`run_records`), compared by file identity (:func:`~.safefs.output_over_input`)."""
    inputs = list(inputs)
    if source is not None and not os.path.isdir(source):  # a model file in a run dir: that run's records too
        source = Path(source).parent if os.path.lexists(Path(source).parent / "results.json") else None
    if source is not None:
        inputs += [(f"a record of the run {shown_path(source)}", record) for record in run_records(source)]
    problem = output_over_input(out, inputs)
    if problem is not None:
        raise ConfigError(problem)


def _read_record(run_dir: Path) -> Optional[dict]:
    path = run_dir / STATE_FOLDER / "config.json"
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
            raise ValueError("not a cfbnn config record")
        return record
    except (OSError, ValueError, RecursionError) as error:
        raise CheckpointError(
            f"{path} is unreadable ({type(error).__name__}: {str(error)[:200]}); it records which configuration owns {run_dir}. "
            "Start a fresh run dir (another hydra.run.dir), or delete that file and run with resume=false"
        ) from None


def claim_run_dir(cfg, run_dir, command: Optional[str] = None) -> Tuple[str, bool]:
    """Bind ``run_dir`` to this config before any work; returns ``(fingerprint, finished)``.

    Call it while holding :class:`RunDirLock`. ``finished`` is True when ``resume=true``
    finds this very configuration already done (the caller skips the run). Raises
    :class:`ConfigError` when ``resume=true`` meets another configuration, naming the
    keys that differ. With ``resume=false`` a finished run is refused
    (:func:`refuse_finished_run`) unless ``overwrite=true``, and then its ``done`` and
    ``results.json`` are removed first (the new run replaces it), so a half-finished new
    run is never mistaken for the old finished one. ``command`` (``train_regression``, ...) is
    recorded beside the fingerprint; a dir another command's run owns is refused
    (:func:`foreign_run_dir`).
    """
    run_dir = Path(run_dir)
    refuse_links_inside(run_dir, *OWN_FOLDERS)
    other = recorded_command(run_dir) if command is not None else None
    if other is not None and other != command:
        raise ConfigError(foreign_run_dir(run_dir, command))
    refuse_finished_run(cfg, run_dir)
    removed = [
        str(Path(sub) / name) for sub in ("",) + OWN_FOLDERS for name in remove_stale_temporary_files(run_dir / sub)
    ]
    if removed:
        log.info("removed %d temporary file(s) left by a killed run: %s", len(removed), ", ".join(removed))
    current = fingerprinted_config(cfg, run_dir)
    fingerprint = config_fingerprint(cfg, run_dir)
    record = _read_record(run_dir)
    leftovers = [name for name in _RUN_ARTIFACTS if (run_dir / name).exists()]
    finished = False
    if cfg.get("resume", False):
        if record is None and leftovers:
            raise ConfigError(
                f"resume=true, but {run_dir} holds {', '.join(leftovers)} without a config record "
                f"({STATE_FOLDER}/config.json; written by an older cfbnn?), so it cannot be checked against this "
                "configuration; start a fresh run dir"
            )
        if record is not None and record.get("config_fingerprint") != fingerprint:
            differences = differing_keys(record["config"], current)
            raise ConfigError(
                f"resume=true, but {run_dir} belongs to another configuration; keys that differ (recorded -> now): "
                + "; ".join(differences[:12])
                + (f"; and {len(differences) - 12} more" if len(differences) > 12 else "")
                + ". Resume with the recorded values, or start a fresh run dir"
            )
        finished = record is not None and (run_dir / "done").exists()
    else:
        if leftovers:
            log.warning(
                "%s: starting afresh in %s, which holds an earlier run's %s (they will be replaced)",
                "overwrite=true" if cfg.get("overwrite", False) else "resume=false",
                run_dir,
                ", ".join(leftovers),
            )
        for name in ("done", "results.json"):
            (run_dir / name).unlink(missing_ok=True)
    if not finished:
        owner = {"config_fingerprint": fingerprint, "config": current}
        if command is not None:
            owner["command"] = command
        atomic_write_json(run_dir / STATE_FOLDER / "config.json", owner)
    return fingerprint, finished


# ----------------------------------------------------------------------------- leaving a dir as found

# what a run writes about itself rather than its outputs; a run that fails before any output puts them back
BOOKKEEPING = (
    "done",
    "results.json",
    f"{STATE_FOLDER}/config.json",
    ".hydra/config.yaml",
    ".hydra/hydra.yaml",
    ".hydra/overrides.yaml",
)
_BOOKKEEPING_FOLDERS = (".hydra", STATE_FOLDER)
SNAPSHOT_LIMIT = 20000  # a run dir with more entries than this is not compared (a failed run then records why)


def _real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _regular_bytes(path: Path) -> Tuple[bool, Optional[bytes]]:
    """``(ours, content)``: ``content`` is ``None`` where nothing is at ``path``; ``ours`` is False for
    a link or anything but a regular file (never read, written or removed)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return True, None
    except OSError:
        return False, None
    if not stat.S_ISREG(info.st_mode):
        return False, None
    try:
        with os.fdopen(open_no_follow(path, os.O_RDONLY), "rb") as handle:
            return True, handle.read()
    except OSError:
        return False, None


class RunDirState:
    """What a run found in its dir when it started, so that a run failing before it writes any
    output leaves the dir as it found it (:meth:`leave_as_found`).

    ``made``: the topmost folder the run's start made (the run dir or a parent of it; see
    :mod:`cfbnn_cli.runtime.made_dirs`), ``None`` where the run dir was there before. ``logs``:
    the log handlers writing into the dir (:class:`~cfbnn_cli.runtime.safefs.NoFollowFileHandler`
    knows whether it made its file, and the file's length then). The outputs -- every entry
    but the bookkeeping (:data:`BOOKKEEPING`, ``.cfbnn/``, ``.hydra/``), the logs and temporary
    files -- are listed with their type, size, time and inode, to tell whether the run wrote any.
    """

    def __init__(self, run_dir, made=None, logs=()):
        self.run_dir = Path(run_dir)
        self.made = Path(made) if made is not None else None
        self.logs = list(logs)
        self.files = {name: _regular_bytes(self.run_dir / name) for name in BOOKKEEPING}
        self.folders = {name: _real_dir(self.run_dir / name) for name in _BOOKKEEPING_FOLDERS}
        self.outputs = self._outputs()

    def _outputs(self) -> Optional[Dict[str, Tuple[int, int, int, int]]]:
        skip = {"done", "results.json", *_BOOKKEEPING_FOLDERS} | {Path(h.baseFilename).name for h in self.logs}
        listed: Dict[str, Tuple[int, int, int, int]] = {}
        stack = [(self.run_dir, "")]
        while stack:
            folder, prefix = stack.pop()
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for entry in entries:
                if (not prefix and entry.name in skip) or (
                    entry.name.startswith(".")
                    and TEMPORARY_MARKER in entry.name
                    and entry.name.endswith(TEMPORARY_SUFFIX)
                ):
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                listed[prefix + entry.name] = (stat.S_IFMT(info.st_mode), info.st_size, info.st_mtime_ns, info.st_ino)
                if stat.S_ISDIR(info.st_mode):
                    stack.append((Path(entry.path), f"{prefix}{entry.name}/"))
                if len(listed) > SNAPSHOT_LIMIT:
                    return None
        return listed

    def wrote_no_output(self) -> bool:
        """Whether every output is as the run found it (only bookkeeping and the log changed)."""
        return self.outputs is not None and self._outputs() == self.outputs

    def leave_as_found(self, lock: Optional[RunDirLock] = None, folders: bool = True) -> None:
        """Put the dir back as the run found it; call it only where :meth:`wrote_no_output`.

        Holding ``lock`` (the run wrote its bookkeeping under it), each bookkeeping file gets
        back its old bytes (or is removed where there was none), a log this run made is
        removed and one it found is cut back to its old length, and the lock is released as
        it was found. Without the lock (the run was refused before taking it, so it wrote
        nothing but may share the log with a run that holds it) only a log this run made and
        left empty is removed. Then the bookkeeping folders and the folders the run's start
        made are removed where they are empty. The logs are closed first. No link is followed,
        no folder that holds anything is removed, nothing the run did not make is deleted.
        ``folders=False``: no folder is removed (another run holds the dir).
        """
        held = lock is not None and lock.held
        if held:
            for name, (ours, content) in self.files.items():
                path = self.run_dir / name
                if not ours or not _real_dir(path.parent):
                    continue
                ours_now, now = _regular_bytes(path)
                if not ours_now or now == content:
                    continue
                if content is None:
                    path.unlink(missing_ok=True)
                else:
                    atomic_write_bytes(path, content)
        root = logging.getLogger()
        for handler in self.logs:
            root.removeHandler(handler)  # a closed FileHandler reopens on the next record
            handler.close()
            path = Path(handler.baseFilename)
            made, size = getattr(handler, "created", None), getattr(handler, "found_size", 0)
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if made is None or not stat.S_ISREG(info.st_mode):
                continue
            if made and (held or info.st_size == size):
                path.unlink(missing_ok=True)
            elif not made and held and info.st_size > size:
                fd = open_in_place(path, os.O_WRONLY)
                try:
                    os.ftruncate(fd, size)
                finally:
                    os.close(fd)
        if held:
            lock.release_as_found()
        if not folders:  # another run holds the dir: the folders may be its, made a moment ago
            return
        for name in _BOOKKEEPING_FOLDERS:
            if not self.folders[name] and _real_dir(self.run_dir / name):
                try:
                    os.rmdir(self.run_dir / name)
                except OSError:
                    pass
        if self.made is not None:
            folder = self.run_dir
            while True:
                try:
                    os.rmdir(folder)  # an empty folder only; a link is not removed
                except OSError:
                    break
                if folder == self.made or folder.parent == folder:
                    break
                folder = folder.parent
