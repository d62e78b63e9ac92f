"""A ``data=csv`` run's table checked before anything heavy loads (torch takes seconds to import):
the file is there and readable, its header names the target and every column ``data.features``,
``data.drop`` and ``data.categorical`` name, each once, and the keys that choose how it is read
hold allowed values. A mistake is one line within about a second; the full read
(:func:`~.tabular.read_table`) checks the cells later.
"""

from __future__ import annotations

import csv
import gzip
import io
import os
from pathlib import Path

from omegaconf import OmegaConf

from ..runtime.errors import ConfigError, DataError
from ..runtime.safefs import describe_file, shown_path
from .layout import TARGET_TRANSFORMS, UNSEEN_POLICIES, index_column
from .options import names_option, table_options
from .tabular import (
    GZIP_MAGIC,
    MISSING_POLICIES,
    categorical_choice,
    check_names,
    chosen_columns,
    header_of,
    refuse_binary,
)


def _first_line(path: Path) -> list:
    """The header row's line(s) as text (a gzip file decompressed as far as that)."""
    try:
        with open(path, "rb") as raw:
            head = raw.read(8)
            raw.seek(0)
            stream = gzip.GzipFile(fileobj=raw) if head.startswith(GZIP_MAGIC) else raw
            if not head.startswith(GZIP_MAGIC):
                refuse_binary(path, head)
            text = io.TextIOWrapper(stream, encoding="utf-8-sig", newline="")
            row = next(csv.reader(text), None)
    except OSError as error:
        raise DataError(
            f"cannot read {path} ({error.strerror or type(error).__name__}); check the file's permissions, or point "
            "data.path at a readable copy"
        ) from None
    except (UnicodeDecodeError, csv.Error, EOFError):
        return []  # the full read names the line and the byte
    if row is None:
        return []
    buffer = io.StringIO()
    csv.writer(buffer).writerow(row)
    return [buffer.getvalue().rstrip("\r\n")]


def check_table_header(cfg) -> None:
    """The checks above for a ``data=csv`` config (``cfg`` the whole run's); nothing otherwise."""
    data = OmegaConf.select(cfg, "data")
    if data is None or OmegaConf.select(cfg, "data.name") != "csv":
        return
    if not data.get("path") or not data.get("target"):
        raise ConfigError("data=csv needs data.path=/path/to/file.csv and data.target=<column name>")
    for key, allowed in (
        ("missing", MISSING_POLICIES),
        ("unseen", UNSEEN_POLICIES),
        ("target_transform", TARGET_TRANSFORMS),
    ):
        value = OmegaConf.select(data, key, default=None)
        if value is not None and value not in allowed:
            raise ConfigError(f"data.{key}={value!r} must be one of {', '.join(allowed)}")
    path = Path(str(data.path))
    if path.is_dir():
        raise DataError(f"data.path={path} is a directory, not a data file; point it at a .csv or .npz file")
    if not path.is_file():
        if os.path.lexists(path):  # a FIFO, a socket, a broken link: named for what it is, never opened
            raise DataError(
                f"data.path={shown_path(path)}: {describe_file(path)} (point data.path at a .csv or .npz file)"
            )
        raise DataError(f"data file not found: {path} (set data.path=...)")
    if path.suffix == ".npz":
        return
    features = names_option(data, "features")
    drop = names_option(data, "drop") or []
    lines = _first_line(path)
    if not lines:
        return  # empty, or not text: the full read says which, naming the line
    header = header_of(path, lines)
    if index_column(header):
        header = header[1:]
    check_names(path, header)
    columns = chosen_columns(path, header, str(data.target), features, drop)
    categorical_choice(path, table_options(data)["categorical"], columns)


_STOP = ("--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc", "--resolve")


def _override_value(text: str):
    """A plain override's value: a name, or ``[a,b]`` a list of names; ``None`` for anything Hydra
    would have to interpret (quotes, interpolations, sweeps, functions)."""
    if any(mark in text for mark in ("'", '"', "${", "(", "\\")):
        return None
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1]
        if "[" in inner or "]" in inner:
            return None
        return [item.strip() for item in inner.split(",") if item.strip()]
    if "," in text or text in ("null", "~"):
        return None
    return text


def check_command_line(overrides) -> None:
    """The header check of a ``data=csv`` command read from its plain overrides, before Hydra
    composes anything (a second): a mistyped target or column is one line while Hydra, torch and
    the pipeline would take seconds. Anything this cannot read as plain values is left to the check
    inside the run (:func:`check_table_header`)."""
    overrides = list(overrides)
    if any(arg in _STOP or arg.startswith(("--cfg", "--info")) for arg in overrides):
        return
    data = {}
    for arg in overrides:
        key, sep, value = arg.partition("=")
        if not sep or key.startswith(("+", "~")):
            continue
        if key == "data":
            data["name"] = value
        elif key.startswith("data.") and key.count(".") == 1:
            parsed = _override_value(value)
            if parsed is None:
                return
            data[key[len("data.") :]] = parsed
    if data.get("name") != "csv" or not data.get("path") or not data.get("target"):
        return
    if isinstance(data.get("path"), list) or isinstance(data.get("target"), list):
        return
    check_table_header(OmegaConf.create({"data": data}))
