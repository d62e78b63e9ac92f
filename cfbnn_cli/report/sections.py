"""The report's sections: the runs by pipeline and protocol, each with its kind of table (and a figure
where one helps) -- Table 1, the UCI protocol, Table 2, Figure 1, the test metrics of a fit
(regression: test RMSE, LL and 90 %-interval coverage; classification: accuracy and NLL), and a
generic table of headline metrics. The tables are built in :mod:`.section_tables`, the figures in
:mod:`.section_figures`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import pandas as pd

from . import table1_schema
from .grouping import swept_keys
from .metric_keys import (
    deterministic_key,
    uci_methods,
    vae_variants,
)
from .records import safe_name
from .section_figures import (
    figure_classification,
    figure_figure1,
    figure_regression,
    figure_table1,
    figure_vae,
)
from .section_tables import (
    classification_table,
    figure1_table,
    generic_table,
    present_headlines,
    regression_table,
    table1_table,
    uci_table,
    vae_table,
)

# a pipeline's protocols are separate tables
VARIANT_KEYS = {"train_regression": "protocol"}
GRADIENT_VARIANCE = "gradient_variance"  # Table 1's protocol: its runs that measured nothing are not a Table 1
COMMAND_WORDS = {"train_regression": "train regression", "vae": "vae", "imagenet_predict": "imagenet-predict"}


# ----------------------------------------------------------------------------- one table per pipeline variant


@dataclass
class Section:
    """The runs of one table: a pipeline and, where it has several, a protocol."""

    pipeline: str
    variant: Optional[str]
    runs: List[dict]

    @property
    def key(self) -> str:
        return self.pipeline if self.variant is None else f"{self.pipeline}/{self.variant}"

    @property
    def name(self) -> str:
        """The report's files for this section are ``<name>.csv``, ``<name>_table.*``, ..."""
        return f"report_{safe_name(self.pipeline)}" + (f"_{safe_name(self.variant)}" if self.variant else "")

    @property
    def note(self) -> str:
        """What the title adds: runs of Table 1's protocol that measured no gradient variance say so."""
        if self.variant is None and any(
            run.get("config", {}).get("protocol") == GRADIENT_VARIANCE for run in self.runs
        ):
            return " (protocol gradient_variance; no gradient variance measured)"
        return ""

    @property
    def kind(self) -> str:
        metrics = {m for run in self.runs for m in run["metrics"]}
        if self.pipeline == "vae" and vae_variants(metrics):
            return "table2"
        if self.pipeline == "imagenet_predict" and deterministic_key("top1") in metrics:
            return "figure1"
        if self.pipeline == "train_regression" and table1_schema.layout(metrics)[0]:
            return "table1"
        if self.pipeline == "train_regression" and uci_methods(metrics):
            return "uci"
        for kind in ("regression", "classification"):
            if present_headlines(self.runs, kind):
                return kind
        return "generic"

    def parts(self) -> List[Tuple[str, str]]:
        """``(file-name suffix, kind)`` of each table the section writes: its own, and for Table 1's
        runs also their test metrics (``_test_metrics``)."""
        parts = [("", self.kind)]
        if self.kind == "table1" and present_headlines(self.runs, "regression"):
            parts.append(("_test_metrics", "regression"))
        return parts


def measured_gradient_variance(run) -> bool:
    return bool(table1_schema.layout(run["metrics"])[0])


def sections(runs: Sequence[dict]) -> List[Section]:
    """The runs by pipeline and protocol. Runs of Table 1's protocol that measured no gradient
    variance (``gradient_variance.epochs=[]``) are a section of their own, under no protocol name:
    their test metrics, not a Table 1 of empty cells."""
    out: Dict[Tuple[str, Optional[str]], List[dict]] = {}
    for run in runs:
        key = VARIANT_KEYS.get(run["pipeline"])
        variant = run.get("config", {}).get(key) if key else None
        if variant == GRADIENT_VARIANCE and not measured_gradient_variance(run):
            variant = None
        out.setdefault((run["pipeline"], None if variant is None else str(variant)), []).append(run)
    return [Section(p, v, out[(p, v)]) for p, v in sorted(out, key=lambda pv: (pv[0], pv[1] or ""))]


TABLE_BUILDERS = {
    "table1": table1_table,
    "uci": uci_table,
    "table2": vae_table,
    "figure1": figure1_table,
    "regression": regression_table,
    "classification": classification_table,
    "generic": generic_table,
}
FIGURES = {
    "table1": figure_table1,
    "table2": figure_vae,
    "figure1": figure_figure1,
    "regression": figure_regression,
    "classification": figure_classification,
}
TITLES = {
    "table1": "Table 1, gradient variance",
    "uci": "UCI protocol",
    "table2": "Table 2, VAE",
    "figure1": "Figure 1, Monte Carlo vs deterministic prediction",
    "regression": "test metrics",
    "classification": "test metrics",
    "generic": "headline metrics",
}


def section_keys(section: Section) -> List[str]:
    """The config keys that group the section's runs (not its protocol, which names the section)."""
    keys = swept_keys(section.runs)
    if section.variant is not None:
        keys = [k for k in keys if k != VARIANT_KEYS[section.pipeline]]
    return keys


def section_table(section: Section, kind: Optional[str] = None) -> Tuple[pd.DataFrame, List[str]]:
    """The table of ``kind`` (default: the section's own) over the section's runs, and its group keys;
    a cell no group has a value for is empty."""
    keys = section_keys(section)
    table = TABLE_BUILDERS[kind or section.kind](section.runs, keys)
    return table.fillna(""), keys
