"""What the ``cfbnn`` command says when it refuses, each as one line naming the value and the fix:
Hydra's and OmegaConf's errors (an unknown key, a bad override), a ``+key`` nothing reads, an empty
output dir, a path that cannot be written. :mod:`cfbnn_cli.cli` runs the commands and prints these."""

from __future__ import annotations

import errno
import logging
import os
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from .runtime.errors import ConfigError, one_line


def unknown_key_message(error, sub) -> Optional[str]:
    """One line for an override of a key the command's config does not have (Hydra says it in
    five, and suggests ``+key=...``, which would only add an unused key): the key, the nearest
    existing keys beside it, and where the keys are listed; ``None`` for any other error."""
    import difflib

    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = error if isinstance(error, (ConfigKeyError, ConfigAttributeError)) else error.__cause__
    if not isinstance(cause, (ConfigKeyError, ConfigAttributeError)) or not getattr(cause, "full_key", None):
        return None
    parent = getattr(cause, "parent_node", None)
    siblings = [str(key) for key in parent.keys()] if parent is not None and hasattr(parent, "keys") else []
    close = difflib.get_close_matches(str(getattr(cause, "key", "")), siblings, n=3)
    prefix = cause.full_key.rsplit(".", 1)[0] + "." if "." in cause.full_key else ""
    hint = f" (did you mean {' or '.join(prefix + key for key in close)}?)" if close else ""
    return (
        f"{cause.full_key} is not a key of `cfbnn {sub.name}`'s config{hint}; "
        f"`cfbnn {sub.name} --help` lists its groups and keys"
    )


def config_groups(conf: Path, sub) -> set:
    """The config groups a command's configs hold (``data``, ``hydra/launcher``, ...)."""
    groups = set()
    for base in (conf / sub.config_name, conf / "shared"):
        for folder in base.rglob("*"):
            if folder.is_dir():
                groups.add(folder.relative_to(base).as_posix())
    return groups


def unread_addition(sub, conf: Path, rest: Sequence[str], compose: Callable) -> Optional[str]:
    """One line for a ``+key=value`` (or ``++key=value``) override that adds a key the command's
    configs do not have: nothing reads it, so it would change nothing but the run's fingerprint.
    ``+group=option`` (a config group) and Hydra's own ``+hydra.*`` keys pass; ``None`` where
    every override is fine. ``sub`` is the command (``cli.Subcommand``), ``compose(config_name,
    overrides)`` composes its config (``cli.compose_config``: passed in, as ``cli`` imports this
    module)."""
    additions = [a for a in rest if a.startswith("+") and "=" in a]
    if not additions:
        return None
    groups = config_groups(conf, sub)
    composed = None
    for argument in additions:
        key = argument.lstrip("+").split("=", 1)[0].strip()
        group = key.split("@", 1)[0]
        if key == "hydra" or key.startswith(("hydra.", "hydra/")) or group in groups:
            continue
        if argument.startswith("++"):  # sets the key where it exists: fine then
            if composed is None:
                composed = composed_without_additions(sub, rest, compose)
            if composed is None or has_key(composed, key):
                continue
        shown = argument if len(argument) <= 80 else f"{argument[:77]}... ({len(argument)} characters)"
        return (
            f"{shown!r} adds the key {key[:80]!r}, which `cfbnn {sub.name}` does not read (it is in none of its "
            f"configs); drop it, or set an existing key without `+` (`cfbnn {sub.name} --help` lists them)"
        )
    return None


def composed_without_additions(sub, rest: Sequence[str], compose: Callable):
    """The command's config with the plain ``key=value`` overrides of ``rest`` (``None`` where it
    cannot be composed here, e.g. a sweep: Hydra then reports what is wrong)."""
    plain = [a for a in rest if "=" in a and not a.startswith(("-", "+", "~")) and not a.startswith("hydra")]
    try:
        return compose(sub.config_name, plain)
    except Exception:  # noqa: BLE001 - any composition problem is Hydra's to report, with its own message
        return None


def has_key(cfg, key: str) -> bool:
    from omegaconf import OmegaConf

    missing = object()
    try:
        return OmegaConf.select(cfg, key, default=missing, throw_on_missing=False) is not missing
    except Exception:  # noqa: BLE001 - a key Hydra cannot select is not one the config has
        return False


def unwritable_line(error: OSError, run_dir: Path) -> str:
    """One line for a run's folder or file that cannot be made or written."""
    from .runtime.safefs import unwritable_message

    try:
        inside = Path(os.path.abspath(error.filename)).is_relative_to(Path(os.path.abspath(run_dir)))
    except (TypeError, ValueError):
        inside = False
    if inside and error.errno in (errno.ENOSPC, errno.EDQUOT):  # the run stops unfinished (no results.json)
        return unwritable_message(
            error,
            "free some space there and rerun with resume=true to continue from the last checkpoint (or choose a "
            "hydra.run.dir on another disk)",
        )
    if inside:
        return unwritable_message(
            error,
            "choose a hydra.run.dir you can write (hydra.sweep.dir for a sweep), or fix that folder's permissions",
        )
    return unwritable_message(error, "check that path's permissions, or point the key that names it elsewhere")


OUTPUT_DIR_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir")


def empty_output_dir_message(key: str, where) -> str:
    return (
        f"{key} is empty: the run would be written into {where} itself; give it a folder, e.g. "
        f"{key}={'outputs/my_run' if key != 'hydra.sweep.subdir' else '${hydra.job.num}'} (an unset shell variable?)"
    )


