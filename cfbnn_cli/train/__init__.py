"""Training: the one loop every pipeline calls (:class:`~cfbnn_cli.train.loop.TrainingLoop`)."""

from .loop import TrainingLoop, TrainingResult

__all__ = ["TrainingLoop", "TrainingResult"]
