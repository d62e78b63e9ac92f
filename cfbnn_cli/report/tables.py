"""Tables in three forms (CSV, Markdown, booktabs LaTeX), written atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import pandas as pd

from ..runtime.io import atomic_write_text


def write_table(frame: pd.DataFrame, run_dir, name: str, caption: Optional[str] = None, index: bool = True) -> Dict[str, str]:
    """Write ``<name>.csv``, ``<name>.md`` and ``<name>.tex``; return their file names."""
    run_dir = Path(run_dir)
    atomic_write_text(run_dir / f"{name}.csv", frame.to_csv(index=index))
    atomic_write_text(run_dir / f"{name}.md", frame.to_markdown(index=index) + "\n")
    latex = frame.to_latex(index=index, caption=caption, label=f"tab:{name}", escape=True)
    atomic_write_text(run_dir / f"{name}.tex", latex)
    return {f"{name}.{ext}": f"{name}.{ext}" for ext in ("csv", "md", "tex")}
