"""Out of memory, explained: a step's ``ResourceExhaustedError`` turned into a tfscale error
that names the device, the memory plan's breakdown, the cheapest changes that would fit
with their predicted bytes, and the last checkpoint (nothing is lost).

The step function (``training/function.py``) calls :func:`explained` around each call; a
custom loop wraps its step call in :func:`out_of_memory_explained`. A checkpoint callback
says where it saves (:func:`note_checkpoints`), so that the error can name the checkpoint
the run resumes from.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tfscale.errors import OutOfMemoryError, explain
from tfscale.training.memory.plan import COMPONENTS, Fix, MemoryPlan, fixes

__all__ = [
    "budget_for",
    "error_device",
    "explained",
    "is_out_of_memory",
    "note_checkpoints",
    "out_of_memory_explained",
    "out_of_memory_message",
]

_CHECKPOINTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_DEVICE = re.compile(r"(/job:[^\s]*?)?/device:([A-Z]+:\d+)")
# A fix fits when its predicted peak is within this share of the smaller of the device's
# memory and the peak that failed: the plan's predictions are within 20% of the allocator
# (benchmarks/memory_plan.py), so a fix at the limit itself may still not fit.
_MARGIN = 0.9


def note_checkpoints(model: Any, directory: str) -> None:
    """Records where ``model``'s checkpoints are saved (the checkpoint callback calls it)."""
    _CHECKPOINTS[model] = directory


def _last_checkpoint(model: Any) -> str | None:
    directory = _CHECKPOINTS.get(model)
    if directory is None:
        return None
    import tensorflow as tf

    return tf.train.latest_checkpoint(directory)  # type: ignore[no-any-return]


def error_device(message: str) -> str | None:
    """The device a ``ResourceExhaustedError``'s message names (``/device:GPU:0``), if any.

    TensorFlow words it "OOM when allocating tensor with shape[...] and type float on
    /job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc".
    """
    match = _DEVICE.search(message)
    return f"/device:{match.group(2)}" if match else None


def is_out_of_memory(error: BaseException) -> bool:
    """Whether a ``ResourceExhaustedError`` is an allocator's (TensorFlow also uses the code
    for other exhausted resources, such as a queue's capacity)."""
    text = str(error)
    return "OOM" in text or "out of memory" in text.lower()


def budget_for(plan: MemoryPlan, device: str | None) -> int:
    """The bytes a fix must stay within on ``device`` (the plan's largest where unknown)."""
    row = next((d for d in plan.devices if d.device == device), None)
    row = row or max(plan.devices, key=lambda d: d.peak)
    limit = row.peak if row.capacity is None else min(row.capacity, row.peak)
    return int(limit * _MARGIN)


def _mib(value: int) -> str:
    return f"{value / 2**20:,.1f} MiB"


def out_of_memory_message(
    plan: MemoryPlan | None,
    device: str | None,
    found: list[Fix],
    checkpoint: str | None,
    cause: str,
) -> str:
    """The error's text: problem, received, allowed and fix (pure)."""
    where = device or "a device"
    problem = f"A training step ran out of memory on {where}."
    if plan is not None:
        row = next((d for d in plan.devices if d.device == device), plan.devices[0])
        parts = ", ".join(f"{c} {_mib(row.parts[c])}" for c in COMPONENTS if row.parts[c])
        memory = "unknown memory" if row.capacity is None else f"{_mib(row.capacity)} memory"
        problem += (
            f" Planned per device for {plan.options.describe()}: {parts}; "
            f"peak {_mib(row.peak)} (the held parts, the gradients and the largest of "
            f"activations, all_reduce and workspace, which follow one another) of {memory}."
        )
    if checkpoint:
        problem += (
            f" Nothing is lost: the last checkpoint is {checkpoint}, and the same "
            "checkpoint_dir resumes from it."
        )
    else:
        problem += " No checkpoint was saved before it (pass checkpoint_dir= to keep one)."
    lines = []
    fitting = [f for f in found if f.fits]
    for fix in found:
        verdict = "fits" if fix.fits else "still too large"
        lines.append(f"    {fix.change}: peak {_mib(fix.peak)} per device, {verdict} ({fix.why})")
    if not fitting:
        lines.append("    none of these fits alone: combine them, or train on more devices.")
    fix_text = "the cheapest changes first, with their predicted peak:\n" + "\n".join(lines)
    allowed = None
    if plan is not None:
        allowed = f"a peak within {_mib(budget_for(plan, device))} per device"
    return explain(problem, received=cause, allowed=allowed, fix=fix_text if found else None)


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    # TensorFlow's graph errors start "Graph execution error:"; the allocator's line says what.
    oom = next((line for line in lines if "OOM when allocating" in line), None)
    shown = oom or (lines[0] if lines else "")
    return f"{type(error).__name__}: {shown[:300]}"


def out_of_memory_error(
    model: Any, error: BaseException, batch_per_replica: int | None, options: Any = None
) -> OutOfMemoryError:
    """The tfscale error for ``error``, a ``ResourceExhaustedError`` of ``model``'s step.

    The plan is made for the step that failed (the strategy and options of the prepared
    model); where it cannot be made (the model's inputs are unknown), the error still
    names the device and the checkpoint.
    """
    from tfscale.training.memory import plan_memory

    device = error_device(str(error))
    plan: MemoryPlan | None = None
    found: list[Fix] = []
    if batch_per_replica:
        try:
            plan = plan_memory(
                model,
                batch_per_replica,
                mixed_precision=_option(options, "mixed_precision"),
                remat=bool(_option(options, "remat") or False),
                accumulation_steps=int(_option(options, "accumulation_steps") or 1),
            )
        except Exception:  # the explanation must not hide the error it explains
            plan = None
    if plan is not None:
        found = fixes(plan, budget_for(plan, device), devices_available=len(plan.devices))
    checkpoint = _last_checkpoint(model)
    message = out_of_memory_message(plan, device, found, checkpoint, _first_line(error))
    return OutOfMemoryError(
        message, device=device, plan=plan, fixes=tuple(found), checkpoint=checkpoint
    )


def _option(options: Any, name: str) -> Any:
    if name == "mixed_precision":  # Options.precision: a decided Precision
        precision = getattr(getattr(options, "precision", None), "name", "fp32")
        return None if precision == "fp32" else precision
    return getattr(options, name, None)


@contextmanager
def explained(model: Any, batch_per_replica: int | None, options: Any = None) -> Iterator[None]:
    """Turns a ``ResourceExhaustedError`` raised inside into :class:`OutOfMemoryError`."""
    import tensorflow as tf

    try:
        yield
    except tf.errors.ResourceExhaustedError as error:
        if not is_out_of_memory(error):
            raise
        raise out_of_memory_error(model, error, batch_per_replica, options) from error


@contextmanager
def out_of_memory_explained(model: Any, batch_per_replica: int) -> Iterator[None]:
    """For a custom loop: an out-of-memory step inside becomes :class:`OutOfMemoryError`
    with the plan, the fixes and the last checkpoint.

    Example::

        with tfscale.out_of_memory_explained(model, batch_per_replica=64):
            for batch in dataset:
                train(batch)
    """
    with explained(model, batch_per_replica):
        yield
