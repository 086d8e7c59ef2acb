"""What every TaskPool backend provides: a :class:`Runner` per worker that runs one call.

The pool's worker threads pull tasks from the scheduler and hand each to their runner, so the
scheduling, dependencies, retries and statistics are the same for every backend; a backend
only decides *where* a call executes (this thread, a pinned process, a Ray task).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tfscale.tasks.placement import resolve_devices

__all__ = ["Backend", "Call", "RemoteTraceback", "Runner", "TimedOutError", "WorkerLostError"]


@dataclass(frozen=True)
class Call:
    """A function with its arguments (dependency results already appended)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


class WorkerLostError(Exception):
    """The worker running the call died (the process exited, was killed or ran out of memory)."""


class TimedOutError(Exception):
    """The call ran longer than the pool's timeout and was stopped or abandoned."""


class RemoteTraceback(Exception):  # noqa: N818 (a traceback shown as a cause, as in concurrent.futures)
    """The formatted traceback of an exception raised in another process."""

    def __str__(self) -> str:
        return f"\n\nTraceback in the worker:\n{self.args[0]}" if self.args else ""


class Runner(ABC):
    """Runs calls for one worker of the pool, one at a time."""

    device: str

    @abstractmethod
    def run(self, call: Call, timeout: float | None) -> tuple[Any, float]:
        """Runs ``call`` on this worker's device.

        Returns:
            The call's result and the seconds its function took.

        Raises:
            WorkerLostError: The worker died; the runner starts a new one before its next call.
            TimedOutError: Only from backends with ``enforces_timeout``.
            Exception: Whatever the call raised.
        """

    def interrupt(self) -> None:  # noqa: B027 (optional hook)
        """Ends a running call at once, from another thread (at interpreter exit).

        Runners that cannot stop a call (threads) do nothing; the call is abandoned.
        """

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Releases the worker (bounded wait)."""


class Backend(ABC):
    """Makes runners; one backend object per pool.

    Attributes:
        name: ``"thread"``, ``"process"`` or ``"ray"``.
        enforces_timeout: True when runners stop a call at its timeout themselves; the pool
            enforces it otherwise by abandoning the worker.
    """

    name: str = ""
    enforces_timeout: bool = False

    def devices(self, requested: Sequence[str] | None) -> list[str]:
        """The pool's devices: ``requested`` checked against TensorFlow's logical devices."""
        import tensorflow as tf

        logical = [d.name for d in tf.config.list_logical_devices()]
        return resolve_devices(requested, logical)

    @abstractmethod
    def runner(self, device: str) -> Runner:
        """A new runner for a worker on ``device``."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Releases what the backend holds."""
