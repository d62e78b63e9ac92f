"""Training: the one loop every pipeline calls (:class:`~cfbnn_cli.train.loop.TrainingLoop`)."""

from .loop import TrainingLoop, TrainingResult, loop_from_config

__all__ = ["TrainingLoop", "TrainingResult", "loop_from_config"]
