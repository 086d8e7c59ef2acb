"""Trace method: classify profiler events and remove overlaps with a sweep over time.

A TensorFlow profiler capture (``tf.profiler.experimental.start/stop``) writes, in TF 2.21,
one ``<host>.xplane.pb`` per host under ``<logdir>/plugins/profile/<run>/`` (older versions
also wrote ``*.trace.json.gz``; TensorBoard's profile plugin converts the XPlane, and is not
needed here). :func:`read_xplane` reads that protobuf with the ``xplane_pb2`` module that
TensorFlow itself ships, :func:`classify` sorts each event into input, communication or compute,
and :func:`sweep` walks the intervals in time order so that a moment counts once, under the
highest-priority class that is active:

    compute > communication > input > other

so communication hidden behind compute counts as compute, and only *exposed* communication
(the all-reduce nobody was computing during) is reported as communication.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tfscale.errors import ProfileError, explain
from tfscale.interop.internals import xplane_pb2
from tfscale.profiling.metrics import shares

__all__ = [
    "CATEGORIES",
    "STEP_MARKER",
    "Event",
    "Interval",
    "capture_steps",
    "classify",
    "find_xplane",
    "read_xplane",
    "sweep",
    "trace_breakdown",
    "traced",
]


def traced(window: tuple[int, int] | None) -> bool:
    """Whether a trace window ``(FIRST, STOP)`` asks for a trace: ``--trace-steps 0,0`` or
    ``FIRST`` alone (STOP not after FIRST) asks for none."""
    return window is not None and window[1] > window[0]


# Highest priority first: a moment where several classes are active counts as the first.
CATEGORIES: tuple[str, ...] = ("compute", "communication", "input")

# Collective and NCCL ops, and device-to-device transfers: in a multi-replica step those carry
# the gradient reduction (ReductionToOneDevice and HierarchicalCopy are plain copies + adds).
_COMM = re.compile(
    r"collective|nccl|allreduce|all-reduce|all_reduce|reducescatter|allgather"
    r"|:_(Host)?(Send|Recv)$|MemcpyD2D|MemcpyDtoD|MemcpyP2P",
    re.I,
)
_INPUT = re.compile(
    r"IteratorGetNext|GetNextFromShard|MemcpyH2D|MemcpyHtoD|memcpy.*htod|CopyHostToDevice"
    r"|EagerCopyToDevice",
    re.I,
)
# A TensorFlow op event on a host executor thread is named "<op name>:<op type>".
_HOST_OP = re.compile(r"^[^\s:]+:[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Interval:
    """A span of time in one class.

    Attributes:
        start: Start time (any unit, the same for every interval of a sweep).
        end: End time, ``>= start``.
        category: One of :data:`CATEGORIES`.
    """

    start: float
    end: float
    category: str


@dataclass(frozen=True)
class Event:
    """One event read from a trace, before classification.

    Attributes:
        name: The event's name (an op ``name:Type``, a kernel, a TraceMe name).
        start_ns: Start, nanoseconds since the capture's clock origin.
        end_ns: End in the same unit.
        line: The name of the timeline line (thread or stream) it was on.
        plane: The name of the plane (``/host:CPU``, ``/device:GPU:0``) it was on.
    """

    name: str
    start_ns: float
    end_ns: float
    line: str
    plane: str


def classify(event: Event) -> str | None:
    """The class of ``event``: ``"communication"``, ``"input"``, ``"compute"`` or None (ignored).

    Collective and NCCL ops are communication; ``IteratorGetNext`` (the consumer blocking on
    the input pipeline) and host-to-device copies are input; other TensorFlow ops and device
    kernels are compute. Wrapper events (executor bookkeeping, thread-pool regions, Python
    calls) and tf.data's own background threads are ignored: they either nest ops already
    counted or run concurrently with the step without blocking it.
    """
    if event.line.startswith("tf_data"):
        return None  # background production; the consumer's wait is IteratorGetNext
    if _COMM.search(event.name):
        return "communication"
    if _INPUT.search(event.name):
        return "input"
    if event.plane.startswith("/device:"):
        # Device planes: count kernels on stream lines once (not the XLA-op or step lines).
        return "compute" if event.line.lower().startswith("stream") else None
    if _HOST_OP.match(event.name):
        return "compute"
    return None


def sweep(
    intervals: Iterable[Interval], window: tuple[float, float] | None = None
) -> dict[str, float]:
    """Time spent in each class after removing overlaps, within ``window``.

    Walks every start and end in time order; each elementary segment between two boundaries
    is credited to the highest-priority class active in it (:data:`CATEGORIES` order), or to
    ``"other"`` when none is active (host overhead, idle).

    Args:
        intervals: Intervals in any order; they may overlap and nest.
        window: ``(start, end)`` to measure; defaults to the span of the intervals.

    Returns:
        ``{"compute", "communication", "input", "other"}`` -> time, summing to the window's length.
    """
    items = [i for i in intervals if i.end > i.start]
    for item in items:
        if item.category not in CATEGORIES:
            raise ValueError(f"unknown category {item.category!r}; allowed: {CATEGORIES}")
    totals = {name: 0.0 for name in (*CATEGORIES, "other")}
    if window is None:
        if not items:
            return totals
        window = (min(i.start for i in items), max(i.end for i in items))
    low, high = window
    if high <= low:
        return totals
    # +1 at a start, -1 at an end; ends sort before starts at the same time.
    points: list[tuple[float, int, str]] = []
    for item in items:
        start, end = max(item.start, low), min(item.end, high)
        if end > start:
            points.append((start, 1, item.category))
            points.append((end, -1, item.category))
    points.sort(key=lambda p: (p[0], p[1]))
    active = {name: 0 for name in CATEGORIES}
    cursor = low
    for time, delta, category in points:
        if time > cursor:
            totals[_top(active)] += time - cursor
            cursor = time
        active[category] += delta
    totals["other"] += high - cursor
    return totals


def _top(active: dict[str, int]) -> str:
    for name in CATEGORIES:
        if active[name] > 0:
            return name
    return "other"


def find_xplane(logdir: str) -> list[str]:
    """Paths of the XPlane files of the newest capture under ``logdir``."""
    runs = sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*")))
    if not runs:
        return []
    return sorted(glob.glob(os.path.join(runs[-1], "*.xplane.pb")))


def read_xplane(path: str) -> list[Event]:
    """Every timed event of an XPlane file (``*.xplane.pb``) written by the TF profiler.

    Raises:
        ProfileError: The file cannot be read or parsed.
    """
    space = xplane_pb2().XSpace()
    try:
        with open(path, "rb") as handle:
            space.ParseFromString(handle.read())
    except (OSError, ValueError) as error:
        raise ProfileError(
            explain(
                "The profiler trace could not be read.",
                received=path,
                allowed="an .xplane.pb written by tf.profiler.experimental.stop()",
                fix="capture again; check that the directory is writable.",
            )
        ) from error
    events: list[Event] = []
    for plane in space.planes:
        for line in plane.lines:
            origin_ns = float(line.timestamp_ns)
            for item in line.events:
                meta = plane.event_metadata.get(item.metadata_id)
                name = (meta.name or meta.display_name) if meta is not None else ""
                start = origin_ns + item.offset_ps / 1000.0
                events.append(
                    Event(name, start, start + item.duration_ps / 1000.0, line.name, plane.name)
                )
    return events


def trace_breakdown(
    events: Sequence[Event], step_marker: str | None = None
) -> tuple[dict[str, float], int]:
    """Seconds per class summed over the marked steps of a capture.

    Args:
        events: Events from :func:`read_xplane`.
        step_marker: Name of the ``tf.profiler.experimental.Trace`` events that delimit steps;
            None (or no such event) measures the whole capture as one window.

    Returns:
        ``({class: seconds}, number of steps)``.
    """
    intervals = [
        Interval(e.start_ns, e.end_ns, category)
        for e in events
        if (category := classify(e)) is not None
    ]
    windows = [(e.start_ns, e.end_ns) for e in events if step_marker and e.name == step_marker]
    if not windows:
        if not intervals:
            return {name: 0.0 for name in (*CATEGORIES, "other")}, 0
        windows = [(min(i.start for i in intervals), max(i.end for i in intervals))]
    totals = {name: 0.0 for name in (*CATEGORIES, "other")}
    for window in windows:
        for name, value in sweep(intervals, window).items():
            totals[name] += value / 1e9
    return totals, len(windows)


STEP_MARKER = "tfscale_step"


def capture_steps(step_fn: Callable[[], Any], steps: int, logdir: str) -> dict[str, float]:
    """Profiles ``steps`` steps with the TensorFlow profiler and returns each class's share.

    Each call of ``step_fn`` (one step, its input fetch included) is wrapped in a ``Trace``
    event named :data:`STEP_MARKER`, so the sweep measures exactly the steps.

    Returns:
        ``{"compute", "communication", "input", "other"}`` -> fraction of the traced steps;
        empty when the profiler wrote nothing.
    """
    import tensorflow as tf

    tf.profiler.experimental.start(logdir)
    try:
        for number in range(steps):
            with tf.profiler.experimental.Trace(STEP_MARKER, step_num=number, _r=1):
                step_fn()
    finally:
        tf.profiler.experimental.stop()
    paths = find_xplane(logdir)
    if not paths:
        return {}
    totals, _ = trace_breakdown(read_xplane(paths[0]), STEP_MARKER)
    return shares(totals)
