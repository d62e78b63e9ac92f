"""Tables, figures and the results.json record of a run."""

from .results import RESULTS_SCHEMA, write_results

__all__ = ["RESULTS_SCHEMA", "write_results"]
