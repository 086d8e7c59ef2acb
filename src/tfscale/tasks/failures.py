"""How a pool words its errors: a failed, timed-out or lost task, and bad arguments.

One :class:`tfscale.TaskError` type for every task failure, naming the task's index, function
and device, with the task's own exception chained as ``__cause__``, so that a caller can tell
a task failure from a bug in its own loop and never loses the original.
"""

from __future__ import annotations

from tfscale.errors import TaskError, explain
from tfscale.tasks.backends import BACKENDS
from tfscale.tasks.backends.base import TimedOutError, WorkerLostError
from tfscale.tasks.chunking import ChunkItemError
from tfscale.tasks.futures import Job
from tfscale.tasks.scheduler import Task

__all__ = ["check_arguments", "name_of", "task_failure"]


def name_of(fn: object) -> str:
    """A callable's qualified name, for messages."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return str(name or type(fn).__name__)


def task_failure(
    task: Task,
    device: str,
    error: BaseException,
    *,
    retries: int,
    timeout: float | None,
    backend: str,
) -> TaskError:
    """The error a failed attempt of ``task`` on ``device`` puts on its future."""
    job: Job = task.payload
    label, cause, done = task.label, error, None
    if isinstance(error, ChunkItemError) and job.item_base is not None:
        index = job.item_base + error.offset
        label, cause = f"map item {index} ({name_of(job.args[0])})", error.error
        done = getattr(error, "done", None)
    attempt = f" (attempt {task.attempts} of {retries + 1})" if retries else ""
    if isinstance(error, TimedOutError):
        message = explain(
            f"{label} timed out after {timeout:g} s on {device}{attempt}: {error}.",
            fix="raise TaskPool(timeout=...) or split the task into smaller ones."
            + (
                " A thread cannot be killed: the task keeps running in an abandoned daemon "
                "thread until it returns; backend='process' kills it instead."
                if backend == "thread"
                else ""
            ),
        )
    elif isinstance(error, WorkerLostError):
        message = explain(
            f"{label} lost its worker on {device}{attempt}: {error}. The worker was "
            "restarted; other tasks are not affected.",
            fix="if it ran out of memory, give each task less work or use fewer "
            "workers_per_device; retries=N runs such a task again on another device.",
        )
    else:
        text = str(cause).splitlines()[0] if str(cause) else ""
        message = explain(
            f"{label} failed on {device}{attempt}: {type(cause).__name__}: {text}",
            fix="the chained exception above is the task's own; retries=N runs a failed "
            "task again on another device.",
        )
    failure = TaskError(message)
    failure.__cause__ = cause
    if done:
        # The chunk's results before the failed item: map yields them, then raises.
        failure.done_items = done
    return failure


def check_arguments(
    workers_per_device: object, backend: object, retries: object, timeout: object
) -> None:
    """Refuses a bad ``TaskPool(...)`` argument with a :class:`tfscale.TaskError`."""
    if (
        isinstance(workers_per_device, bool)
        or not isinstance(workers_per_device, int)
        or workers_per_device < 1
    ):
        raise TaskError(
            explain(
                "workers_per_device must be a positive integer.",
                received=workers_per_device,
                allowed="an int >= 1",
            )
        )
    if backend not in BACKENDS:
        raise TaskError(
            explain(
                "Unknown TaskPool backend.",
                received=backend,
                allowed=", ".join(repr(b) for b in BACKENDS),
                fix='backend="thread" for TensorFlow work on local devices (the default).',
            )
        )
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise TaskError(
            explain("retries must be an integer >= 0.", received=retries, allowed="0, 1, 2, ...")
        )
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
    ):
        raise TaskError(
            explain(
                "timeout must be a positive number of seconds or None.",
                received=timeout,
                allowed="None or a float > 0",
            )
        )
