"""Datasets and loaders shared by the pipelines (no downloads at run time)."""

from .regression import RegressionData, load_regression_data

__all__ = ["RegressionData", "load_regression_data"]
