"""The plan beside the measured peak, for ``bench`` and ``profile`` reports: measured on a
step, recorded as JSON, written as a Markdown table and drawn per device (matplotlib).

Logical CPU devices share one allocator (``measure.py``): their measured peak is compared
with the plan summed over them; each GPU's with its own row.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

from tfscale.training.memory.measure import MeasuredPeak, cpu_bfc_enabled, measured_peaks
from tfscale.training.memory.plan import COMPONENTS, MemoryPlan

__all__ = ["measure_memory", "memory_lines", "memory_plot", "memory_record", "planned_for"]

_COLOURS = {
    "weights": "#3b7dd8",
    "optimizer": "#7a5cc7",
    "gradients": "#d64545",
    "activations": "#e4a11b",
    "input": "#8c8c8c",
    "all_reduce": "#2e9e6a",
    "workspace": "#b5651d",
    "accumulators": "#5bc0de",
}
_NO_CPU_MEASURE = (
    "The CPU allocator reports no bytes unless TF_CPU_ALLOCATOR_USE_BFC=true is set before "
    "TensorFlow starts: the plan is shown without a measured peak."
)


def memory_record(plan: MemoryPlan, peaks: Sequence[MeasuredPeak]) -> dict[str, Any]:
    """The plan and each allocator's measured peak with the plan's bytes for its devices."""
    rows = {d.device: d.peak for d in plan.devices}
    measured = []
    for peak in peaks:
        planned = sum(rows.get(device, 0) for device in peak.devices)
        measured.append(
            {
                "devices": list(peak.devices),
                "peak_bytes": peak.peak_bytes,
                "start_bytes": peak.start_bytes,
                "planned_bytes": planned,
                "planned_over_measured": planned / peak.peak_bytes if peak.peak_bytes else None,
            }
        )
    record: dict[str, Any] = {"plan": plan.to_record(), "measured": measured}
    if not peaks and any(":CPU:" in d.device for d in plan.devices) and not cpu_bfc_enabled():
        record["note"] = _NO_CPU_MEASURE
    return record


def measure_memory(step: Any, devices: Sequence[str], *, steps: int) -> dict[str, Any]:
    """Plans ``step``'s memory (a ``MeasuredStep``) before it runs, then reads the
    allocators' peak over ``steps`` of its updates after ``steps`` more of warm-up (the
    first traces the step and builds the optimizer)."""
    from tfscale.training.memory import plan_memory

    plan = plan_memory(
        step.model,
        step.batch_per_replica,
        strategy=step.strategy,
        accumulation_steps=step.accumulation,
    )
    for _ in range(steps):
        step.with_reduce()
    gc.collect()  # earlier configurations' models, left to the collector, hold bytes
    with measured_peaks(devices) as peaks:
        for _ in range(steps):
            step.with_reduce()
    return memory_record(plan, peaks)


def planned_for(
    model: Any, batch_per_replica: int
) -> tuple[MemoryPlan, list[str], list[int]] | None:
    """For ``tfscale profile``'s callback: the plan of ``model``'s step before it runs and the
    devices whose allocators to read, or None where no plan can be made (a model whose
    inputs are unknown: the report then has no memory section)."""
    from tfscale.training.memory import plan_memory

    if batch_per_replica < 1:
        return None
    try:
        plan = plan_memory(model, batch_per_replica)
    except Exception:  # a profile measures speed first: a model the plan cannot trace
        return None
    return plan, [d.device for d in plan.devices], []


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f}"


def memory_lines(points: Sequence[Any]) -> list[str]:
    """The Markdown section: per configuration, each allocator's planned and measured peak."""
    rows = []
    notes = set()
    for point in points:
        memory = point.memory
        if not memory:
            continue
        label = f"{point.mode} {point.replicas} x {point.batch_per_replica}"
        plan = memory["plan"]
        if memory.get("note"):
            notes.add(memory["note"])
        if not memory["measured"]:
            rows.append([label, "all", _mib(plan["total_peak_bytes"]), "-", "-", "-"])
        for measured in memory["measured"]:
            ratio = measured["planned_over_measured"]
            rows.append(
                [
                    label,
                    " + ".join(d.replace("/device:", "") for d in measured["devices"]),
                    _mib(measured["planned_bytes"]),
                    _mib(measured["peak_bytes"]),
                    _mib(measured["start_bytes"]),
                    "-" if ratio is None else f"{ratio:.2f}",
                ]
            )
    if not rows:
        return []
    header = [
        "configuration",
        "devices",
        "planned peak MiB",
        "measured peak MiB",
        "held before MiB",
        "planned / measured",
    ]
    lines = ["", "## Memory: planned and measured peak", ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    notes.add(
        "held before: what the allocator held as the measured steps began (variables, the "
        "input's data); a model of a few MiB is planned low beside the runtime's own bytes."
    )
    return lines + [f"- {n}" for n in sorted(notes)]


def memory_plot(memory: dict[str, Any], title: str) -> Any:
    """One figure: each device's planned components stacked, and each allocator's measured
    peak beside the plan's bytes for its devices (several logical CPUs: one shared bar)."""
    import matplotlib.pyplot as plt

    devices = memory["plan"]["devices"]
    per_device = {
        d["device"].replace("/device:", ""): {c: d[f"{c}_bytes"] / 2**20 for c in COMPONENTS}
        for d in devices
    }
    labels = list(per_device)
    stacks = list(per_device.values())
    for m in memory["measured"]:
        names = [d.replace("/device:", "") for d in m["devices"]]
        if len(names) > 1:  # a shared allocator: the plan summed over its devices
            labels.append(" + ".join(names))
            stacks.append({c: sum(per_device[n][c] for n in names) for c in COMPONENTS})
    figure, axis = plt.subplots(figsize=(6.4, 3.8))
    bottom = [0.0] * len(labels)
    for component in COMPONENTS:
        values = [s[component] for s in stacks]
        if not any(values):
            continue
        axis.bar(labels, values, bottom=bottom, label=component, color=_COLOURS[component])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for m in memory["measured"]:
        names = [d.replace("/device:", "") for d in m["devices"]]
        index = labels.index(" + ".join(names)) if len(names) > 1 else labels.index(names[0])
        axis.plot(
            [index - 0.4, index + 0.4],
            [m["peak_bytes"] / 2**20] * 2,
            color="black",
            linewidth=2.5,
            label="measured peak" if m is memory["measured"][0] else None,
        )
    axis.set_ylabel("MiB")
    axis.set_title(title)
    axis.legend(fontsize=7, loc="upper left")
    return figure
