"""A parity suite: ``tfscale.fit`` over 2 replicas against one-device ``model.fit``.

Each case is drawn from Keras's own trainer, model and callback tests or from a keras-io
example (``Case.source`` names it). ``registry.py`` holds the case type and the runner,
the ``*_cases.py`` modules the cases, ``report.py`` prints the figures the README quotes.
"""

from .callback_cases import CASES as CALLBACK_CASES
from .keras_io_cases import CASES as KERAS_IO_CASES
from .sparse_cases import CASES as SPARSE_CASES
from .trainer_cases import CASES as TRAINER_CASES

CASES = [*TRAINER_CASES, *CALLBACK_CASES, *KERAS_IO_CASES]
# SPARSE_CASES are not the parity suite's: their reference is one device with dense gradients
# (sparse_cases.py says why); test_sparse_updates.py runs them.
__all__ = ["CALLBACK_CASES", "CASES", "KERAS_IO_CASES", "SPARSE_CASES", "TRAINER_CASES"]
