"""The memory plan, pure: bytes per device of weights, gradients, optimizer state, activations
and the peak, from facts gathered once about a model (``facts.py``) and the run's options.

Under data parallelism every replica holds the whole model, its gradients and the optimizer's
state; only the activations depend on the per-replica batch. One training step on one device
holds, all the time::

    weights + optimizer state                     variables
    + input                                       the batch the step reads and the one
                                                  prefetched behind it
    + accumulators            (accumulation > 1)  one local sum per trainable variable

and, on top, the gradients with what each phase of the step adds to them; the phases follow
one another, so the peak takes the largest, not their sum (measured: an MLP's update under
Adam on 2 replicas peaks at about 2x its gradients above the variables, not at the 4.5x the
three phases' sum would give)::

    backward pass     gradients + activations     the forward/backward pass's own peak
                                                  above the gradients (graph liveness,
                                                  facts.py)
    all-reduce        gradients + all_reduce      (replicas > 1) the packed gradients and
                                                  their sum
    update            gradients + workspace       the optimizer's temporaries (Adam: the
                                                  new moments and the step before they are
                                                  assigned), proportional to the gradients

Each option changes one term: ``mixed_precision`` halves the activations and adds a
half-precision copy of the weights; ``remat`` keeps only the layers' outputs (each layer's
inside is recomputed); ``shard_optimizer_state`` divides the optimizer state by the replica
count; ``pipeline_stages`` divides the model's terms by the stage count.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, get_args

__all__ = [
    "COMPONENTS",
    "DeviceMemory",
    "Fix",
    "MemoryPlan",
    "ModelFacts",
    "PlanOptions",
    "fixes",
    "make_plan",
    "peak_of",
]

# The optimizer's temporaries per gradient byte while it updates, measured on the CPU's BFC
# allocator (benchmarks/memory_plan.py): Keras's Adam computes the new moments and the step
# as whole tensors before assigning them; SGD's update is one fused assignment.
_UPDATE_WORKSPACE = {0: 0.25, 1: 0.75, 2: 1.5}
# The packed all-reduce (training/allreduce.py): each replica's gradients concatenated into
# one buffer, and the sum it receives back before splitting.
_ALL_REDUCE_BUFFERS = 2.0

# The input batches a replica holds: the one its step reads and the one prefetched behind it.
_INPUT_BATCHES = 2

Component = Literal[
    "weights",
    "optimizer",
    "gradients",
    "activations",
    "input",
    "all_reduce",
    "workspace",
    "accumulators",
]
COMPONENTS: tuple[Component, ...] = get_args(Component)


@dataclass(frozen=True)
class ModelFacts:
    """What the plan needs to know about a model, gathered once (``facts.model_facts``).

    Attributes:
        name: The model's name.
        weight_bytes: Every variable of the model (trainable and not).
        trainable_bytes: The trainable variables (each has a gradient).
        largest_variable_bytes: The largest trainable variable.
        optimizer_slots: Slot variables the optimizer keeps per trainable variable (Adam 2,
            SGD with momentum 1, SGD 0).
        optimizer_extra_bytes: Optimizer variables that are not per-parameter slots.
        traced_batch: The per-replica batch the activations were traced at.
        activation_bytes: Peak bytes of one replica's forward and backward pass above the
            gradients, at ``traced_batch``.
        layer_output_bytes: One example's layer outputs summed over the layers (what
            recomputation keeps), times ``traced_batch``.
        input_bytes: One replica's input batch at ``traced_batch``.
    """

    name: str
    weight_bytes: int
    trainable_bytes: int
    largest_variable_bytes: int
    optimizer_slots: int
    optimizer_extra_bytes: int
    traced_batch: int
    activation_bytes: int
    layer_output_bytes: int
    input_bytes: int


@dataclass(frozen=True)
class PlanOptions:
    """The settings that change memory.

    Attributes:
        batch_per_replica: Examples per replica per micro-batch.
        replicas: Replicas of the strategy (data parallelism).
        mixed_precision: None, ``"bf16"`` or ``"fp16"``.
        remat: Recompute each layer's activations in the backward pass.
        accumulation_steps: Micro-batches per update.
        shard_optimizer_state: The optimizer state divided over the replicas (ZeRO 1).
        pipeline_stages: Stages the model is split into (each on its own device).
    """

    batch_per_replica: int
    replicas: int = 1
    mixed_precision: str | None = None
    remat: bool = False
    accumulation_steps: int = 1
    shard_optimizer_state: bool = False
    pipeline_stages: int = 1

    def describe(self) -> str:
        """The options as ``tfscale.fit`` keyword arguments."""
        parts = [f"batch {self.batch_per_replica}/replica x {self.replicas} replicas"]
        if self.accumulation_steps > 1:
            parts.append(f"accumulation_steps={self.accumulation_steps}")
        if self.mixed_precision:
            parts.append(f'mixed_precision="{self.mixed_precision}"')
        if self.remat:
            parts.append("remat=True")
        if self.shard_optimizer_state:
            parts.append("shard_optimizer_state=True")
        if self.pipeline_stages > 1:
            parts.append(f"pipeline stages={self.pipeline_stages}")
        return ", ".join(parts)


@dataclass(frozen=True)
class DeviceMemory:
    """One device's planned bytes.

    Attributes:
        device: The device name (``/device:GPU:0``).
        parts: Bytes of each component (:data:`COMPONENTS`).
        capacity: The device's memory where known, else None.
    """

    device: str
    parts: dict[str, int]
    capacity: int | None = None

    @property
    def peak(self) -> int:
        """The planned peak: what is always held, and the gradients with the largest of
        the phases of a step (activations, all-reduce buffers, update workspace)."""
        return peak_of(self.parts)

    @property
    def fits(self) -> bool | None:
        """Whether the peak is within the device's memory (None: unknown memory)."""
        return None if self.capacity is None else self.peak <= self.capacity


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of one training step, before any step runs.

    Attributes:
        model: The model's name.
        options: The settings planned for.
        devices: One row per device.
        facts: The model facts the plan was made from.
        shared_allocator: The devices draw on one allocator (logical CPUs do): compare
            the allocator's peak with :attr:`total_peak`.
    """

    model: str
    options: PlanOptions
    devices: tuple[DeviceMemory, ...]
    facts: ModelFacts = field(repr=False)
    shared_allocator: bool = False

    @property
    def peak(self) -> int:
        """The largest device's planned peak."""
        return max(d.peak for d in self.devices)

    @property
    def total_peak(self) -> int:
        """The planned peaks summed over the devices."""
        return sum(d.peak for d in self.devices)

    def to_record(self) -> dict[str, object]:
        """JSON-ready data (report.json)."""
        return {
            "model": self.model,
            "options": dataclasses.asdict(self.options),
            "shared_allocator": self.shared_allocator,
            "peak_bytes": self.peak,
            "total_peak_bytes": self.total_peak,
            "devices": [
                {
                    "device": d.device,
                    "peak_bytes": d.peak,
                    "capacity_bytes": d.capacity,
                    **{f"{k}_bytes": v for k, v in d.parts.items()},
                }
                for d in self.devices
            ],
        }

    def table(self) -> list[str]:
        """One line per device: each component and the peak, in MiB."""
        lines = [
            f"{'device':<24}"
            + "".join(f"{c:>13}" for c in COMPONENTS)
            + f"{'peak':>11}{'memory':>11}"
        ]
        for d in self.devices:
            memory = "?" if d.capacity is None else _mib(d.capacity)
            lines.append(
                f"{d.device:<24}"
                + "".join(f"{_mib(d.parts[c]):>13}" for c in COMPONENTS)
                + f"{_mib(d.peak):>11}{memory:>11}"
            )
        return lines


