"""Projecting a measured step to replica counts this machine does not have: the α-β model.

An all-reduce of ``S`` bytes over ``n`` ranks costs, in the α-β (latency-bandwidth) model
of Hockney, as analysed for MPI collectives by Thakur, Rabenseifner and Gropp (2005):

- ring: ``2 (n-1) α + 2 (n-1)/n · S / B`` (reduce-scatter then all-gather, each rank
  sending ``S/n`` per step; the bandwidth term barely grows with ``n``, the latency term
  does);
- hierarchical (``g`` ranks per node, ``m = n/g`` nodes; what NCCL and Horovod do across
  nodes): a reduce-scatter inside each node, a ring all-reduce of each ``S/g`` shard across
  the nodes, an all-gather inside each node:
  ``2 (g-1) α_in + 2 (g-1)/g · S / B_in + 2 (m-1) α_out + 2 (m-1)/m · (S/g) / B_out``.

A projected step is the measured local step (forward, backward and update of one replica at
the same per-replica batch: weak scaling) plus the all-reduce of the gradients, not
overlapped (tfscale's packed all-reduce runs after the backward pass; bucketing can hide part
of it, so the projection is then pessimistic). Everything here is pure: the numbers come in,
the rows go out, and ``tests/profiling/test_projection.py`` checks them by hand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tfscale.errors import ProfileError, explain

__all__ = [
    "INTERCONNECTS",
    "Interconnect",
    "Projection",
    "assumptions",
    "check_links",
    "fit_alpha_beta",
    "hierarchical_allreduce_s",
    "interconnect",
    "project",
    "ring_allreduce_s",
]


@dataclass(frozen=True)
class Interconnect:
    """A link an all-reduce crosses, as the α-β model sees it.

    Attributes:
        name: The preset's name (``"ethernet-25g"``).
        bandwidth: Bytes per second one rank can send (the nominal line rate).
        latency: Seconds of fixed cost per message (α).
        note: What it is and where the figures come from.
    """

    name: str
    bandwidth: float
    latency: float
    note: str


_GB = 1e9
#: Nominal per-direction line rates (vendor specifications) and typical small-message
#: latencies. Nominal: a real all-reduce reaches less, so projections are optimistic, and
#: docs/profiling.md measures by how much against published runs.
INTERCONNECTS: dict[str, Interconnect] = {
    i.name: i
    for i in (
        Interconnect("ethernet-10g", 1.25 * _GB, 30e-6, "10 Gb/s Ethernet, TCP"),
        Interconnect("ethernet-25g", 3.125 * _GB, 25e-6, "25 Gb/s Ethernet, TCP"),
        Interconnect("roce-25g", 3.125 * _GB, 5e-6, "25 Gb/s Ethernet with RDMA (RoCE)"),
        Interconnect("ethernet-100g", 12.5 * _GB, 20e-6, "100 Gb/s Ethernet, TCP"),
        Interconnect("ib-edr", 12.5 * _GB, 2e-6, "InfiniBand EDR, 100 Gb/s"),
        Interconnect("ib-hdr", 25 * _GB, 2e-6, "InfiniBand HDR, 200 Gb/s"),
        Interconnect("ib-ndr", 50 * _GB, 2e-6, "InfiniBand NDR, 400 Gb/s"),
        Interconnect("pcie3", 16 * _GB, 5e-6, "PCIe 3.0 x16 between GPUs of a node"),
        Interconnect("pcie4", 32 * _GB, 5e-6, "PCIe 4.0 x16 between GPUs of a node"),
        Interconnect("nvlink1", 20 * _GB, 5e-6, "NVLink 1 (P100 SXM2), one link"),
        Interconnect("nvlink2", 25 * _GB, 5e-6, "NVLink 2 (V100 SXM2), one link"),
        Interconnect("nvlink3", 300 * _GB, 5e-6, "NVLink 3 (A100), all 12 links"),
        Interconnect("nvlink4", 450 * _GB, 5e-6, "NVLink 4 (H100), all 18 links"),
    )
}


def interconnect(name: str) -> Interconnect:
    """The preset called ``name``.

    Raises:
        ProfileError: No such preset (the message lists them).
    """
    if name not in INTERCONNECTS:
        raise ProfileError(
            explain(
                "Unknown interconnect.",
                received=name,
                allowed=", ".join(INTERCONNECTS),
                fix="--interconnect ethernet-25g (between nodes), --intra nvlink4 (inside one)",
            )
        )
    return INTERCONNECTS[name]


def ring_allreduce_s(size_bytes: float, ranks: int, link: Interconnect) -> float:
    """Seconds of a ring all-reduce of ``size_bytes`` over ``ranks`` ranks on ``link``."""
    if ranks <= 1:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * link.latency + steps / ranks * size_bytes / link.bandwidth


def hierarchical_allreduce_s(
    size_bytes: float, ranks: int, per_node: int, intra: Interconnect, inter: Interconnect
) -> float:
    """Seconds of a two-level all-reduce: ``per_node`` ranks share ``intra``, nodes ``inter``.

    With ``ranks <= per_node`` everything stays inside one node (a ring on ``intra``).
    """
    if ranks <= per_node:
        return ring_allreduce_s(size_bytes, ranks, intra)
    nodes = math.ceil(ranks / per_node)
    inside = ring_allreduce_s(size_bytes, per_node, intra)  # reduce-scatter + all-gather
    return inside + ring_allreduce_s(size_bytes / per_node, nodes, inter)


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``seconds ~ α + β · bytes`` over measured all-reduces.

    Returns:
        ``(α seconds, β seconds per byte)``, each at least 0 (a negative intercept from
        noise is clamped and β refitted through the origin).

    Raises:
        ProfileError: Fewer than two distinct sizes.
    """
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ProfileError(
            explain(
                "Fitting the α-β model needs all-reduces of at least two different sizes.",
                received=list(sizes),
            )
        )
    n = len(sizes)
    mean_x, mean_y = sum(sizes) / n, sum(seconds) / n
    sxx = sum((x - mean_x) ** 2 for x in sizes)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds, strict=True))
    beta = max(sxy / sxx, 0.0)
    alpha = mean_y - beta * mean_x
    if alpha < 0:
        alpha = 0.0
        beta = sum(x * y for x, y in zip(sizes, seconds, strict=True)) / sum(x * x for x in sizes)
    return alpha, beta


