"""The peak bytes of a traced graph run in order, pure.

A tensor's buffer is allocated when its op runs and freed after the last op that reads it;
ops that only forward their input (``Identity``, ``Reshape``) share its buffer, and variable
reads alias the variable (counted as weights, not here). The peak of this walk, over the
ops of one replica's forward and backward pass in the order they were traced, is the plan's
activation term: what the step holds above the weights. It is the order a single executor
thread would take; TensorFlow's runs independent ops at once, which the plan's measured
comparison (benchmarks/memory_plan.py) bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ALIASING", "NOT_ALLOCATING", "OpRecord", "peak_bytes"]

# Outputs that are views of their first input: the same buffer.
ALIASING = frozenset(
    {"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient", "Snapshot"}
    | {"PreventGradient", "EnsureShape", "CheckNumerics"}
)
# Outputs held elsewhere (variables, constants, shapes): not a step's allocation.
NOT_ALLOCATING = frozenset(
    {"Placeholder", "ReadVariableOp", "VarHandleOp", "Const", "NoOp", "Shape", "ShapeN"}
    | {"Size", "Rank", "BroadcastGradientArgs", "AssignVariableOp", "AssignAddVariableOp"}
    | {"AssignSubVariableOp"}
)


@dataclass(frozen=True)
class OpRecord:
    """One op of a traced graph, as the walk needs it.

    Attributes:
        kind: The op's type (``MatMul``).
        inputs: Names of the tensors it reads.
        outputs: ``(name, bytes)`` of each tensor it produces.
    """

    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[tuple[str, int], ...]


def peak_bytes(ops: Sequence[OpRecord], kept: Sequence[str] = ()) -> tuple[int, int]:
    """Walks ``ops`` in order and returns ``(peak, live_at_end)`` bytes.

    Args:
        ops: The ops in execution order.
        kept: Tensors the caller keeps after the last op (the gradients): never freed.

    Returns:
        The largest sum of live buffers at any op, and what stays live after the last.
    """
    buffer_of: dict[str, str | None] = {}
    size: dict[str, int] = {}
    last_use: dict[str, int] = {}
    for index, op in enumerate(ops):
        for name, nbytes in op.outputs:
            if op.kind in ALIASING and op.inputs:
                buffer_of[name] = buffer_of.get(op.inputs[0])
            elif op.kind in NOT_ALLOCATING:
                buffer_of[name] = None
            else:
                buffer_of[name] = name
                size[name] = nbytes
                last_use[name] = index  # a tensor nothing reads is freed at once
        for name in op.inputs:
            buffer = buffer_of.get(name)
            if buffer is not None:
                last_use[buffer] = index
    held = {buffer_of.get(name) for name in kept}
    freed_at: dict[int, list[str]] = {}
    for buffer, index in last_use.items():
        if buffer not in held:
            freed_at.setdefault(index, []).append(buffer)
    live = peak = 0
    for index, op in enumerate(ops):
        for name, _ in op.outputs:
            if buffer_of.get(name) == name:
                live += size[name]
        peak = max(peak, live)
        for buffer in freed_at.get(index, ()):
            live -= size[buffer]
    return peak, live
