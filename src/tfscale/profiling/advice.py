"""Advice: rules over a measured breakdown, each with its effect predicted from the measurements.

Facts are gathered once into :class:`Facts`; every rule is a pure function of them that returns
an :class:`Advice` or None, and :func:`advise` orders what fired by predicted speedup. The cost
model behind the predictions is deliberately small and every coefficient in it is measured at
the advised replica count: a step is ``input + compute + exposed communication``; the all-reduce
costs the same per update whatever the batch; the rest ("local" time) grows as
``a + c * batch`` (from probes at 1x and 2x the batch) or, with accumulation, as
``a' + m * micro-batches`` (from a probe at 2x the micro-batches per update).
Proportional scaling is assumed only where a probe is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tfscale.profiling.steptime import Breakdown

__all__ = ["RULES", "Advice", "Facts", "advise", "fit_batch_cost"]

INPUT_SHARE = (0.05, 0.20)
COMMUNICATION_SHARE = (0.03, 0.15)
SMALL_BATCH = 32
# Compute per update at the same per-replica batch that grew this much with the replica count
# means the replicas compete for shared hardware (25%: above run-to-run noise here).
SHARED_COMPUTE_GROWTH = 1.25
# Assumed speedups of the compute part where nothing here measured them (labelled in the text).
BF16_COMPUTE_SPEEDUP = 2.0
XLA_COMPUTE_SPEEDUP = 1.15
# Exposed communication after / before gradient_compression="bf16": half the bytes. Measured
# 0.486-0.499x over 1 Gbit/s and 400 Mbit/s links between 2 worker processes
# (benchmarks/allreduce_modes.py, docs/profiling.md).
COMPRESSED_COMMUNICATION = 0.5


@dataclass(frozen=True)
class Facts:
    """What the rules judge: one configuration's breakdown and the context it ran in.

    Attributes:
        breakdown: Breakdown of the configuration being advised.
        replicas: Its replica count.
        batch_per_replica: Its per-replica micro-batch.
        accumulation: Its accumulation count.
        device_kind: ``"CPU"`` or ``"GPU"``.
        physical_devices: Physical cores (CPU) or GPUs available.
        throughput_by_replicas: Measured examples/s per replica count (same batch setting).
        compute_by_replicas: Measured compute seconds per update per replica count, at this
            per-replica batch and accumulation (weak scaling: the same work per replica).
        batch_cost: ``(a, c)``: local (non-communication) seconds per update ~ ``a + c *
            examples per replica``, or None.
        accumulation_cost: ``(a, m)``: local seconds per update ~ ``a + m * micro-batches``
            (measured at 1x and 2x the micro-batches), or None.
        bf16_available: The hardware has fast bfloat16 matrix units.
        precision: ``"float32"`` or a mixed policy.
        jit_compile: Whether the step is compiled with XLA.
        over_a_link: The all-reduce crosses a link (between GPUs or worker processes), where
            its time follows its bytes; between CPU devices of one process it is a copy in
            memory, which halving the bytes with casts does not speed up.
        gradient_compression: The measured step's ``gradient_compression`` (None: float32).
    """

    breakdown: Breakdown
    replicas: int
    batch_per_replica: int
    accumulation: int = 1
    device_kind: str = "CPU"
    physical_devices: int = 1
    throughput_by_replicas: Mapping[int, float] = field(default_factory=dict)
    compute_by_replicas: Mapping[int, float] = field(default_factory=dict)
    batch_cost: tuple[float, float] | None = None
    accumulation_cost: tuple[float, float] | None = None
    bf16_available: bool = False
    precision: str = "float32"
    jit_compile: bool = False
    over_a_link: bool = False
    gradient_compression: str | None = None


@dataclass(frozen=True)
class Advice:
    """One recommendation.

    Attributes:
        key: Stable identifier (``"input-pipeline"``, ``"accumulate"``, ``"larger-batch"``,
            ``"fewer-replicas"``, ``"shared-compute"``, ``"compress-gradients"``, ``"bf16"``,
            ``"xla"``).
        severity: ``"high"`` or ``"medium"``.
        text: What to do, why, and the predicted effect, in one paragraph.
        predicted_speedup: Predicted examples/s after / before.
        change: Settings ``--verify`` applies to re-measure (empty: not automatic).
        shares_after: Predicted shares of the step after the change.
    """

    key: str
    severity: str
    text: str
    predicted_speedup: float
    change: dict[str, Any] = field(default_factory=dict)
    shares_after: dict[str, float] = field(default_factory=dict)


def fit_batch_cost(points: Mapping[int, float]) -> tuple[float, float] | None:
    """Least-squares ``seconds = a + c * examples`` over ``{examples: seconds}``, a and c >= 0."""
    if len(points) < 2:
        return None
    xs = list(points)
    ys = [points[x] for x in xs]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    slope = max(slope, 0.0)
    return max(mean_y - slope * mean_x, 0.0), slope


def _scaled_local(facts: Facts, factor: int) -> float:
    """Predicted non-communication seconds per update when it processes ``factor``x examples."""
    b = facts.breakdown
    local = b.step_s - b.communication_s
    examples = facts.batch_per_replica * facts.accumulation
    if facts.batch_cost is None:
        return local * factor
    a, c = facts.batch_cost
    now = a + c * examples
    return local * (a + c * examples * factor) / now if now > 0 else local * factor


def _percent(value: float) -> str:
    return f"{100 * value:.0f}%"


def _severity(share: float, limits: tuple[float, float]) -> str | None:
    if share > limits[1]:
        return "high"
    if share > limits[0]:
        return "medium"
    return None


def input_rule(facts: Facts) -> Advice | None:
    """Input wait above 5% (medium) or 20% (high) of the step."""
    b = facts.breakdown
    share = b.shares["input"]
    severity = _severity(share, INPUT_SHARE)
    if severity is None or b.step_s <= b.input_s:
        return None
    gain = b.step_s / (b.step_s - b.input_s)
    return Advice(
        "input-pipeline",
        severity,
        f"Input pipeline: each step waits {b.input_s * 1e3:.1f} ms for its batch "
        f"({_percent(share)} of the step). Parallelise and overlap it: "
        "dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE), .cache() after expensive "
        "loading, .prefetch(tf.data.AUTOTUNE) last; or run several steps per call "
        f"(steps_per_execution) to amortise per-step fetching: input {_percent(share)} -> 0% "
        f"of the step, predicted {gain:.2f}x examples/s (upper bound: all the wait hidden).",
        gain,
        {},
        {"input": 0.0},
    )


def _accumulated_local(facts: Facts, factor: int) -> float:
    """Predicted local seconds per update with ``factor`` x the micro-batches per update.

    Each micro-batch reads the weights and adds into gradient accumulators whatever its
    size, so accumulation is not a larger batch: it has its own measured cost line.
    """
    if facts.accumulation_cost is None:
        return _scaled_local(facts, factor)
    a, m = facts.accumulation_cost
    return a + m * factor * facts.accumulation


def _accumulation_factor(facts: Facts, local: Callable[[Facts, int], float], cap: int = 8) -> int:
    """Smallest accumulation (2, 4, 8) that brings exposed communication to 3% or less.

    Capped (8 for accumulation, 4 for the batch; both measured up to 2x):
    extrapolating further would claim more than was measured.
    """
    b = facts.breakdown
    for k in (2, 4, 8):
        if k >= cap or b.communication_s / (local(facts, k) + b.communication_s) <= 0.03:
            return k
    return cap


def accumulation_rule(facts: Facts) -> Advice | None:
    """Exposed communication above 3% / 15%: all-reduce once per k micro-batches."""
    b = facts.breakdown
    share = b.shares["communication"]
    severity = _severity(share, COMMUNICATION_SHARE)
    if severity is None or facts.replicas < 2:
        return None
    k = _accumulation_factor(facts, _accumulated_local)
    step_k = _accumulated_local(facts, k) + b.communication_s
    gain = k * b.step_s / step_k
    after = b.communication_s / step_k
    return Advice(
        "accumulate",
        severity,
        f"Exposed communication: the gradient all-reduce adds {b.communication_s * 1e3:.1f} ms "
        f"to every step ({_percent(share)}). Accumulate {k} micro-batches per update "
        f"(tfscale.fit(..., accumulation_steps={k * facts.accumulation})) so it runs once per "
        f"{k} micro-batches at the same memory: exposed communication {_percent(share)} -> "
        f"{_percent(after)} of the step, predicted {gain:.2f}x examples/s.",
        gain,
        {"accumulation": k * facts.accumulation},
        {"communication": after},
    )


def batch_rule(facts: Facts) -> Advice | None:
    """Small per-replica batch, or exposed communication: a larger per-replica batch."""
    b = facts.breakdown
    share = b.shares["communication"]
    if facts.batch_per_replica < 1:
        return None  # unknown batch (a profiled script): nothing to scale
    small = facts.batch_per_replica < SMALL_BATCH
    communication = _severity(share, COMMUNICATION_SHARE) is not None and facts.replicas > 1
    if not (small or communication):
        return None
    k = _accumulation_factor(facts, _scaled_local, cap=4) if communication else 4
    step_k = _scaled_local(facts, k) + b.communication_s
    gain = k * b.step_s / step_k
    if gain < 1.05:
        return None
    new_batch = facts.batch_per_replica * k
    return Advice(
        "larger-batch",
        "high" if gain > 1.5 else "medium",
        f"Per-replica batch {facts.batch_per_replica} is small: fixed per-step costs "
        f"(launch, all-reduce) dominate. Use {new_batch} per replica if memory allows "
        f"(scale the learning rate with it): exposed communication {_percent(share)} -> "
        f"{_percent(b.communication_s / step_k)} of the step, predicted {gain:.2f}x examples/s.",
        gain,
        {"batch_per_replica": new_batch},
        {"communication": b.communication_s / step_k},
    )


def compression_rule(facts: Facts) -> Advice | None:
    """Exposed communication above 3% / 15% over a link, in float32: all-reduce in bfloat16."""
    b = facts.breakdown
    share = b.shares["communication"]
    severity = _severity(share, COMMUNICATION_SHARE)
    if (
        severity is None
        or facts.replicas < 2
        or not facts.over_a_link
        or facts.gradient_compression is not None
    ):
        return None
    after_s = b.communication_s * COMPRESSED_COMMUNICATION
    step = b.step_s - b.communication_s + after_s
    gain = b.step_s / step
    return Advice(
        "compress-gradients",
        severity,
        f"Exposed communication: the float32 gradient all-reduce adds "
        f"{b.communication_s * 1e3:.1f} ms to every step ({_percent(share)}). "
        "tfscale.fit(..., gradient_compression='bf16') sends half the bytes (the summed "
        "gradient is rounded to bfloat16: weights stay within about 1e-2 of float32's, "
        f"docs/training.md): exposed communication {_percent(share)} -> "
        f"{_percent(after_s / step)} of the step, predicted {gain:.2f}x examples/s (half "
        "the time, as measured over links: docs/profiling.md).",
        gain,
        {"gradient_compression": "bf16"},
        {"communication": after_s / step},
    )


def replicas_rule(facts: Facts) -> Advice | None:
    """More replicas than physical cores or GPUs, and fewer replicas measured faster."""
    if facts.replicas <= facts.physical_devices:
        return None
    fitting = {n: t for n, t in facts.throughput_by_replicas.items() if n <= facts.physical_devices}
    now = facts.throughput_by_replicas.get(facts.replicas, facts.breakdown.examples_per_s)
    if not fitting or now <= 0:
        return None
    best = max(fitting, key=lambda n: fitting[n])
    gain = fitting[best] / now
    if gain <= 1.0:
        return None
    unit = "physical cores" if facts.device_kind == "CPU" else "GPUs"
    return Advice(
        "fewer-replicas",
        "high",
        f"{facts.replicas} replicas share {facts.physical_devices} {unit}, so they compete "
        f"instead of adding compute. Use {best}: measured {fitting[best]:.0f} examples/s "
        f"against {now:.0f}, predicted {gain:.2f}x examples/s.",
        gain,
        {"replicas": best},
    )


def shared_compute_rule(facts: Facts) -> Advice | None:
    """Each replica's compute grew with the replica count although its work did not.

    On devices that share nothing, compute per update at a fixed per-replica batch stays flat
    as replicas are added; when it grows, the replicas are competing for something they
    share. The prediction is the step with the compute of the fewest replicas measured: what
    devices that do not share would give. No setting here buys it, so ``change`` is empty.
    """
    fewer = [n for n in facts.compute_by_replicas if n < facts.replicas]
    now = facts.compute_by_replicas.get(facts.replicas, facts.breakdown.compute_s)
    if not fewer or now <= 0:
        return None
    base_replicas = min(fewer)
    base = facts.compute_by_replicas[base_replicas]
    if base <= 0 or now / base < SHARED_COMPUTE_GROWTH:
        return None
    growth = now / base
    b = facts.breakdown
    gain = b.step_s / max(b.step_s - (now - base), 1e-12)
    measured = (
        f"Compute per update grew {growth:.2f}x from {base_replicas} to {facts.replicas} "
        f"replicas ({1e3 * base:.1f} -> {1e3 * now:.1f} ms) at the same per-replica batch, "
        "so the replicas compete for hardware they share instead of adding to it"
    )
    if facts.device_kind == "CPU":
        why = (
            f": logical CPU devices split {facts.physical_devices} physical cores, and one "
            "replica's ops already use every core through intra-op threads. Logical devices "
            "test multi-replica code; they add no compute. More speed needs more hardware "
            "(GPUs, or more hosts with `tfscale launch`)"
        )
    else:
        why = (
            ": GPUs that share nothing keep this flat, so they are waiting on the host (one "
            "process launches every replica's kernels) or on a shared link. Run more updates "
            "per call (steps_per_execution), compile the step (jit_compile=True), or give each "
            "replica a larger batch so that the host's fixed cost is spread over more work"
        )
    return Advice(
        "shared-compute",
        "high" if growth >= 1.5 else "medium",
        f"{measured}{why}. Devices that do not share would give {gain:.2f}x examples/s.",
        gain,
    )


def bf16_rule(facts: Facts) -> Advice | None:
    """float32 where the hardware has fast bfloat16 units."""
    if not facts.bf16_available or facts.precision != "float32":
        return None
    b = facts.breakdown
    saved = b.compute_s * (1 - 1 / BF16_COMPUTE_SPEEDUP)
    gain = b.step_s / (b.step_s - saved)
    return Advice(
        "bf16",
        "medium",
        f"float32 on hardware with bfloat16 matrix units: tfscale.fit(..., "
        f"mixed_precision='bf16'). Assuming {BF16_COMPUTE_SPEEDUP:g}x faster compute "
        f"(compute is {_percent(b.shares['compute'])} of the step), predicted {gain:.2f}x "
        "examples/s.",
        gain,
    )


def xla_rule(facts: Facts) -> Advice | None:
    """XLA off: compile the step."""
    if facts.jit_compile:
        return None
    b = facts.breakdown
    saved = b.compute_s * (1 - 1 / XLA_COMPUTE_SPEEDUP)
    gain = b.step_s / (b.step_s - saved) if b.step_s > saved else 1.0
    return Advice(
        "xla",
        "medium",
        "XLA is off (and jit_compile='auto' turns it off under a strategy): "
        "tfscale.fit(..., jit_compile=True). Assuming "
        f"{XLA_COMPUTE_SPEEDUP:g}x faster compute (compute is {_percent(b.shares['compute'])} "
        f"of the step), predicted {gain:.2f}x examples/s; --verify measures it.",
        gain,
        {"jit_compile": True},
    )


RULES: tuple[Callable[[Facts], Advice | None], ...] = (
    input_rule,
    accumulation_rule,
    batch_rule,
    compression_rule,
    replicas_rule,
    shared_compute_rule,
    bf16_rule,
    xla_rule,
)


def advise(facts: Facts) -> list[Advice]:
    """Every rule's advice for ``facts``, highest predicted speedup first."""
    fired = [advice for rule in RULES if (advice := rule(facts)) is not None]
    return sorted(fired, key=lambda a: a.predicted_speedup, reverse=True)