@dataclass(frozen=True)
class Projection:
    """One projected configuration (weak scaling: the same batch per replica).

    Attributes:
        replicas: Ranks of the projected all-reduce.
        step_s: Local step plus all-reduce.
        allreduce_s: The all-reduce of the gradients.
        examples_per_s: ``replicas · batch_per_replica / step_s``.
        efficiency: ``local_step_s / step_s`` (1 replica's throughput per replica).
    """

    replicas: int
    step_s: float
    allreduce_s: float
    examples_per_s: float
    efficiency: float


def check_links(per_node: int, intra: Interconnect | None) -> None:
    """Several replicas per node need the link inside the node (pure; ``tfscale bench``
    calls it before measuring, :func:`project` before projecting).

    Raises:
        ProfileError: ``per_node > 1`` without ``intra``.
    """
    if per_node > 1 and intra is None:
        raise ProfileError(
            explain(
                "Several replicas per node need the link inside the node.",
                received=f"--gpus-per-node {per_node} without --intra",
                allowed=", ".join(INTERCONNECTS),
                fix=f"--intra nvlink4 (or pcie4) --gpus-per-node {per_node}",
            )
        )


def project(
    *,
    local_step_s: float,
    gradient_bytes: float,
    batch_per_replica: int,
    replicas: Sequence[int],
    inter: Interconnect,
    intra: Interconnect | None = None,
    per_node: int = 1,
    compression: float = 1.0,
) -> list[Projection]:
    """Projects a measured local step to ``replicas`` ranks.

    Args:
        local_step_s: One replica's step without communication (measured).
        gradient_bytes: Bytes all-reduced per update (float32 gradients).
        batch_per_replica: Examples per replica per step.
        replicas: Replica counts to project.
        inter: The link between nodes.
        intra: The link inside a node (with ``per_node > 1``).
        per_node: Replicas per node (8 for an 8-GPU server).
        compression: Bytes factor of the all-reduce (0.5 for bf16/fp16 compression).

    Returns:
        One :class:`Projection` per replica count, in order.

    Raises:
        ProfileError: A count below 1, a non-positive step, or ``per_node > 1`` without
            ``intra``.
    """
    if local_step_s <= 0 or gradient_bytes < 0 or batch_per_replica < 1:
        raise ProfileError(
            explain(
                "Projection needs a measured local step, the gradient bytes and the batch.",
                received=f"local_step_s={local_step_s}, gradient_bytes={gradient_bytes}, "
                f"batch_per_replica={batch_per_replica}",
            )
        )
    if not replicas or min(replicas) < 1 or per_node < 1:
        raise ProfileError(
            explain(
                "Projected replica counts and replicas per node must be >= 1.",
                received=f"replicas={list(replicas)}, per_node={per_node}",
                fix="--project 8,64,512 --gpus-per-node 8",
            )
        )
    check_links(per_node, intra)
    size = gradient_bytes * compression
    rows = []
    for n in replicas:
        if per_node > 1 and intra is not None:
            allreduce = hierarchical_allreduce_s(size, n, per_node, intra, inter)
        else:
            allreduce = ring_allreduce_s(size, n, inter)
        step = local_step_s + allreduce
        rows.append(
            Projection(n, step, allreduce, n * batch_per_replica / step, local_step_s / step)
        )
    return rows


def assumptions(
    *,
    local_step_s: float,
    gradient_bytes: float,
    inter: Interconnect,
    intra: Interconnect | None,
    per_node: int,
    compression: float,
) -> dict[str, Any]:
    """What a projection assumed, for the report."""
    return {
        "model": "hierarchical all-reduce (reduce-scatter in node, ring across nodes, "
        "all-gather in node)"
        if per_node > 1
        else "ring all-reduce",
        "local_step_ms": local_step_s * 1e3,
        "gradient_bytes": gradient_bytes,
        "compression": compression,
        "inter": asdict(inter),
        "intra": asdict(intra) if intra is not None else None,
        "replicas_per_node": per_node,
        "overlap": "none: the all-reduce follows the backward pass (packed)",
        "scaling": "weak: the measured batch per replica on every replica",
    }
