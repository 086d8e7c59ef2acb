"""Elastic jobs (``tfscale launch --min-workers M``): which worker slot to drop, when, and
the job's last line. Pure and TensorFlow-free; the supervisor applies the decisions.

A *slot* is one worker of the job as launched (``worker 2`` of ``-n 3``: its GPUs, its
host). The job restarts as usual after a failure; when the same slot failed on every start
at the current size until the restarts are used up (``--max-restarts R``: ``R + 1``
failures in a row), or its host cannot be reached, the slot is dropped and the job
restarts on the others, with a fresh restart budget, as long as ``M`` workers are left::

    -n 3 --min-workers 2 --max-restarts 2, worker 2 dies on every start
    attempt  slots      failed
       1     0 1 2      worker 2
       2     0 1 2      worker 2
       3     0 1 2      worker 2  -> dropped (3 of 3 starts); 2 left >= 2
       4     0 1        -          job exits 0 on 2 workers

Why the result is exact: the update is the count-weighted mean over the global batch, and
the checkpoint's position counts global batches, so M workers resume at the batch N
workers stopped at, with the same global batches (docs/launch.md, "Elastic jobs").

The chief's ``tfscale.fit`` leaves where its latest checkpoint is in the job's report folder
(``cluster/notes.py``), so the launcher's last line can say where to resume from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from tfscale.cluster.notes import CheckpointNote

__all__ = ["Drop", "elastic_line", "slot_to_drop"]

_Slot = TypeVar("_Slot")


@dataclass(frozen=True)
class Drop:
    """A worker slot the job lost.

    Attributes:
        slot: The slot (``2`` for ``worker 2`` of the job as launched).
        label: Its label (``worker 2``).
        why: What happened to it (``killed by SIGKILL``, ``exited with code 3``,
            ``its host could not be reached``).
        starts: How many starts in a row it failed at that size.
        workers_left: Workers the job has without it.
    """

    slot: int
    label: str
    why: str
    starts: int
    workers_left: int


def slot_to_drop(failed_slots: Sequence[_Slot | None], max_restarts: int) -> _Slot | None:
    """The slot that failed on every start at the current size, once the restarts are used.

    Args:
        failed_slots: The slot that ended each failed attempt at the current size, in order
            (None: not a worker slot, e.g. a time limit); a node's name for Slurm.
        max_restarts: Restarts per size (``--max-restarts``).

    Returns:
        The slot to drop, or None: restarts are left, or different slots failed (a flaky
        job, not a lost machine), or what failed is not a worker slot.
    """
    if len(failed_slots) < max_restarts + 1:
        return None
    slots = set(failed_slots)
    if len(slots) != 1:
        return None
    return next(iter(slots))


def _said(drop: Drop) -> str:
    starts = "1 start" if drop.starts == 1 else f"{drop.starts} starts in a row"
    return f"{drop.label} ({drop.why} on {starts})"


def _checkpoint_words(note: CheckpointNote | None) -> str:
    if note is None:
        return "no checkpoint was noted (resume needs tfscale.fit(checkpoint_dir=...))"
    return (
        f"resume from {note.path} (epoch {note.epoch}, batch {note.batches}, "
        f"update {note.updates}): run the job again with the same checkpoint_dir"
    )


def elastic_line(
    *,
    workers: int,
    finished: int | None,
    dropped: Sequence[Drop],
    below: Drop | None,
    min_workers: int,
    checkpoint: CheckpointNote | None,
) -> str | None:
    """The last line of an elastic job that lost workers (None when it lost none).

    Args:
        workers: Workers the job was launched with (N).
        finished: Workers it finished on, or None when it failed.
        dropped: The slots dropped, in order.
        below: The slot whose loss would have left fewer than ``min_workers`` (the job
            failed), or None.
        min_workers: ``--min-workers``.
        checkpoint: The chief's latest checkpoint, for the failed job's line.
    """
    lost = [*dropped, *([below] if below is not None else [])]
    if not lost:
        return None
    said = "; ".join(_said(d) for d in dropped)
    if below is None and finished is not None:
        return f"finished on {finished} of {workers} workers: dropped {said}"
    if below is None:
        return f"job failed after it dropped {said}; {_checkpoint_words(checkpoint)}"
    lost_words = ", ".join(d.label for d in lost)
    before = f"dropped {said}; then " if dropped else ""
    return (
        f"job failed: {before}{_said(below)}, and without it {below.workers_left} "
        f"worker(s) would be left, fewer than "
        f"--min-workers {min_workers} (lost: {lost_words}); {_checkpoint_words(checkpoint)}"
    )
