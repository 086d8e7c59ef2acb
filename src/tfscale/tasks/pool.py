"""``TaskPool``: run many independent subtasks on every device, pulled as devices free up.

The pool turns calls into scheduler tasks with futures and hands them to its
:class:`~tfscale.tasks.engine.Engine`, whose worker threads (one per device slot) pull the next
ready task and run it through the backend: in the thread under ``tf.device`` (``"thread"``),
in a pinned worker process (``"process"``) or as a Ray task (``"ray"``). Scheduling,
dependencies, retries, timeouts and statistics are therefore the same whatever the backend.

Dependencies: ``submit(fn, *args, deps=(a, b))`` runs ``fn(*args, a.result(), b.result(),
**kwargs)`` once ``a`` and ``b`` succeeded: the results of ``deps`` are appended, in order,
after the positional arguments.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Literal

from tfscale.errors import TaskError, explain
from tfscale.tasks.backends import make_backend
from tfscale.tasks.chunking import choose_chunksize, probe_budget, run_chunk, run_probe
from tfscale.tasks.engine import Engine
from tfscale.tasks.failures import check_arguments, name_of
from tfscale.tasks.futures import Job, Node, TaskFuture
from tfscale.tasks.scheduler import Task
from tfscale.tasks.stats import PoolStats, summarize

__all__ = ["Node", "TaskFuture", "TaskPool"]

_OVERHEAD_PROBES = 32
_OVERHEAD_S: dict[tuple[str, int], float] = {}  # (backend, workers) -> seconds per task
_Entries = list[tuple[TaskFuture, bool]]  # map's futures; True for a chunk (a list of results)


class TaskPool(concurrent.futures.Executor):
    """Runs tasks on every device, each idle worker pulling the next task.

    Use it as a context manager (``shutdown(wait=True)`` on exit)::

        with tfscale.TaskPool() as pool:            # every GPU, else every CPU device
            outputs = list(pool.map(infer, files))   # in order
            a = pool.submit(load, path, cost=size)   # longest-first when costs are given
            b = pool.submit(train, deps=[a])         # runs train(a.result())

    Args:
        devices: Device names (``"/device:GPU:0"``, ``"GPU:1"``...). None: every logical GPU,
            or every logical CPU device when there is no GPU.
        workers_per_device: Workers (concurrent tasks) per device.
        backend: ``"thread"`` (tasks run in this process under ``tf.device``),
            ``"process"`` (one pinned worker process per worker; a crash fails only its
            task) or ``"ray"`` (Ray tasks; needs ``pip install "tfscale[ray]"``).
        retries: How many more times a failed task runs, each time on another device
            where one is left.
        timeout: Seconds a task may run before it fails with :class:`tfscale.TaskError`.
            A process or Ray task is killed; a thread cannot be, so it is abandoned (it keeps
            running as a daemon thread until it returns) and a fresh worker replaces it.
        progress: Show a live progress bar (tasks done, each device's busy %).

    Raises:
        TaskError: A bad argument or an unknown backend.
        DeviceConfigError: A device that TensorFlow does not list.
    """

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        *,
        workers_per_device: int = 1,
        backend: Literal["thread", "process", "ray"] = "thread",
        retries: int = 0,
        timeout: float | None = None,
        progress: bool = False,
    ) -> None:
        check_arguments(workers_per_device, backend, retries, timeout)
        chosen = make_backend(backend)
        try:
            names = chosen.devices(devices)
        except BaseException:
            chosen.close()
            raise
        self._engine = Engine(
            chosen,
            names,
            workers_per_device=workers_per_device,
            retries=retries,
            timeout=None if timeout is None else float(timeout),
            progress=progress,
        )
        self._counter = itertools.count()
        self._user_futures: list[TaskFuture] = []

    # ---------------------------------------------------------------- public
    @property
    def devices(self) -> list[str]:
        """The devices the pool's workers run on."""
        return list(self._engine.devices)

    @property
    def backend(self) -> str:
        """The backend's name."""
        return self._engine.backend.name

    def submit(  # type: ignore[override]
        self,
        fn: Callable[..., Any],
        /,
        *args: Any,
        cost: float | None = None,
        deps: Iterable[Future[Any]] = (),
        **kwargs: Any,
    ) -> TaskFuture:
        """Schedules ``fn(*args, *[d.result() for d in deps], **kwargs)``.

        Args:
            fn: The task (any callable; picklable by cloudpickle for the process and Ray
                backends).
            *args: Positional arguments.
            cost: Expected duration in any unit: tasks with a cost run longest-first, before
                tasks without one (which run first-in first-out).
            deps: Futures of this pool whose results the task needs; it starts once all
                succeeded and fails with :class:`tfscale.TaskError` if one fails.
            **kwargs: Keyword arguments (``cost`` and ``deps`` are the pool's; pass a
                ``functools.partial`` for a function with arguments of those names).

        Returns:
            The task's future. Its exception, if it fails, is a :class:`tfscale.TaskError`
            naming the task's index and device, chaining the task's own exception.
        """
        inputs = tuple(deps)
        with self._engine.lock:
            self._check_open()
            index = next(self._counter)
            future = TaskFuture(self, index, f"task {index} ({name_of(fn)})")
            self._engine.add([self._task(future, Job(fn, args, kwargs, inputs, future), cost)])
            self._user_futures.append(future)
        return future

    def submit_graph(self, nodes: Mapping[str, Node]) -> dict[str, TaskFuture]:
        """Schedules a graph of tasks that name each other as dependencies, as one batch.

        Args:
            nodes: Node name -> :class:`Node`; a node's ``deps`` are names of other nodes
                (or futures of this pool), in any order.

        Returns:
            Node name -> future.

        Raises:
            TaskError: A dependency names no node, or the graph has a cycle (it names the
                tasks on it); nothing is scheduled then.
        """
        with self._engine.lock:
            self._check_open()
            futures: dict[str, TaskFuture] = {}
            for name, node in nodes.items():
                index = next(self._counter)
                label = f"task {index} {name!r} ({name_of(node.fn)})"
                futures[name] = TaskFuture(self, index, label)
            tasks = []
            for name, node in nodes.items():
                inputs = tuple(_graph_input(name, dep, futures) for dep in node.deps)
                job = Job(node.fn, node.args, dict(node.kwargs), inputs, futures[name])
                tasks.append(self._task(futures[name], job, node.cost))
            self._engine.add(tasks)
            self._user_futures.extend(futures.values())
        return futures

    def map(  # type: ignore[override]
        self,
        fn: Callable[..., Any],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int | Literal["auto"] = "auto",
    ) -> Iterator[Any]:
        """``fn`` over the items, results in order (like :meth:`Executor.map`).

        Every item is submitted at once; the returned iterator waits for each result in turn.

        Args:
            fn: Called as ``fn(item)`` (or ``fn(a, b)`` for several iterables, zipped).
            *iterables: The items.
            timeout: Seconds from this call after which waiting raises ``TimeoutError``.
            chunksize: Items per task, or ``"auto"``: each worker first runs a probe chunk
                (items until their work is 20 times the pool's per-task overhead), then the
                rest is grouped so that overhead stays under 5% (see ``docs/tasks.md``).

        Returns:
            An iterator over the results. A failed item raises :class:`tfscale.TaskError`
            naming the item's index and device when the iterator reaches it.
        """
        star = len(iterables) != 1
        items: list[Any] = list(zip(*iterables, strict=False)) if star else list(iterables[0])
        deadline = None if timeout is None else time.monotonic() + timeout
        if chunksize == "auto":
            entries = self._map_auto(fn, items, star)
        else:
            if isinstance(chunksize, bool) or not isinstance(chunksize, int) or chunksize < 1:
                raise TaskError(
                    explain(
                        "map()'s chunksize must be a positive integer or 'auto'.",
                        received=chunksize,
                        allowed='"auto" or an int >= 1',
                    )
                )
            entries = self._map_chunks(fn, items, (0, len(items)), chunksize, star)
        # Chunks come out as lists, flattened by itertools.chain in C: per item this iterator
        # costs about what a list's does (it matters for map over 100,000 tiny items).
        return itertools.chain.from_iterable(_chunk_results(entries, deadline))

    def as_completed(
        self, futures: Iterable[Future[Any]] | None = None, timeout: float | None = None
    ) -> Iterator[Future[Any]]:
        """Yields futures as they finish (default: every future from ``submit``)."""
        if futures is None:
            with self._engine.lock:
                futures = list(self._user_futures)
        return concurrent.futures.as_completed(list(futures), timeout=timeout)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stops accepting tasks; queued tasks still run unless ``cancel_futures``.

        Args:
            wait: Block until every task finished and every worker (thread, process) ended.
            cancel_futures: Cancel every task not yet started (and so its dependents).
        """
        self._engine.shutdown(wait, cancel_futures)

    def stats(self) -> PoolStats:
        """Per-device busy time and task counts, makespan and utilisation so far."""
        engine = self._engine
        return summarize(engine.intervals(), engine.devices, engine.workers_per_device)

    def task_overhead(self) -> float:
        """The pool's cost per task in seconds, timed on no-op tasks (used by ``map``).

        Timed once per process for each backend and worker count: the hand-over's cost
        depends on those, not on the pool.
        """
        key = (self.backend, self._engine.worker_count)
        if key not in _OVERHEAD_S:
            warm_up = [self._submit_internal(_noop, ()) for _ in range(key[1])]
            concurrent.futures.wait(warm_up)
            start = time.perf_counter()
            futures = [self._submit_internal(_noop, ()) for _ in range(_OVERHEAD_PROBES)]
            concurrent.futures.wait(futures)
            _OVERHEAD_S[key] = (time.perf_counter() - start) / _OVERHEAD_PROBES
        return _OVERHEAD_S[key]

    def __enter__(self) -> TaskPool:
        return self

    def __repr__(self) -> str:
        return (
            f"TaskPool(devices={self.devices}, "
            f"workers_per_device={self._engine.workers_per_device}, backend={self.backend!r})"
        )

    # ------------------------------------------------------------ submitting
    def _check_open(self) -> None:
        if self._engine.closed:
            raise TaskError(
                explain(
                    "This TaskPool has been shut down and takes no new tasks.",
                    received="submit() after shutdown() or after its `with` block",
                    fix="submit inside the `with TaskPool() as pool:` block, or make a new pool.",
                )
            )

    def _task(self, future: TaskFuture, job: Job, cost: float | None) -> Task:
        if not callable(job.fn):
            raise TaskError(
                explain("A task must be callable.", received=repr(job.fn), fix="pool.submit(f, x)")
            )
        for dep in job.inputs:
            if not isinstance(dep, TaskFuture) or not dep.belongs_to(self):
                raise TaskError(
                    explain(
                        f"{future.label}: a dependency is not a future of this pool.",
                        received=repr(dep),
                        allowed="futures returned by this pool's submit() or submit_graph()",
                    )
                )
        if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float))):
            raise TaskError(explain("cost must be a number.", received=cost, allowed="float"))
        return Task(
            index=future.index,
            label=future.label,
            cost=None if cost is None else float(cost),
            deps=tuple(d.index for d in job.inputs if isinstance(d, TaskFuture)),
            payload=job,
        )

    def _submit_internal(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        *,
        label: str | None = None,
        item_base: int | None = None,
    ) -> TaskFuture:
        with self._engine.lock:
            self._check_open()
            index = next(self._counter)
            future = TaskFuture(self, index, label or f"task {index} ({name_of(fn)})")
            job = Job(fn, args, {}, (), future, internal=label is None, item_base=item_base)
            self._engine.add([self._task(future, job, None)])
        return future

    def _map_chunks(
        self,
        fn: Callable[..., Any],
        items: list[Any],
        span: tuple[int, int],
        size: int,
        star: bool,
    ) -> _Entries:
        entries = []
        for first in range(span[0], span[1], size):
            chunk = items[first : min(first + size, span[1])]
            if size == 1:
                args = tuple(chunk[0]) if star else (chunk[0],)
                label = f"map item {first} ({name_of(fn)})"
                entries.append((self._submit_internal(fn, args, label=label), False))
            else:
                label = f"map items {first}-{first + len(chunk) - 1} ({name_of(fn)})"
                future = self._submit_internal(
                    run_chunk, (fn, chunk, star), label=label, item_base=first
                )
                entries.append((future, True))
        return entries

    def _map_auto(self, fn: Callable[..., Any], items: list[Any], star: bool) -> _Entries:
        # Each worker probes the start of its own share of the items (see chunking); the
        # probes are real chunks, whose results are kept.
        overhead = self.task_overhead()
        workers = self._engine.worker_count
        per_worker = max(1, math.ceil(len(items) / workers))
        probes = []
        for first in range(0, len(items), per_worker):
            part = items[first : first + per_worker]
            label = f"map items {first}-{first + len(part) - 1} ({name_of(fn)})"
            args = (fn, part, star, probe_budget(overhead))
            future = self._submit_internal(run_probe, args, label=label, item_base=first)
            probes.append((first, len(part), future))
        # The rest of a share goes out as soon as its probe is back (chunk size from the
        # probes back so far), so a worker done with its probe never idles for a slower one.
        shares: dict[Future[Any], tuple[int, int, TaskFuture]] = {
            probe: (first, share, probe) for first, share, probe in probes
        }
        rates: list[float] = []
        rests: dict[int, _Entries] = {}
        for back in concurrent.futures.as_completed(shares):
            first, share, probe = shares[back]
            if not _succeeded(probe):
                continue  # a failed probe stops its share, as a failed chunk does
            ran = len(probe.result())
            rates.append(probe.work_s / ran)
            if ran < share:
                size = choose_chunksize(overhead, statistics.median(rates), share - ran)
                rest = (first + ran, first + share)
                rests[first] = self._map_chunks(fn, items, rest, size, star)
        entries: _Entries = []
        for first, _, future in probes:
            entries.append((future, True))
            entries += rests.get(first, [])
        return entries


def _graph_input(
    name: str, dep: str | Future[Any], futures: Mapping[str, TaskFuture]
) -> Future[Any]:
    if not isinstance(dep, str):
        return dep
    if dep not in futures:
        raise TaskError(
            explain(
                f"Node {name!r} depends on {dep!r}, which is not in the graph.",
                received=sorted(futures),
                fix="name only nodes of the same graph, or pass a future of this pool.",
            )
        )
    return futures[dep]


def _chunk_results(entries: _Entries, deadline: float | None) -> Iterator[list[Any]]:
    try:
        for position, (future, is_chunk) in enumerate(entries):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                value = future.result(remaining)
            except concurrent.futures.TimeoutError:
                for later, _ in entries[position:]:
                    later.cancel()
                raise
            except TaskError as failure:
                # A chunk whose item failed: the items before it come out first, so the
                # iterator raises where that item is, as Executor.map does.
                if is_chunk and failure.done_items:
                    yield failure.done_items
                raise
            yield value if is_chunk else [value]
    finally:
        for future, _ in entries:
            future.cancel()


def _succeeded(future: Future[Any]) -> bool:
    return not future.cancelled() and future.exception() is None


def _noop() -> None:
    return None
