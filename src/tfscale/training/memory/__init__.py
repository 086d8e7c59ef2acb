"""Memory: the plan of a training step's bytes per device, the allocator's measured peak,
and out-of-memory errors explained with the plan and the changes that would fit.

``tfscale.plan_memory(model, batch_per_replica, strategy=...)`` is the public entry.
"""

from __future__ import annotations

from typing import Any

from tfscale.training.memory.plan import (
    DeviceMemory,
    Fix,
    MemoryPlan,
    ModelFacts,
    PlanOptions,
    fixes,
)

__all__ = [
    "DeviceMemory",
    "Fix",
    "MemoryPlan",
    "ModelFacts",
    "PlanOptions",
    "fixes",
    "plan_memory",
]


def plan_memory(
    model: Any,
    batch_per_replica: int,
    *,
    strategy: Any = None,
    mixed_precision: str | None = None,
    remat: bool = False,
    accumulation_steps: int = 1,
    shard_optimizer_state: bool = False,
    pipeline_stages: int = 1,
    input_shape: Any = None,
) -> MemoryPlan:
    """Plans one training step's memory per device, before any step runs.

    Each replica of a data-parallel strategy holds the weights, the gradients, the
    optimizer's state and the activations of its share of the batch; the plan gives each
    in bytes, their peak and each device's memory where it is known.

    Args:
        model: A built Keras model (compiled: its optimizer's state is counted).
        batch_per_replica: Examples per replica per step (per micro-batch).
        strategy: The strategy it trains under; None: the model's, or the one in scope.
        mixed_precision: None, ``"bf16"`` or ``"fp16"``, as ``tfscale.fit`` takes it.
        remat: Recomputed activations, as ``tfscale.fit(remat=True)``.
        accumulation_steps: Micro-batches per update.
        shard_optimizer_state: The optimizer state sharded over the replicas.
        pipeline_stages: Stages of a pipeline the model is split into.
        input_shape: One example's shape, for a model not built from ``keras.Input``.

    Returns:
        The :class:`MemoryPlan`; ``plan.table()`` prints it, ``fixes(plan, budget)``
        lists the changes that lower it.

    Raises:
        TrainingError: The model's inputs are unknown, or an option is out of range.

    Example::

        plan = tfscale.plan_memory(model, 64, strategy=choice.strategy)
        print("\\n".join(plan.table()))
    """
    from tfscale.devices.names import device_kind
    from tfscale.training.memory.facts import model_facts
    from tfscale.training.memory.plan import make_plan
    from tfscale.training.memory.targets import device_capacities, plan_devices
    from tfscale.training.options import Options

    # The training options are checked as every entry checks them (one definition); the
    # pipeline's stages are the plan's own.
    checked = Options(
        mixed_precision=mixed_precision,
        remat=remat,
        accumulation_steps=accumulation_steps,
        shard_optimizer_state=shard_optimizer_state,
    )
    if (
        isinstance(pipeline_stages, bool)
        or not isinstance(pipeline_stages, int)
        or (pipeline_stages < 1)
    ):
        from tfscale.errors import TrainingError, explain

        raise TrainingError(
            explain("pipeline_stages must be an int >= 1.", received=pipeline_stages)
        )
    mixed_precision, remat = checked.mixed_precision, checked.remat
    accumulation_steps = checked.accumulation_steps
    shard_optimizer_state = checked.shard_optimizer_state
    devices = plan_devices(model, strategy)
    options = PlanOptions(
        batch_per_replica=int(batch_per_replica),
        replicas=len(devices),
        mixed_precision=mixed_precision,
        remat=remat,
        accumulation_steps=accumulation_steps,
        shard_optimizer_state=shard_optimizer_state,
        pipeline_stages=pipeline_stages,
    )
    facts = model_facts(model, int(batch_per_replica), input_shape)
    shared = all(device_kind(d) == "CPU" for d in devices)
    return make_plan(
        facts, options, tuple(devices), device_capacities(devices), shared_allocator=shared
    )
