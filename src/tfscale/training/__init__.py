"""``tfscale.fit``, ``tfscale.prepare`` and ``Trainer``: Keras's training loop, correct under
every strategy."""

from tfscale.training.checkpoint import CheckpointConfig
from tfscale.training.fit import fit
from tfscale.training.loop import prepare_loop
from tfscale.training.options import Options
from tfscale.training.prepare import prepare
from tfscale.training.trainer import StepTiming, Trainer

__all__ = [
    "CheckpointConfig",
    "Options",
    "StepTiming",
    "Trainer",
    "fit",
    "prepare",
    "prepare_loop",
]
