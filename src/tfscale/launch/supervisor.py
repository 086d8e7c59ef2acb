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

from tfscale.launch.elastic import Drop, slot_to_drop

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
        slot: The worker slot of an elastic job the task runs (its place in the job as
            launched, kept when other slots are dropped), or None.
    """

    label: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    rank: int = 0
    must_finish: bool = True
    slot: int | None = None


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
    slot: int | None = None


@dataclass(frozen=True)
class JobResult:
    """How a job ended.

    Attributes:
        exit_code: 0, or the failing task's exit code (128 + N when killed by signal N).
        attempts: How many attempts ran (1 + the restarts used).
        failures: One entry per failed attempt, in order.
        dropped: The worker slots an elastic job dropped, in order.
        below: The slot whose loss would have left fewer than ``min_workers`` workers (the
            elastic job failed then), or None.
        workers: Worker slots of the last attempt (None for a job that is not elastic).
    """

    exit_code: int
    attempts: int
    failures: tuple[Failure, ...] = ()
    dropped: tuple[Drop, ...] = ()
    below: Drop | None = None
    workers: int | None = None


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


def _exit_words(returncode: int) -> str:
    """``killed by SIGKILL``, ``exited with code 3``: :func:`describe_exit` without ``was``."""
    return describe_exit(returncode).removeprefix("was ")


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
        retry_statuses: Exit statuses of a failure that is not the job's (a port taken
            between its choice and the worker's start): the job starts again on new ports
            without counting a restart, up to ``max_retries`` times per job.
        max_retries: How many such failures a job starts again after.
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
        retry_statuses: Sequence[int] = (),
        max_retries: int = 3,
    ) -> None:
        self._final = frozenset(final_statuses)
        self._retry = frozenset(retry_statuses)
        self._max_retries = max_retries
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
        return self.run_elastic(
            lambda attempt, slots: make_tasks(attempt),
            slots=(),
            min_workers=None,
            max_restarts=max_restarts,
            timeout_s=timeout_s,
        )

    def run_elastic(
        self,
        make_tasks: Callable[[int, tuple[int, ...]], Sequence[Task]],
        *,
        slots: Sequence[int],
        min_workers: int | None,
        max_restarts: int = 0,
        timeout_s: float | None = None,
        unreachable: Callable[[int], bool] | None = None,
    ) -> JobResult:
        """Runs the job, dropping a worker slot that fails on every start (elastic).

        The job restarts after a failure as :meth:`run` does. When the same slot ended
        every attempt at the current size and the restarts are used up, or the slot that
        failed cannot be reached (``unreachable``), the slot is dropped and the job
        restarts on the others with a fresh restart budget, as long as ``min_workers`` are
        left; otherwise the job fails (``JobResult.below`` says which slot it could not
        lose). The decision is :func:`tfscale.launch.elastic.slot_to_drop`.

        Args:
            make_tasks: Builds the tasks of attempt ``k`` on the given slots; the tasks
                carry their ``slot``.
            slots: The job's worker slots as launched (``range(N)``).
            min_workers: Fewest slots the job may continue on; None: never drop (``run``).
            max_restarts: Restarts per size.
            timeout_s: Time limit of the whole job, restarts and resizes included.
            unreachable: Whether a slot's host can no longer be reached (dropped at once).

        Returns:
            The job's result.

        Raises:
            KeyboardInterrupt: As :meth:`run`.
        """
        failures: list[Failure] = []
        at_size: list[Failure] = []
        dropped: list[Drop] = []
        below: Drop | None = None
        left = tuple(slots)
        self._deadline = None if timeout_s is None else self._clock() + timeout_s
        attempt = retried = 0
        while True:
            tasks = list(make_tasks(attempt, left))
            failure = self._run_attempt(attempt, tasks)
            attempt += 1
            workers = len(left) if min_workers is not None else None
            if failure is None:
                return JobResult(0, attempt, tuple(failures), tuple(dropped), None, workers)
            failures.append(failure)
            if failure.returncode in self._retry and retried < self._max_retries:
                retried += 1
                self._log(
                    f"{failure.label} could not listen on the port chosen for it (another "
                    "program took it since); starting the job again on new ports, not "
                    f"counted as a restart ({retried} of {self._max_retries})"
                )
                continue
            at_size.append(failure)
            if failure.timed_out or failure.returncode in self._final:
                break
            lost = (
                failure.slot is not None and unreachable is not None and unreachable(failure.slot)
            )
            if not lost and len(at_size) <= max_restarts:
                self._log(
                    f"restarting the job (restart {len(at_size)} of {max_restarts}) "
                    "with new ports; a script with tfscale.fit(checkpoint_dir=...) "
                    "resumes from its last checkpoint"
                )
                continue
            slot = failure.slot if lost else slot_to_drop([f.slot for f in at_size], max_restarts)
            if min_workers is None or slot is None or slot not in left:
                break
            why = "its host could not be reached" if lost else _exit_words(failure.returncode)
            drop = Drop(slot, failure.label, why, len(at_size), len(left) - 1)
            if len(left) - 1 < min_workers:
                below = drop
                break
            dropped.append(drop)
            left = tuple(s for s in left if s != slot)
            at_size = []
            self._log(
                f"dropping {drop.label} ({why} on {drop.starts} start(s) in a row); "
                f"restarting the job on the {len(left)} worker(s) left with a new TF_CONFIG, "
                "from the last checkpoint"
            )
        last = failures[-1]
        status = exit_status(last.returncode) or 1
        self._log(f"job failed after {len(failures)} attempt(s); exit status {status}")
        workers = len(left) if min_workers is not None else None
        return JobResult(status, len(failures), tuple(failures), tuple(dropped), below, workers)

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
                    return Failure(attempt, task.label, code if code != 0 else 1, slot=task.slot)
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
