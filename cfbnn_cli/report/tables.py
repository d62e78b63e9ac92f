"""Tables in three forms (CSV, Markdown, booktabs LaTeX), written atomically.

Row labels are plain text in every form (a MultiIndex becomes ordinary columns), and
numbers should arrive already formatted by :mod:`cfbnn_cli.report.numbers`
(``mean ± s.e.`` rounded to the s.e.), which the LaTeX form sets in math mode. Where the
pipeline passes the raw numbers (``data``), the CSV holds those, one per column.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import pandas as pd

from ..runtime.io import atomic_write_text
from .numbers import latex_cell

_LATEX_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}
_LATEX_UNICODE = {
    "±": r"$\pm$",
    "−": "-",
    "×": r"$\times$",
    "≥": r"$\geq$",
    "≤": r"$\leq$",
    "≈": r"$\approx$",
    "ŷ": r"$\hat{y}$",
    "σ": r"$\sigma$",
    "μ": r"$\mu$",
    "–": "--",
    "—": "---",
    "→": r"$\to$",
    "·": r"$\cdot$",
    "…": r"\dots{}",
}


def latex_text(text) -> str:
    """``text`` escaped for LaTeX (its special characters, and the few non-ASCII symbols
    cfbnn's tables use, as math)."""
    out = []
    for char in str(text):
        out.append(_LATEX_SPECIAL.get(char) or _LATEX_UNICODE.get(char) or char)
    return "".join(out)


def _latex_value(value) -> str:
    if isinstance(value, str):
        converted = latex_cell(value)
        return converted if converted != value else latex_text(value)
    if value is None or (isinstance(value, float) and value != value):
        return ""
    return latex_text(value)


def plain_labels(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with a MultiIndex (or a named index) turned into ordinary leading columns,
    so that no form prints a tuple like ``('Monte Carlo', 1)`` as a row label."""
    if isinstance(frame.index, pd.MultiIndex):
        return frame.reset_index()
    return frame


def write_table(
    frame: pd.DataFrame,
    run_dir,
    name: str,
    caption: Optional[str] = None,
    index: bool = True,
    data: Optional[pd.DataFrame] = None,
) -> Dict[str, str]:
    """Write ``<name>.csv``, ``<name>.md`` and ``<name>.tex``; return their file names.

    The Markdown form carries ``caption`` under the table (``Table: ...``, as pandoc
    reads it); the LaTeX form has it as ``\\caption`` and a ``tab:<name>`` label.
    ``data``: the table's numbers, each in a column of its own (a value and its s.e. side by
    side, an epoch count apart from its stop reason), which the CSV then holds instead of the
    formatted cells -- the form to compute with; the Markdown and LaTeX forms are to read.
    """
    run_dir = Path(run_dir)
    if isinstance(frame.index, pd.MultiIndex):
        frame, index = plain_labels(frame), False
    if data is not None:
        atomic_write_text(run_dir / f"{name}.csv", data.to_csv(index=False, float_format="%.17g"))
    else:
        atomic_write_text(run_dir / f"{name}.csv", frame.to_csv(index=index))
    markdown = frame.to_markdown(index=index)
    if caption:
        markdown += f"\n\nTable: {caption}"
    atomic_write_text(run_dir / f"{name}.md", markdown + "\n")
    tex = frame.copy()
    tex.columns = [latex_text(c) for c in tex.columns]
    for column in tex.columns:
        tex[column] = [_latex_value(v) for v in tex[column]]
    if index:
        tex.index = [latex_text(v) for v in tex.index]
        tex.index.name = latex_text(frame.index.name) if frame.index.name is not None else None
    latex = tex.to_latex(
        index=index, caption=latex_text(caption) if caption else None, label=f"tab:{name}", escape=False
    )
    atomic_write_text(run_dir / f"{name}.tex", latex)
    return {f"{name}.{ext}": f"{name}.{ext}" for ext in ("csv", "md", "tex")}


def markdown_with_caption(path) -> str:
    """The text of a ``<name>.md`` table (what a command prints at its end)."""
    return Path(path).read_text(encoding="utf-8").rstrip("\n")


__all__ = ["latex_text", "markdown_with_caption", "plain_labels", "write_table"]
