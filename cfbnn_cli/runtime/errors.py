"""The one user-facing exception family.

A :class:`CfbnnError` carries a message that names the value, file or key at fault
and says how to fix it; the CLI prints only that message (no traceback unless
``HYDRA_FULL_ERROR=1``) and exits with ``exit_code``.
"""


class CfbnnError(Exception):
    """An error the user can fix; ``str(error)`` is the whole message shown."""

    exit_code = 1


class ConfigError(CfbnnError):
    """A configuration value is invalid (exit code 2, like a usage error)."""

    exit_code = 2


class DataError(CfbnnError):
    """A data file is missing or malformed (exit code 2: the user fixes the input)."""

    exit_code = 2


class CheckpointError(CfbnnError):
    """A checkpoint or progress file cannot be loaded (truncated, corrupt, not ours, or a
    pickle that would run code); exit code 2, and nothing is run from it."""

    exit_code = 2


class NonFiniteResultError(CfbnnError):
    """A run finished, but some of its final metrics are NaN or infinite: it is recorded
    as failed (``status: "failed"``, no ``done``) and the command exits 1."""

    exit_code = 1


# ----------------------------------------------------------------------------- bounded messages

MESSAGE_LIMIT = 1000  # characters of one error line on stderr


def clip(value, limit: int = 80) -> str:
    """``str(value)`` on one line, cut to ``limit`` characters; a cut value names its size."""
    text = " ".join(str(value).split())
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


def listing(items, limit: int = 8, width: int = 60) -> str:
    """``a, b, c, ...``: the first ``limit`` items (each cut to ``width``), and how many in all."""
    items = list(items)
    shown = ", ".join(clip(item, width) for item in items[:limit])
    return shown + (f", ... ({len(items):,} in all)" if len(items) > limit else "")


def one_line(message, limit: int = MESSAGE_LIMIT) -> str:
    """An error message as one line of at most about ``limit`` characters (the CLI's every exit
    point prints through it): line breaks become spaces, a long message is cut and names its size."""
    return clip(message, limit)
