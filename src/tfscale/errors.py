"""Exception and warning types raised by tfscale.

Every tfscale error says what went wrong, what was received, what is allowed and how to fix
it. :func:`explain` builds messages in that shape so that every module words them alike.
"""

from __future__ import annotations

__all__ = [
    "ClusterConfigError",
    "DeviceConfigError",
    "LaunchError",
    "NonFiniteLossError",
    "OutOfMemoryError",
    "PartitionError",
    "ProfileError",
    "ScopeError",
    "StrategyError",
    "TaskError",
    "TfscaleError",
    "TfscaleWarning",
    "TrainingError",
    "explain",
]


def explain(
    problem: str,
    *,
    received: object = None,
    allowed: object = None,
    fix: str | None = None,
) -> str:
    """Words an error message as: problem, what was received, what is allowed, how to fix it.

    Args:
        problem: One sentence saying what went wrong.
        received: The value the caller gave, shown with ``repr`` unless it is a string.
        allowed: What would have been accepted.
        fix: How to fix it; may hold an indented code snippet on following lines.

    Returns:
        The message, one part per line.
    """
    lines = [problem.rstrip()]
    if received is not None:
        shown = received if isinstance(received, str) else repr(received)
        lines.append(f"Received: {shown}")
    if allowed is not None:
        lines.append(f"Allowed: {allowed}")
    if fix:
        lines.append(f"Fix: {fix}")
    return "\n".join(lines)


class TfscaleError(Exception):
    """Base class of every error tfscale raises on purpose."""


class DeviceConfigError(TfscaleError):
    """Devices cannot be configured as asked (too late, absent kind, bad count)."""


class ClusterConfigError(TfscaleError, ValueError):
    """A cluster description (TF_CONFIG, Slurm or Kubernetes environment) is malformed."""


class StrategyError(TfscaleError):
    """A distribution strategy could not be built and ``strict=True`` forbade a fallback."""


class ScopeError(TfscaleError):
    """A model's variables are not distributed by the strategy it is used with."""


class TrainingError(TfscaleError, ValueError):
    """``tfscale.fit`` received inputs or settings it cannot train with.

    Also a ``ValueError``, which Keras's ``model.fit`` raises for its arguments, so that an
    ``except ValueError`` written around ``model.fit`` keeps working around ``tfscale.fit``.
    """

    # Raised inside a user's tf.function (a custom loop's refusal, training/loop.py),
    # AutoGraph re-creates an error of the same type only when its __init__ is
    # Exception.__init__ (tensorflow/python/autograph/pyct/error_utils.py,
    # create_exception); ValueError's own would turn it into an AutoGraph StagingError.
    __init__ = Exception.__init__


class NonFiniteLossError(TrainingError):
    """The training loss became NaN or infinite."""


class OutOfMemoryError(TfscaleError):
    """A training step ran out of device memory (TensorFlow's ``ResourceExhaustedError``).

    The message names the device, the memory plan's breakdown and the changes that would
    fit with their predicted bytes; the TensorFlow error is chained as ``__cause__``.

    Attributes:
        device: The device that ran out, where TensorFlow named it.
        plan: The :class:`tfscale.training.memory.MemoryPlan` of the failed step, if one was made.
        fixes: The :class:`tfscale.training.memory.Fix` list, cheapest first.
        checkpoint: The last checkpoint saved before the failure, if any.
    """

    def __init__(
        self,
        message: str,
        *,
        device: str | None = None,
        plan: object = None,
        fixes: tuple[object, ...] = (),
        checkpoint: str | None = None,
    ) -> None:
        super().__init__(message)
        self.device = device
        self.plan = plan
        self.fixes = fixes
        self.checkpoint = checkpoint


class TaskError(TfscaleError):
    """A task of a :class:`tfscale.TaskPool` failed, timed out or could not be scheduled.

    Attributes:
        done_items: For a failed ``map`` chunk, the results of its items before the failed
            one (``map`` yields them before raising); None otherwise.
    """

    done_items: list[object] | None = None


class PartitionError(TfscaleError, ValueError):
    """A model cannot be split into pipeline stages as asked.

    Also a ``ValueError``, so that Keras passes it on where it wraps other errors of a model's
    first call in a RuntimeError ("Unable to automatically build the model").
    """


class LaunchError(TfscaleError):
    """Worker processes could not be launched or supervised."""


class ProfileError(TfscaleError):
    """A measurement could not be taken or a profile report written."""


class TfscaleWarning(UserWarning):
    """Something works but not as well as it could (a fallback, a repaired scope)."""