_HELD = ("weights", "optimizer", "input", "accumulators")
_PHASES = ("activations", "all_reduce", "workspace")


def peak_of(parts: dict[str, int]) -> int:
    """The peak of a device's components: the held ones, the gradients, and the largest
    phase (the phases of a step follow one another)."""
    held = sum(parts.get(k, 0) for k in _HELD)
    return held + parts.get("gradients", 0) + max(parts.get(k, 0) for k in _PHASES)


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f}M"


def make_plan(
    facts: ModelFacts,
    options: PlanOptions,
    devices: tuple[str, ...],
    capacities: tuple[int | None, ...] | None = None,
    *,
    shared_allocator: bool = False,
) -> MemoryPlan:
    """The plan of one training step per device.

    Args:
        facts: The model's facts.
        options: The settings to plan for.
        devices: The devices holding replicas (or stages), one row each.
        capacities: Each device's memory, where known.
        shared_allocator: The devices share one allocator (logical CPUs).

    Returns:
        The plan.
    """
    stages = max(1, options.pipeline_stages)
    replicas = max(1, options.replicas)
    batch_factor = options.batch_per_replica / max(1, facts.traced_batch)
    activations = facts.activation_bytes * batch_factor
    if options.remat:
        # Recomputation keeps each layer's output; one layer's inside is rebuilt at a time.
        boundaries = facts.layer_output_bytes * batch_factor
        activations = min(activations, boundaries + activations / max(1, _layers(facts)))
    half = options.mixed_precision in ("bf16", "fp16")
    if half:
        activations /= 2
    trainable = facts.trainable_bytes
    optimizer = float(facts.optimizer_slots * trainable + facts.optimizer_extra_bytes)
    if options.shard_optimizer_state and replicas > 1:
        optimizer = optimizer / replicas
    parts: dict[str, float] = {
        "weights": facts.weight_bytes + (facts.weight_bytes / 2 if half else 0),
        "optimizer": optimizer,
        "gradients": trainable,
        "activations": activations,
        "input": _INPUT_BATCHES * facts.input_bytes * batch_factor,
        "all_reduce": _ALL_REDUCE_BUFFERS * trainable if replicas > 1 else 0,
        "workspace": _UPDATE_WORKSPACE.get(min(facts.optimizer_slots, 2), 1.5) * trainable,
        "accumulators": trainable if options.accumulation_steps > 1 else 0,
    }
    for key in ("weights", "optimizer", "gradients", "all_reduce", "workspace", "accumulators"):
        parts[key] /= stages
    if stages > 1:
        parts["activations"] /= stages
    rounded = {k: round(v) for k, v in parts.items()}
    capacities = capacities or tuple(None for _ in devices)
    rows = tuple(
        DeviceMemory(device, dict(rounded), capacity)
        for device, capacity in zip(devices, capacities, strict=True)
    )
    return MemoryPlan(facts.name, options, rows, facts, shared_allocator)


