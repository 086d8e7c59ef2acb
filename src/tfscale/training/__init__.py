"""``tfscale.fit``, ``tfscale.prepare``, ``prepare_loop`` and ``Trainer``: Keras's training
loop, correct under every strategy; ``memory/``, what a training step holds per device.

Its names load on first use (PEP 562), as ``tfscale``'s do: the memory plan's pure modules
(``memory/plan.py``, ``liveness.py``, ``report.py``) import without Keras or TensorFlow.
"""

from __future__ import annotations

from tfscale.runtime.lazy import lazy_names

_LAZY = {
    "CheckpointConfig": "tfscale.training.checkpoint",
    "Options": "tfscale.training.options",
    "StepTiming": "tfscale.training.trainer",
    "Trainer": "tfscale.training.trainer",
    "fit": "tfscale.training.fit",
    "prepare": "tfscale.training.prepare",
    "prepare_loop": "tfscale.training.loop",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_names("tfscale.training", _LAZY, globals())
