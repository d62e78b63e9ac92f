"""Pipelines, one per experiment section of the paper.

Each module exposes ``run(cfg, run_dir) -> dict`` (keys ``metrics``, ``tables``,
``figures``, ``device``) with no Hydra import; the CLI wraps it. Pipelines import
``bnn``, ``moments``, ``data``, ``report`` and ``runtime``, never each other.
"""
