"""The running part of a pool: worker threads that pull tasks and settle their futures.

Each worker (one per device slot) is a thread of this process. It takes the next task from the
:class:`~tfscale.tasks.scheduler.Scheduler` under the engine's lock, runs it through its
backend's runner without the lock, then records the attempt and settles the future. For the
thread backend, which cannot stop a call, a watchdog thread fails a task at its timeout and
gives the device a fresh worker; the stuck thread is abandoned (a daemon, its late result
discarded).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from concurrent.futures import InvalidStateError
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tfscale.errors import TaskError
from tfscale.tasks.backends.base import Backend, Call, Runner, TimedOutError
from tfscale.tasks.failures import task_failure
from tfscale.tasks.futures import Job
from tfscale.tasks.scheduler import Scheduler, Settled, Task
from tfscale.tasks.stats import Interval

if TYPE_CHECKING:
    from tfscale.tasks.progress import PoolProgress

__all__ = ["Engine"]

_LIVE: weakref.WeakSet[Engine] = weakref.WeakSet()


_EXIT_WAIT_S = 10.0


@atexit.register
def _shut_down_live_engines() -> None:
    # A pool its owner never shut down: at interpreter exit nobody waits for its results,
    # so running calls are ended (worker processes killed) rather than awaited, and the
    # interpreter exits within seconds instead of hanging on a long task.
    for engine in list(_LIVE):
        engine.abort()


@dataclass(eq=False)
class _Attempt:
    task: Task
    start: float
    deadline: float | None


@dataclass(eq=False)
class _Worker:
    device: str
    slot: int
    runner: Runner
    thread: threading.Thread | None = None
    attempt: _Attempt | None = None
    abandoned: bool = False


class Engine:
    """Worker threads over one scheduler; tasks are added with :meth:`add`.

    Args:
        backend: Where calls run.
        devices: The devices, each with ``workers_per_device`` workers.
        workers_per_device: Workers per device.
        retries: Passed to the scheduler.
        timeout: Seconds per attempt, or None.
        progress: Show a progress bar.
    """

    def __init__(
        self,
        backend: Backend,
        devices: list[str],
        *,
        workers_per_device: int,
        retries: int,
        timeout: float | None,
        progress: bool,
    ) -> None:
        self.backend = backend
        self.devices = devices
        self.workers_per_device = workers_per_device
        self.retries = retries
        self.timeout = timeout
        self.lock = threading.Condition(threading.RLock())
        self._scheduler = Scheduler(devices, retries)
        self._intervals: list[Interval] = []
        self._busy = dict.fromkeys(devices, 0.0)
        self._submitted = 0
        self._done = 0
        self._closed = False
        self._finalized = False
        self._live = 0
        self._progress: PoolProgress | None = None
        if progress:
            from tfscale.tasks.progress import PoolProgress

            self._progress = PoolProgress(devices, workers_per_device)
        self._workers: list[_Worker] = []
        try:
            for device in devices:
                for slot in range(workers_per_device):
                    self._workers.append(_Worker(device, slot, backend.runner(device)))
        except BaseException:
            for worker in self._workers:
                worker.runner.close()
            backend.close()
            if self._progress is not None:
                self._progress.close()
            raise
        for worker in list(self._workers):
            self._start(worker)
        self._watch_wake = threading.Event()
        self._watchdog: threading.Thread | None = None
        if timeout is not None and not backend.enforces_timeout:
            self._watchdog = threading.Thread(
                target=self._watch, name="tfscale-task-watchdog", daemon=True
            )
            self._watchdog.start()
        _LIVE.add(self)

    # ------------------------------------------------------------- interface
    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` was called."""
        return self._closed

    @property
    def worker_count(self) -> int:
        """Workers of the pool (devices x workers_per_device)."""
        return len(self.devices) * self.workers_per_device

    def add(self, tasks: list[Task]) -> None:
        """Queues tasks (their payloads are :class:`Job`); see :meth:`Scheduler.add`."""
        with self.lock:
            settled = self._scheduler.add(tasks)
            self._submitted += sum(1 for t in tasks if not t.payload.internal)
            self.lock.notify(self._scheduler.ready)
            for item in settled:
                self._resolve_failed(item)

    def intervals(self) -> list[Interval]:
        """Every attempt so far."""
        with self.lock:
            return list(self._intervals)

    def shutdown(self, wait: bool, cancel_futures: bool) -> None:
        """Stops taking tasks once the queue is empty (emptied at once if ``cancel_futures``)."""
        cancelled: list[Task] = []
        with self.lock:
            self._closed = True
            if cancel_futures:
                cancelled = self._scheduler.cancel_queued()
            self.lock.notify_all()
        for task in cancelled:
            task.payload.future.cancel()
        if wait:
            for worker in list(self._workers):
                if worker.thread is not None and not worker.abandoned:
                    worker.thread.join()
            self._finalize()

    def abort(self) -> None:
        """Cancels what is queued, ends running calls where the backend can, and finishes.

        Waits at most a few seconds for the worker threads; a thread-backend call that
        cannot be stopped is abandoned (its thread is a daemon).
        """
        self.shutdown(wait=False, cancel_futures=True)
        for worker in list(self._workers):
            worker.runner.interrupt()
        deadline = time.monotonic() + _EXIT_WAIT_S
        for worker in list(self._workers):
            if worker.thread is not None and not worker.abandoned:
                worker.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._finalize()

    # --------------------------------------------------------------- workers
    def _start(self, worker: _Worker) -> None:
        worker.thread = threading.Thread(
            target=self._work,
            args=(worker,),
            name=f"tfscale-task-{worker.device}-{worker.slot}",
            daemon=True,  # an abandoned (timed-out) task must not block interpreter exit
        )
        self._live += 1
        worker.thread.start()

    def _work(self, worker: _Worker) -> None:
        try:
            while True:
                task = self._take(worker)
                if task is None:
                    return
                self._run(worker, task)
                if worker.abandoned:
                    return
        finally:
            if not worker.abandoned:
                worker.runner.close()
            with self.lock:
                self._live -= 1
                last = self._live == 0 and self._closed
            if last:
                self._finalize()

    def _idle(self) -> bool:
        return self._closed and not self._scheduler.queued and not self._scheduler.running

    def _take(self, worker: _Worker) -> Task | None:
        while True:
            with self.lock:
                while True:
                    task = self._scheduler.take(worker.device)
                    if task is not None:
                        break
                    if self._idle():
                        self.lock.notify_all()
                        return None
                    self.lock.wait()
                # A retried task's future is already running; a fresh one may be cancelled.
                if task.attempts > 1 or task.payload.future.set_running_or_notify_cancel():
                    start = time.perf_counter()
                    deadline = None if self.timeout is None else start + self.timeout
                    worker.attempt = _Attempt(task, start, deadline)
                    return task
                error = TaskError(f"{task.label} was cancelled.")
                settled = self._scheduler.fail(task, error, worker.device, retry=False)
            for item in settled[1:]:
                self._resolve_failed(item)

    def _run(self, worker: _Worker, task: Task) -> None:
        job: Job = task.payload
        args = job.args + tuple(f.result() for f in job.inputs)
        attempt = worker.attempt
        try:
            result, work_s = worker.runner.run(Call(job.fn, args, job.kwargs), self.timeout)
        except BaseException as error:
            self._finish(worker, attempt, ok=False, value=error)
            if not isinstance(error, Exception):
                raise
        else:
            job.future.work_s = work_s
            self._finish(worker, attempt, ok=True, value=result)

    def _finish(
        self, worker: _Worker, attempt: _Attempt | None, *, ok: bool, value: object
    ) -> None:
        end = time.perf_counter()
        settled: list[Settled] = []
        with self.lock:
            if attempt is None or worker.attempt is not attempt:
                return  # abandoned at its timeout; the future already failed
            worker.attempt = None
            task = attempt.task
            self._record(worker, task, attempt.start, end, ok)
            if ok:
                woken = self._scheduler.succeed(task)
                if woken:
                    self.lock.notify(woken)
            else:
                assert isinstance(value, BaseException)
                settled = self._scheduler.fail(
                    task, self._failure(task, worker, value), worker.device
                )
                if not settled:
                    self.lock.notify_all()  # queued again, maybe for another device
            if self._idle():
                self.lock.notify_all()
        if ok:
            task.payload.future.set_result(value)
        for item in settled:
            self._resolve_failed(item)

    def _failure(self, task: Task, worker: _Worker, error: BaseException) -> TaskError:
        return task_failure(
            task,
            worker.device,
            error,
            retries=self.retries,
            timeout=self.timeout,
            backend=self.backend.name,
        )

    def _record(self, worker: _Worker, task: Task, start: float, end: float, ok: bool) -> None:
        if task.payload.internal:
            return
        self._intervals.append(Interval(worker.device, worker.slot, task.index, start, end, ok))
        self._busy[worker.device] += end - start
        if ok or task.attempts > self.retries:
            self._done += 1
        if self._progress is not None:
            self._progress.update(self._done, self._submitted, self._busy)

    def _resolve_failed(self, item: Settled) -> None:
        future = item.task.payload.future
        if future.done():
            return
        if not item.task.payload.internal and item.task.attempts == 0:
            with self.lock:
                self._done += 1
        with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
            future.set_exception(item.error)

    # -------------------------------------------------------------- timeouts
    def _watch(self) -> None:
        """Fails thread-backend tasks past their deadline and replaces their workers."""
        assert self.timeout is not None
        while True:
            settled: list[Settled] = []
            with self.lock:
                if self._finalized:
                    return
                now = time.perf_counter()
                deadlines = []
                for worker in list(self._workers):
                    attempt = worker.attempt
                    if attempt is None or attempt.deadline is None or worker.abandoned:
                        continue
                    if attempt.deadline <= now:
                        settled.extend(self._abandon(worker, attempt, now))
                    else:
                        deadlines.append(attempt.deadline)
                # Every attempt has the same timeout, so a later one never expires sooner.
                wait = (min(deadlines) if deadlines else now + self.timeout) - now
            for item in settled:
                self._resolve_failed(item)
            self._watch_wake.wait(max(wait, 0.001))

    def _abandon(self, worker: _Worker, attempt: _Attempt, now: float) -> list[Settled]:
        worker.abandoned = True
        worker.attempt = None
        task = attempt.task
        self._record(worker, task, attempt.start, now, False)
        error = self._failure(task, worker, TimedOutError("its worker thread was abandoned"))
        settled = self._scheduler.fail(task, error, worker.device)
        replacement = _Worker(worker.device, worker.slot, self.backend.runner(worker.device))
        self._workers.append(replacement)
        self._start(replacement)
        self.lock.notify_all()
        return settled

    def _finalize(self) -> None:
        with self.lock:
            if self._finalized:
                return
            self._finalized = True
        self._watch_wake.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=5.0)
        if self._progress is not None:
            self._progress.update(self._done, self._submitted, self._busy, force=True)
            self._progress.close()
        self.backend.close()
        _LIVE.discard(self)
