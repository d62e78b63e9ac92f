"""Reading the ``results.json`` files under a path for ``cfbnn report``: only regular files of a sane
size and depth, links only inside the tree, and only records of the right types; anything else is
named on stderr and skipped."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import stat as stat_module
import sys
from pathlib import Path
from typing import Dict, Iterator, List

from ..runtime.errors import DataError, clip

log = logging.getLogger(__name__)
MISSING = "—"


def flatten(tree, prefix: str = "") -> Dict[str, object]:
    out = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
    else:
        out[prefix[:-1]] = json.dumps(tree) if isinstance(tree, (list, dict)) else tree
    return out


def config_value(run, dotted: str, default=None):
    """The run's config value at ``dotted`` (``"trainer.epochs"``), or ``default`` where a part of
    the path is missing or is not an object (a damaged record's ``"data": "x"``)."""
    node = run.get("config") if isinstance(run, dict) else None
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def safe_name(text) -> str:
    """``text`` as a plain file-name part: letters, digits, ``_`` and ``-`` only (a
    pipeline name read from a results.json must not lead a path anywhere)."""
    cleaned = re.sub(r"[^A-Za-z0-9_-]+", "_", str(text)).strip("_-")
    return cleaned[:64] or "unnamed"


# ----------------------------------------------------------------------------- collecting


def _walk(root: Path) -> Iterator[Path]:
    """The folders under ``root`` (itself first), without recursion (a tree 10^4 folders deep is
    walked, not a RecursionError) and without following links to folders; a folder that cannot
    be listed is named on stderr (its runs are not in the report)."""
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            with os.scandir(folder) as entries:
                children = [Path(entry.path) for entry in entries if entry.is_dir(follow_symlinks=False)]
        except OSError as error:
            skip_file(folder, f"a folder that cannot be read ({type(error).__name__}: {error.strerror or error})")
            continue
        yield folder
        stack.extend(sorted(children, reverse=True))


def results_files(root: Path) -> List[Path]:
    """Every ``results.json`` under ``root``: symbolic links to folders are not followed,
    and a linked file is read only when it resolves inside ``root``."""
    inside = root.resolve()
    files = []
    for folder in _walk(root):
        file = folder / "results.json"
        if not os.path.lexists(file):
            continue
        if file.is_symlink():
            try:
                target = file.resolve(strict=True)
            except (OSError, RuntimeError) as error:  # a dangling link or a loop
                skip_file(file, f"a symbolic link that does not lead to a file ({type(error).__name__})")
                continue
            if not target.is_relative_to(inside):
                skip_file(file, f"a symbolic link out of {root} ({target})")
                continue
        files.append(file)
    return sorted(files)


def skip_file(file, reason) -> None:
    log.debug("skipping %s: %s", file, reason)
    print(f"cfbnn report: skipping {clip(file, 300)}: {clip(reason, 300)}", file=sys.stderr)


MAX_RECORD_BYTES = 64 << 20  # a results.json is a few kB; anything near this is not one
MAX_RECORD_DEPTH = 32  # a config nests a handful of levels


def json_depth(tree, limit: int) -> int:
    """Nesting depth of a JSON tree, counted without recursion (a crafted file may nest 10^5 deep)."""
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        if isinstance(node, dict):
            stack.extend((value, depth + 1) for value in node.values())
        elif isinstance(node, list):
            stack.extend((value, depth + 1) for value in node)
    return deepest


def is_finite_number(value) -> bool:
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer beyond float's range (a 400-digit number)
        return False


def check_record(record) -> None:
    """Raise ``ValueError`` naming what makes ``record`` unusable for a report: the wrong types
    (``config`` not an object, ``seed`` not an integer, a metric that is not a number or beyond
    float's range), nesting deeper than any config, a failed run, or no finite metric at all."""
    if not isinstance(record, dict) or not isinstance(record.get("metrics"), dict) or "pipeline" not in record:
        raise ValueError("not a cfbnn results record (pipeline/metrics missing)")
    if json_depth(record, MAX_RECORD_DEPTH) > MAX_RECORD_DEPTH:
        raise ValueError(f"nested deeper than {MAX_RECORD_DEPTH} levels: not a cfbnn results record")
    if not isinstance(record["pipeline"], str):
        raise ValueError(f"its pipeline is {record['pipeline']!r:.60}, not a name")
    if not isinstance(record.get("config", {}), dict):
        raise ValueError(f"its config is a {type(record['config']).__name__}, not an object")
    seed = record.get("config", {}).get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"its seed is {seed!r:.60}, not an integer")
    for name, value in record["metrics"].items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"metric {name!r:.80} is {value!r:.60}, not a number")
        if isinstance(value, int) and not is_finite_number(value):
            raise ValueError(
                f"metric {name!r:.80} is an integer of {len(str(abs(value)))} digits, beyond a float's range"
            )
    if record.get("status", "complete") != "complete":
        raise ValueError(f"its status is {record.get('status')!r:.60} (a failed or unfinished run)")
    if record["metrics"] and not any(is_finite_number(v) for v in record["metrics"].values() if v is not None):
        raise ValueError("every metric is NaN, infinite or empty: the run has no result to aggregate")


def read_record(file: Path):
    """The parsed JSON of ``file``, which must be a regular file (a FIFO or a device would hang
    or never end) of a sane size; ``ValueError``/``OSError`` otherwise."""
    info = os.stat(file)  # follows a link already checked to stay inside the tree
    if not stat_module.S_ISREG(info.st_mode):
        raise ValueError("not a regular file")
    if info.st_size > MAX_RECORD_BYTES:
        raise ValueError(f"{info.st_size} bytes: too large for a results record")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except RecursionError:
        raise ValueError("nested too deeply to be a cfbnn results record") from None


def input_contents(run_dir: Path) -> Dict[str, str]:
    """The content hashes of a run's input files (``data.path#content``, ...) from its config
    record (``.cfbnn/config.json``; ``{}`` where there is none): ``data.path`` itself is not a
    factor (one file at two paths is one experiment), but runs on two different files are not
    replicates of one experiment either."""
    try:
        record = read_record(run_dir / ".cfbnn" / "config.json")
    except (OSError, ValueError):
        return {}
    config = record.get("config") if isinstance(record, dict) else None
    if not isinstance(config, dict):
        return {}
    return {key: str(value) for key, value in config.items() if isinstance(key, str) and key.endswith("#content")}


def collect(path) -> List[dict]:
    """Every readable, complete ``results.json`` under ``path`` (any other is named and skipped)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path} does not exist (cfbnn report aggregates the results.json files under a folder)")
    files = [path] if not path.is_dir() else results_files(path)
    runs = []
    for file in files:
        try:
            record = read_record(file)
            check_record(record)
        except (OSError, ValueError, RuntimeError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            skip_file(file, error)
            continue
        record["_path"] = str(file.parent)
        record["_inputs"] = input_contents(file.parent)
        runs.append(record)
    if not runs:
        raise DataError(f"no results.json of a complete run under {path} (nothing to aggregate; did the runs finish?)")
    return runs
