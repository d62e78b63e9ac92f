"""ruff, as configured in pyproject.toml: the package, the tests, the benchmarks and the data scripts
lint clean and are formatted (so CI, which runs this suite, enforces both)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ruff(*args):
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_lint_is_clean():
    out = _ruff("check", ".", "--output-format", "concise")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]


def test_ruff_format_leaves_every_file_as_it_is():
    out = _ruff("format", "--check", ".")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]
