"""The argument parser of the commands that are not Hydra applications (``cfbnn predict``,
``cfbnn report``): a bad argument is one line on stderr, as every other refusal, not argparse's
usage block followed by ``cfbnn predict: error: ...``."""

from __future__ import annotations

import argparse
import sys

from .errors import one_line


class OneLineParser(argparse.ArgumentParser):
    """:class:`argparse.ArgumentParser` whose errors are one line, ``cfbnn: error: <what>; `<prog>
    --help` lists the arguments``, and exit code 2 (``--help`` itself is unchanged)."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        print(f"cfbnn: error: {one_line(message, 300)}; `{self.prog} --help` lists the arguments", file=sys.stderr)
        raise SystemExit(2)


def whole_number(text: str) -> int:
    """An argparse type: a whole number written as digits (``64``); ``1e5``, ``64.0`` or ``1_000`` are
    refused by name, not read as something else."""
    if not text.strip().lstrip("+-").isdigit() or not text.strip().isascii():
        raise argparse.ArgumentTypeError(f"{one_line(text, 40)!r} is not a whole number written in digits (e.g. 64)")
    return int(text)
