"""Granularity: group tiny tasks so that the pool's per-task overhead stays small.

``map(chunksize="auto")`` knows the pool's per-task overhead ``o`` (timed once per process on
no-op tasks). Each worker first runs a *probe*: a real chunk that runs items until it has
worked ``o / 5%`` seconds (:func:`probe_budget`, :func:`run_probe`), so the probe itself keeps
overhead under 5% and yields the work per item ``w``. The remaining items are grouped ``c`` at a
time with ``o / (c * w) <= 5%``, i.e. ``c = 20 * o / w`` (:func:`choose_chunksize`), the
smallest such size so that uneven items balance best. Large work thus makes many chunks per
worker; a map whose whole work is worth only a few overheads runs as few chunks as the 5% asks
for, down to one: balancing it could gain less than the hand-offs cost. (An earlier rule kept
4 chunks per worker whatever the work, which on 100,000 items of 50 ns cost 3x the loop.)
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "OVERHEAD_TARGET",
    "ChunkItemError",
    "choose_chunksize",
    "probe_budget",
    "run_chunk",
    "run_probe",
]

OVERHEAD_TARGET = 0.05


class ChunkItemError(Exception):
    """Raised by :func:`run_chunk` when one item fails: which one, its exception, and the
    results of the items before it (``map`` hands them out before the failure, as
    ``Executor.map`` does; they travel with the error, so they are in its pickled ``args``)."""

    def __init__(self, offset: int, error: BaseException, done: list[Any] | None = None) -> None:
        super().__init__(offset, error, done)
        self.offset = offset
        self.error = error
        self.done: list[Any] = list(done or [])


def choose_chunksize(
    overhead_s: float,
    work_s: float,
    items: int,
    target: float = OVERHEAD_TARGET,
) -> int:
    """The chunk size that keeps overhead under ``target`` of the work.

    Args:
        overhead_s: The pool's cost per task (submission, hand-over, result).
        work_s: The median time of one item's work.
        items: Items still to run.
        target: Overhead allowed as a fraction of the work.

    Returns:
        Items per chunk: the smallest size that keeps overhead under ``target``, at most
        ``items``. That makes about ``target * items * work_s / overhead_s`` chunks,
        whatever the workers: many per worker for large work (4 per worker once the work is
        worth ``4 * workers / target`` overheads), fewer, down to one, for a map so short
        that balancing it would cost more than it could gain.
    """
    if items <= 0 or overhead_s <= 0:
        return 1
    needed = math.ceil(overhead_s / (target * max(work_s, 1e-9)) * (1 - 1e-9))  # no float 2000.0001
    return max(1, min(needed, items))


def probe_budget(overhead_s: float, target: float = OVERHEAD_TARGET) -> float:
    """Seconds of work a probe chunk runs: enough that one hand-off is ``target`` of it."""
    return max(overhead_s, 0.0) / target


def run_chunk(fn: Callable[..., Any], items: Sequence[Any], star: bool = False) -> list[Any]:
    """Runs ``fn(item)`` (``fn(*item)`` when ``star``) for each item of a chunk, in order.

    Raises:
        ChunkItemError: The first item that raised, with its offset in the chunk.
    """
    results: list[Any] = []
    try:
        # list.extend over map() runs the loop in C, as fast as a plain loop, and keeps the
        # results appended before an item raised, so their count is the failed item's offset.
        results.extend(itertools.starmap(fn, items) if star else map(fn, items))
    except Exception as error:
        raise ChunkItemError(len(results), error, results) from error
    return results


def run_probe(
    fn: Callable[..., Any],
    items: Sequence[Any],
    star: bool,
    budget_s: float,
    clock: Callable[[], float] = time.perf_counter,
) -> list[Any]:
    """Runs the first items of ``items`` in order until ``budget_s`` seconds of work are done.

    Items run in batches of 1, 1, 2, 4, 8... (each batch's loop in C, as in :func:`run_chunk`)
    and the clock is read between batches only, so timing costs nothing per item. The probe
    stops at most one batch (as long as all before it) past its budget, unless what is left is
    estimated at less than a budget: it then runs that too, so no chunk shorter than a budget
    is left behind. Always runs at least one item (if any); the length of the result tells the
    caller how many ran. ``clock`` is for tests.

    Raises:
        ChunkItemError: The first item that raised, with its offset in ``items``.
    """
    results: list[Any] = []
    pending = iter(items)  # batches are taken from it: no copies
    start = clock()
    done, batch = 0, 1
    try:
        while done < len(items):
            part = itertools.islice(pending, batch)
            results.extend(itertools.starmap(fn, part) if star else map(fn, part))
            done = len(results)
            elapsed = clock() - start
            if elapsed >= budget_s:
                if (len(items) - done) * elapsed / done >= budget_s:
                    break
                # What is left would make a chunk shorter than a budget, whose hand-off costs
                # more than the target: run it here (the probe then lasts < 2 budgets + a batch).
                batch = len(items) - done
            else:
                batch = max(1, done)
    except Exception as error:
        raise ChunkItemError(len(results), error, results) from error
    return results