def empty_output_dir_override(rest: Sequence[str]) -> Optional[str]:
    """One line for an override that empties the run or sweep dir (``hydra.run.dir=``), before
    Hydra makes or writes anything; ``None`` where there is none."""
    for argument in rest:
        key, equals, value = argument.lstrip("+").partition("=")
        if equals and key.strip() in OUTPUT_DIR_KEYS and value.strip() in ("", "''", '""'):
            return empty_output_dir_message(
                key.strip(), "the sweep dir" if key.strip() == "hydra.sweep.subdir" else "the working directory"
            )
    return None


def refuse_empty_output_dir(hydra_cfg, run_dir: Path) -> None:
    """An empty ``hydra.run.dir`` (or ``hydra.sweep.dir``/``subdir``; an unset shell variable,
    say) would make the working directory (or the sweep dir) itself the run dir: refused,
    before anything is written, and the log Hydra opened there is removed if this run made it."""
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    def value(key):
        return OmegaConf.select(hydra_cfg, key, default="unset")

    if value("mode") == RunMode.MULTIRUN:
        keys = ("hydra.sweep.dir", "hydra.sweep.subdir")
    else:
        keys = ("hydra.run.dir",)
    empty = [key for key in keys if value(key.removeprefix("hydra.")) in (None, "")]
    if not empty:
        return
    from .runtime.run_logs import log_handlers_in
    from .runtime.safefs import shown_path

    root = logging.getLogger()
    for handler in log_handlers_in(run_dir):
        root.removeHandler(handler)
        handler.close()
        made = getattr(handler, "created", False)
        try:
            if made and os.path.getsize(handler.baseFilename) == 0:
                os.unlink(handler.baseFilename)
        except OSError:
            pass
    where = "the sweep dir" if empty[0] == "hydra.sweep.subdir" else "the working directory"
    error = ConfigError(empty_output_dir_message(empty[0], f"{where} ({shown_path(run_dir)})"))
    print(f"cfbnn: error: {error}", file=sys.stderr, flush=True)
    error.reported = True
    raise error


def omegaconf_text(error) -> str:
    """An OmegaConf error's own message and its key, without its ``object_type`` lines."""
    lines = [line.strip() for line in str(error).splitlines()]
    message = " ".join(
        line for line in lines if line and not line.startswith(("full_key:", "object_type=", "reference_type="))
    )
    key = getattr(error, "full_key", None)
    return f"{message} (key {key})" if key and str(key) not in message else message


def hydra_message(error) -> str:
    """A Hydra or OmegaConf error as one bounded line: the search path left out, lists of options
    joined by commas (a long list cut, naming its length), the OmegaConf cause and its key."""
    from omegaconf.errors import OmegaConfBaseException

    from .runtime.errors import listing

    if isinstance(error, OmegaConfBaseException):
        text = omegaconf_text(error)
    else:
        text = str(error).split("Config search path:", 1)[0]
        blocks, options = [], []
        for line in text.splitlines():
            if line.startswith("\t") or line.startswith("    "):
                options.append(line.strip())
                continue
            if options:
                blocks[-1] += " " + listing(options, limit=12)
                options = []
            if line.strip():
                blocks.append(line.strip())
        if options and blocks:
            blocks[-1] += " " + listing(options, limit=12)
        text = "; ".join(blocks)
        if isinstance(error.__cause__, OmegaConfBaseException):
            text += f" ({omegaconf_text(error.__cause__)})"
    return one_line(text)


class WithoutHydraJobError:
    """stderr without Hydra's "Error executing job with overrides: [...]" line: a failed job's error
    is already one line of ours (or a traceback), and the user asked for the overrides."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        if text.startswith("Error executing job with overrides"):
            return len(text)
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def unsafe_path_in(error: BaseException):
    """The :class:`~cfbnn_cli.runtime.safefs.UnsafePathError` that caused ``error``, if any."""
    from .runtime.safefs import UnsafePathError

    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, UnsafePathError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def mentions_launcher(rest: Sequence[str]) -> bool:
    return any(a.startswith(("hydra/launcher", "hydra.launcher")) for a in rest)


_EXITING_FLAGS = ("-h", "--help", "--hydra-help", "--version", "-sc", "--shell-completion", "-i", "--info")


def hydra_arguments(sub, rest: Sequence[str]) -> Tuple[List[str], Optional[str]]:
    """``(arguments, problem)``: Hydra's flags (``-m``, ``--cfg job``, ...) moved before the overrides
    (Hydra's argument parser takes no flag after an override, and would print its 11-line usage),
    and one line for arguments Hydra's parser refuses (``None`` where it takes them)."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    actions = {option: action for action in parser._actions for option in action.option_strings}
    flags: List[str] = []
    overrides: List[str] = []
    index = 0
    while index < len(rest):
        argument = rest[index]
        if not argument.startswith("-"):
            overrides.append(argument)
        else:
            flags.append(argument)
            action = actions.get(argument)
            following = rest[index + 1] if index + 1 < len(rest) else None
            if action is not None and following is not None:
                if action.nargs is None or (action.nargs == "?" and following in (action.choices or ())):
                    flags.append(following)  # the flag's value (--cfg job)
                    index += 1
        index += 1
    arguments = flags + overrides
    if any(argument.split("=", 1)[0] in _EXITING_FLAGS for argument in flags):
        return arguments, None  # help, version, completion: Hydra prints them; nothing to check

    def refuse(message):
        raise ValueError(message)

    parser.error = refuse  # one line instead of the usage and an exit
    try:
        parser.parse_args(arguments)
    except ValueError as error:
        return arguments, (
            f"{one_line(error, 300)}; `cfbnn {sub.name} --help` lists the config groups and keys, and "
            f"`cfbnn {sub.name} --hydra-help` Hydra's flags (-m, --cfg job, ...)"
        )
    return arguments, None