def _layers(facts: ModelFacts) -> int:
    # The share of one layer's inside: the activations over the layer outputs' count, at
    # least 1 (a model of one layer keeps everything).
    if facts.layer_output_bytes <= 0 or facts.traced_batch <= 0:
        return 1
    return max(1, round(facts.activation_bytes / max(1, facts.layer_output_bytes)))


@dataclass(frozen=True)
class Fix:
    """A change that lowers the peak, with its predicted bytes.

    Attributes:
        change: What to pass (``accumulation_steps=2, batch_size=32``).
        why: What it costs or keeps.
        options: The options after the change.
        peak: The planned peak of the largest device after the change.
        fits: Whether it is within the budget it was judged against.
    """

    change: str
    why: str
    options: PlanOptions
    peak: int
    fits: bool


def fixes(plan: MemoryPlan, budget: int, *, devices_available: int = 1) -> list[Fix]:
    """The changes that lower ``plan``'s peak, cheapest first, each judged against ``budget``.

    Cheapest means least lost speed: a smaller per-replica batch with more accumulation keeps
    the global batch and the update (only more, smaller steps); mixed precision is faster
    where the hardware has half-precision units; sharded optimizer state costs a
    reduce-scatter and an all-gather in place of the all-reduce; recomputation costs about
    a third more compute; pipeline stages leave devices idle in the bubble.

    Args:
        plan: The plan that did not fit.
        budget: Bytes a device may use.
        devices_available: Devices a pipeline could be split over.

    Returns:
        The fixes, those that fit first, each group cheapest first.
    """
    o = plan.options
    candidates: list[tuple[str, str, PlanOptions]] = []
    batch = o.batch_per_replica
    divisors = [2**i for i in range(1, 11) if batch % 2**i == 0]
    for divisor in divisors:
        if batch // divisor >= 1:
            k = o.accumulation_steps * divisor
            candidates.append(
                (
                    f"batch_size={batch // divisor * o.replicas}, accumulation_steps={k} "
                    f"({batch // divisor} per replica)",
                    "same global batch and update, more and smaller steps",
                    dataclasses.replace(
                        o, batch_per_replica=batch // divisor, accumulation_steps=k
                    ),
                )
            )
    if not o.mixed_precision:
        candidates.append(
            (
                'mixed_precision="bf16"',
                "activations in bfloat16, float32 weights and update",
                dataclasses.replace(o, mixed_precision="bf16"),
            )
        )
    if o.replicas > 1 and not o.shard_optimizer_state:
        candidates.append(
            (
                "shard_optimizer_state=True",
                f"each replica keeps 1/{o.replicas} of the optimizer state",
                dataclasses.replace(o, shard_optimizer_state=True),
            )
        )
    if not o.remat:
        candidates.append(
            (
                "remat=True",
                "activations recomputed in the backward pass (about 1/3 more compute)",
                dataclasses.replace(o, remat=True),
            )
        )
    if devices_available >= 2 and o.pipeline_stages < 2:
        candidates.append(
            (
                "tfscale.pipeline(model, microbatches=4) over 2 stages",
                "the model split over 2 devices; the stages wait in the pipeline's bubble",
                dataclasses.replace(o, pipeline_stages=2),
            )
        )
    results = []
    for change, why, options in candidates:
        changed = make_plan(
            plan.facts,
            options,
            tuple(d.device for d in plan.devices),
            tuple(d.capacity for d in plan.devices),
        )
        results.append(Fix(change, why, options, changed.peak, changed.peak <= budget))
    fitting = [f for f in results if f.fits]
    # Of the smaller batches, only the largest one that fits is worth naming.
    seen_batch = False
    kept = []
    for fix in fitting:
        if fix.options.batch_per_replica != batch:
            if seen_batch:
                continue
            seen_batch = True
        kept.append(fix)
    rest = [f for f in results if not f.fits and f.options.batch_per_replica == batch]
    smaller = [f for f in results if not f.fits and f.options.batch_per_replica != batch]
    if smaller and not seen_batch:  # the smallest batch tried, to say it is not enough
        rest.insert(0, min(smaller, key=lambda f: f.peak))
    return kept + rest
