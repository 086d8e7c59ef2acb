"""Supervision of one job's worker processes: start, watch, stop together, restart.

The supervisor decides; it does not create processes. It receives a ``spawn`` function that
turns a :class:`Task` into a :class:`WorkerHandle` (for real processes a
:class:`tfscale.processes.Child` from ``tfscale.launch.process.spawn_process``), so its logic
is tested with fakes as well as with real workers.

One attempt, as a timeline::

    start every task ─► poll every task ─┬─ a task exits != 0 or is killed ─► stop the rest
                                         ├─ every must-finish task exited 0 ─► stop the rest
                                         └─ Ctrl-C / SIGTERM to the launcher ─► stop all, re-raise

"Stop" is SIGTERM to each task's process group, then SIGKILL to the groups still alive after
a grace period, so a worker blocked in a collective (which would wait for its dead peer
forever) is never left behind. A failed attempt is followed by a fresh one, with new ports,
up to ``max_restarts`` times.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "Failure",
    "JobResult",
    "Spawn",
    "Supervisor",
    "Task",
    "WorkerHandle",
    "describe_exit",
    "exit_status",
]


@dataclass(frozen=True)
class Task:
    """One process of a job.

    Attributes:
        label: Name used in output prefixes and messages, e.g. ``"worker 1"``.
        argv: The command line.
        env: The complete environment of the process.
        rank: Position of the task in the job (0-based).
        must_finish: True for tasks whose exit with 0 ends the job (the workers of a
            MultiWorkerMirrored job, the chief of a parameter-server job); False for
            servers (parameter servers) that run until they are stopped.
    """

    label: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    rank: int = 0
    must_finish: bool = True


class WorkerHandle(Protocol):
    """What the supervisor needs of a started task (:class:`tfscale.processes.Child`)."""

    @property
    def pid(self) -> int:
        """The process id (also the process group id for real processes)."""
        ...

    def poll(self) -> int | None:
        """Returns the exit code (negative: killed by that signal), or None while running."""
        ...

    def wait(self, timeout: float) -> int | None:
        """Waits up to ``timeout`` seconds; returns the exit code or None if still running."""
        ...

    def terminate(self) -> None:
        """Asks the task and its children to stop (SIGTERM to the process group)."""
        ...

    def kill(self) -> None:
        """Kills the task and its children (SIGKILL to the process group)."""
        ...

    def close(self) -> None:
        """Releases what the handle holds (output reader threads); called once, at the end."""
        ...


Spawn = Callable[[Task], WorkerHandle]


@dataclass(frozen=True)
class Failure:
    """What ended an attempt: which attempt, which task, its raw exit code.

    ``timed_out`` is True when the job ran past its time limit (``returncode`` is then 124,
    as timeout(1) reports, and the job is not restarted).
    """

    attempt: int
    label: str
    returncode: int
    timed_out: bool = False


@dataclass(frozen=True)
class JobResult:
    """How a job ended.

    Attributes:
        exit_code: 0, or the failing task's exit code (128 + N when killed by signal N).
        attempts: How many attempts ran (1 + the restarts used).
        failures: One entry per failed attempt, in order.
    """

    exit_code: int
    attempts: int
    failures: tuple[Failure, ...] = ()


_TIMEOUT_STATUS = 124


def exit_status(returncode: int) -> int:
    """A shell-style exit status: the code itself, or 128 + N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """``"exited with code 3"`` or ``"was killed by SIGKILL"``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


def _print_to_stderr(message: str) -> None:
    print(f"[tfscale launch] {message}", file=sys.stderr, flush=True)


class Supervisor:
    """Runs a job's tasks, stops them together, restarts the job after a failure.

    Args:
        spawn: Starts one task and returns its handle.
        grace_s: Seconds between SIGTERM and SIGKILL when stopping tasks.
        poll_interval_s: Seconds between two looks at the tasks.
        log: Receives one line per event (start, failure, stop, restart); None prints it
            to stderr as ``[tfscale launch] ...``.
        sleep: Waits between polls (a fake clock in tests).
        clock: Seconds from a monotonic clock, for the job's time limit.
        final_statuses: Exit statuses after which a restart would only do the same again
            (a worker that would not train with the others): the job fails at once.
    """

    def __init__(
        self,
        spawn: Spawn,
        *,
        grace_s: float = 5.0,
        poll_interval_s: float = 0.1,
        log: Callable[[str], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        final_statuses: Sequence[int] = (),
    ) -> None:
        self._final = frozenset(final_statuses)
        self._spawn = spawn
        self._grace_s = grace_s
        self._poll_interval_s = poll_interval_s
        self._log = _print_to_stderr if log is None else log
        self._sleep = sleep
        self._clock = clock
        self._deadline: float | None = None

    def run(
        self,
        make_tasks: Callable[[int], Sequence[Task]],
        *,
        max_restarts: int = 0,
        timeout_s: float | None = None,
    ) -> JobResult:
        """Runs the job until it succeeds or has failed ``max_restarts + 1`` times.

        Args:
            make_tasks: Builds the tasks of attempt ``k`` (0-based); called once per
                attempt so that each attempt gets fresh ports.
            max_restarts: How many times a failed job is started again.
            timeout_s: Time limit of the whole job, restarts included (None: none). A job
                past it is stopped and ends with exit status 124.

        Returns:
            The job's result; its ``exit_code`` is the process exit status to use.

        Raises:
            KeyboardInterrupt: Ctrl-C (or SIGTERM turned into it); every task has been
                stopped before it propagates.
        """
        failures: list[Failure] = []
        self._deadline = None if timeout_s is None else self._clock() + timeout_s
        for attempt in range(max_restarts + 1):
            tasks = list(make_tasks(attempt))
            failure = self._run_attempt(attempt, tasks)
            if failure is None:
                return JobResult(0, attempt + 1, tuple(failures))
            failures.append(failure)
            if failure.timed_out or failure.returncode in self._final:
                break
            if attempt < max_restarts:
                self._log(
                    f"restarting the job (restart {attempt + 1} of {max_restarts}) "
                    "with new ports; a script with tfscale.fit(checkpoint_dir=...) "
                    "resumes from its last checkpoint"
                )
        last = failures[-1]
        status = exit_status(last.returncode) or 1
        self._log(f"job failed after {len(failures)} attempt(s); exit status {status}")
        return JobResult(status, len(failures), tuple(failures))

    def _run_attempt(self, attempt: int, tasks: list[Task]) -> Failure | None:
        handles: list[tuple[Task, WorkerHandle]] = []
        try:
            for task in tasks:
                handles.append((task, self._spawn(task)))
            self._log(
                f"attempt {attempt + 1}: started "
                + ", ".join(f"{t.label} (pid {h.pid})" for t, h in handles)
            )
            return self._watch(attempt, handles)
        finally:
            self._stop(handles)

    def _watch(self, attempt: int, handles: list[tuple[Task, WorkerHandle]]) -> Failure | None:
        finished: set[int] = set()
        while True:
            for index, (task, handle) in enumerate(handles):
                if index in finished:
                    continue
                code = handle.poll()
                if code is None:
                    continue
                finished.add(index)
                if code != 0 or not task.must_finish:
                    # A server (parameter server) that exits, even with 0, leaves the
                    # chief waiting for it: the attempt has failed either way.
                    why = describe_exit(code) if code != 0 else "exited before the job finished"
                    others = len(handles) - len(finished)
                    self._log(f"{task.label} {why}; stopping the {others} other task(s)")
                    return Failure(attempt, task.label, code if code != 0 else 1)
            if all(i in finished for i, (t, _) in enumerate(handles) if t.must_finish):
                return None
            if self._deadline is not None and self._clock() > self._deadline:
                running = len(handles) - len(finished)
                self._log(f"the job ran past its time limit; stopping {running} task(s)")
                return Failure(attempt, "time limit", _TIMEOUT_STATUS, timed_out=True)
            self._sleep(self._poll_interval_s)

    def _stop(self, handles: list[tuple[Task, WorkerHandle]]) -> None:
        """SIGTERM to every task, SIGKILL to those alive after the grace period."""
        try:
            for _, handle in handles:
                if handle.poll() is None:
                    handle.terminate()
            deadline = time.monotonic() + self._grace_s
            for task, handle in handles:
                if handle.wait(max(0.0, deadline - time.monotonic())) is None:
                    self._log(f"{task.label} ignored SIGTERM for {self._grace_s:g} s; killing it")
                    handle.kill()
        except KeyboardInterrupt:
            # A second Ctrl-C while stopping: no more grace.
            for _, handle in handles:
                handle.kill()
            raise
        finally:
            for _, handle in handles:
                if handle.wait(self._grace_s) is None:
                    handle.kill()
                    handle.wait(self._grace_s)
                handle.close()
