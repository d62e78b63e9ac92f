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
