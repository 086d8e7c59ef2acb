"""The strategy decision: small named rules over :class:`StrategyFacts`, no TensorFlow.

Rules, in order (each verdict becomes a sentence of ``Decision.reasons``):

0. A cluster with ``ps`` tasks, seen from its chief -> ParameterServerStrategy
   (``_parameter_server``; ported from the launch branch).
1. A cluster of several training tasks -> MultiWorkerMirroredStrategy (``_multi_worker``);
   NCCL when every worker has GPUs and NCCL exists, RING otherwise (``_cluster_collectives``).
2. Several local GPUs -> MirroredStrategy (``_default_local``), with the all-reduce from
   ``_collectives_for``.
3. Several logical CPU devices -> MirroredStrategy over them (ReductionToOneDevice).
4. Otherwise OneDeviceStrategy on the best device (GPU:0, else CPU:0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tfscale.cluster import ClusterConfig
from tfscale.devices.names import default_devices, select_devices
from tfscale.errors import ClusterConfigError, DeviceConfigError, StrategyError, explain
from tfscale.strategy.facts import StrategyFacts

__all__ = ["KINDS", "Decision", "decide"]

#: Strategy kinds ``choose_strategy`` can pick.
KINDS = ("OneDevice", "Mirrored", "MultiWorkerMirrored", "ParameterServer")


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` picked, before anything is built.

    Attributes:
        kind: One of :data:`KINDS`.
        devices: This process's devices, e.g. ``("/device:GPU:0", "/device:GPU:1")``.
        num_replicas: Replicas in sync across the whole cluster (workers x local devices).
        cross_device_ops: Short name of the all-reduce (``"NcclAllReduce"``,
            ``"HierarchicalCopyAllReduce"``, ``"ReductionToOneDevice"``, ``"NCCL"``,
            ``"RING"``), or None for one device.
        reasons: One sentence per rule that decided something, in order.
        cluster: The cluster for a multi-worker strategy, else None.
    """

    kind: str
    devices: tuple[str, ...]
    num_replicas: int
    cross_device_ops: str | None
    reasons: tuple[str, ...]
    cluster: ClusterConfig | None = None


def _select(facts: StrategyFacts, devices: Sequence[str] | None) -> tuple[str, ...] | None:
    """Validates ``devices=`` against the facts; None means "pick for me"."""
    if devices is None:
        return None
    return tuple(
        select_devices(
            devices,
            facts.all_devices,
            who="choose_strategy(devices=...)",
            fix="pass devices=None to use every device, or check `tfscale doctor` for "
            "why a GPU is missing.",
        )
    )


def _collectives_for(devices: Sequence[str], facts: StrategyFacts) -> tuple[str | None, str]:
    """The all-reduce for MirroredStrategy over ``devices``, and why."""
    if len(devices) < 2:
        return None, "One device: there is nothing to all-reduce."
    if any(not d.startswith("/device:GPU:") for d in devices):
        return "ReductionToOneDevice", (
            "Replicas include CPU devices, which NCCL cannot reach: gradients are summed "
            "on one device (ReductionToOneDevice)."
        )
    if len(facts.gpus) > facts.physical_gpus:
        return "ReductionToOneDevice", (
            f"{len(facts.gpus)} logical GPUs share {facts.physical_gpus} physical GPU(s); NCCL "
            "refuses two ranks on one GPU, so gradients are summed on one device "
            "(ReductionToOneDevice)."
        )
    if facts.nccl_available:
        return "NcclAllReduce", f"NCCL is available ({facts.platform}, CUDA build): NcclAllReduce."
    return "HierarchicalCopyAllReduce", (
        f"NCCL is not available on this platform/build ({facts.platform}): "
        "HierarchicalCopyAllReduce copies gradients between GPUs instead."
    )


def _default_local(facts: StrategyFacts) -> tuple[tuple[str, ...], str]:
    """The local devices to use when ``devices=None`` (every GPU, else every CPU), and why."""
    devices = tuple(default_devices(facts.all_devices)) or ("/device:CPU:0",)
    on_gpus = devices[0].startswith("/device:GPU:")
    if on_gpus and len(devices) >= 2:
        return devices, (
            f"{len(devices)} local GPUs: MirroredStrategy replicates the model on each."
        )
    if on_gpus:
        return devices, "One local GPU: OneDeviceStrategy on it (a GPU beats any CPU split)."
    if len(devices) >= 2:
        return devices, (
            f"No GPU; {len(devices)} logical CPU devices: MirroredStrategy over them "
            "(they share the CPU's cores, useful for testing multi-replica code)."
        )
    return devices, "No GPU and one CPU device: OneDeviceStrategy on the CPU."


def _local(facts: StrategyFacts, selected: tuple[str, ...] | None, reasons: list[str]) -> Decision:
    if selected is None:
        devices, why = _default_local(facts)
    else:
        devices = selected
        why = f"devices= restricts replicas to {', '.join(selected)}."
    reasons.append(why)
    ops, ops_why = _collectives_for(devices, facts)
    reasons.append(ops_why)
    kind = "Mirrored" if len(devices) >= 2 else "OneDevice"
    return Decision(kind, tuple(devices), len(devices), ops, tuple(reasons))


def _worker_kinds(
    facts: StrategyFacts, cluster: ClusterConfig, reasons: list[str]
) -> tuple[str, ...]:
    """Every worker's device kind: declared by the launcher, or assumed like this one."""
    own = "GPU" if facts.gpus else "CPU"
    declared = facts.worker_device_kinds
    if declared is None:
        reasons.append(
            f"TFSCALE_WORKER_DEVICE_KINDS is unset, so every worker is assumed to have {own} "
            "devices like this one (TF_CONFIG says nothing about other workers' devices)."
        )
        return (own,) * cluster.num_workers
    rank = cluster.worker_rank
    if rank is not None and declared[rank] != own:
        raise ClusterConfigError(
            explain(
                f"TFSCALE_WORKER_DEVICE_KINDS declares {declared[rank]} for this worker "
                f"(#{rank}, {cluster.address}) but it sees {own} devices only; workers "
                "would pick different collectives and hang.",
                received=f"TFSCALE_WORKER_DEVICE_KINDS={','.join(declared)}",
                allowed="the real device kind of each worker, chief first",
                fix="correct the variable, or run `tfscale doctor` on this host to see why "
                "its GPUs are not visible.",
            )
        )
    reasons.append(f"Workers declare devices {', '.join(declared)} (TFSCALE_WORKER_DEVICE_KINDS).")
    return declared


def _cluster_collectives(kinds: Sequence[str], facts: StrategyFacts) -> tuple[str, str]:
    """NCCL or RING for MultiWorkerMirroredStrategy, and why."""
    if all(k == "GPU" for k in kinds):
        if facts.nccl_available:
            return "NCCL", "Every worker has GPUs and NCCL is available: NCCL collectives."
        return "RING", (
            f"Every worker has GPUs but NCCL is not available ({facts.platform}): "
            "RING collectives over gRPC."
        )
    if any(k == "GPU" for k in kinds):
        return (
            "RING",
            "Workers mix CPU and GPU devices; NCCL needs GPUs everywhere: RING collectives.",
        )
    return "RING", "Workers have no GPU: RING collectives over gRPC."


def _multi_worker_devices(
    facts: StrategyFacts, selected: tuple[str, ...] | None, mixed: bool, reasons: list[str]
) -> tuple[str, ...]:
    """This worker's devices; MultiWorkerMirroredStrategy needs the same count on every worker."""
    if selected is not None:
        gpus = [d for d in selected if d.startswith("/device:GPU:")]
        prefix = tuple(f"/device:GPU:{i}" for i in range(len(gpus)))
        if tuple(gpus) != prefix or (not gpus and selected != ("/device:CPU:0",)):
            raise DeviceConfigError(
                explain(
                    "MultiWorkerMirroredStrategy uses the first k GPUs of each worker (or "
                    "its CPU); it cannot pick other devices.",
                    received=list(selected),
                    allowed="['/device:GPU:0', ..., '/device:GPU:k-1'] or ['/device:CPU:0']",
                    fix="restrict GPUs with CUDA_VISIBLE_DEVICES on each worker instead.",
                )
            )
        if mixed and len(prefix) > 1:
            raise DeviceConfigError(
                explain(
                    "In a cluster mixing CPU and GPU workers every worker holds one replica, "
                    "so a GPU worker can use one GPU only.",
                    received=list(selected),
                    allowed="['/device:GPU:0'] on GPU workers",
                    fix="pass devices=None, or give every worker GPUs.",
                )
            )
        return prefix or ("/device:CPU:0",)
    if not facts.gpus:
        return ("/device:CPU:0",)
    if mixed:
        reasons.append(
            "Mixed cluster: GPU workers use one GPU each so that every worker holds the same "
            "number of replicas as a CPU worker (MultiWorkerMirroredStrategy requires it)."
        )
        return facts.gpus[:1]
    return facts.gpus


def _multi_worker(
    facts: StrategyFacts,
    cluster: ClusterConfig,
    selected: tuple[str, ...] | None,
    reasons: list[str],
) -> Decision:
    reasons.append(
        f"{cluster.source} describes {cluster.num_workers} workers; this process is "
        f"{cluster.task_type} {cluster.task_index} ({cluster.address}): "
        "MultiWorkerMirroredStrategy."
    )
    kinds = _worker_kinds(facts, cluster, reasons)
    ops, why = _cluster_collectives(kinds, facts)
    reasons.append(why)
    mixed = len(set(kinds)) > 1
    devices = _multi_worker_devices(facts, selected, mixed, reasons)
    replicas = len(devices) * cluster.num_workers
    reasons.append(
        f"{cluster.num_workers} workers x {len(devices)} device(s) = {replicas} replicas."
    )
    return Decision("MultiWorkerMirrored", devices, replicas, ops, tuple(reasons), cluster)


def _parameter_server(facts: StrategyFacts, cluster: ClusterConfig, reasons: list[str]) -> Decision:
    """A cluster with ``ps`` tasks -> ParameterServerStrategy, decided on its chief.

    Only the chief runs the training script (it coordinates); the ``ps`` and ``worker``
    tasks run a ``tf.distribute.Server`` (``python -m tfscale.launch.server``) and receive
    their work from the chief's ClusterCoordinator.
    """
    types = sorted(cluster.cluster)
    if "chief" not in cluster.cluster or "worker" not in cluster.cluster:
        raise StrategyError(
            explain(
                "TF_CONFIG lists parameter servers, but ParameterServerStrategy also needs one "
                "'chief' task (the coordinator that runs the script) and 'worker' tasks.",
                received=f"cluster task types {types}",
                allowed="chief (1), worker (>= 1) and ps (>= 1) tasks",
                fix="add the chief and workers (tfscale launch --ps P -n N does), or drop 'ps' "
                "for MultiWorkerMirroredStrategy.",
            )
        )
    if cluster.task_type != "chief":
        raise StrategyError(
            explain(
                f"This process is task {cluster.task_type} {cluster.task_index} of a "
                "parameter-server cluster: only the chief runs the training script; ps and "
                "worker tasks serve it.",
                received=f"TF_CONFIG task {cluster.task_type!r} {cluster.task_index}",
                allowed="task type 'chief' for the script",
                fix="run `python -m tfscale.launch.server` on ps and worker tasks "
                "(tfscale launch --ps P -n N and its TFJob manifests do).",
            )
        )
    workers, ps = len(cluster.cluster["worker"]), cluster.num_ps
    reasons.append(
        f"TF_CONFIG has {ps} parameter server(s) and {workers} worker(s) and this process "
        "is the chief: ParameterServerStrategy, trained through a ClusterCoordinator."
    )
    local = facts.gpus or facts.cpus or ("/device:CPU:0",)
    return Decision("ParameterServer", (local[0],), 1, None, tuple(reasons), cluster)


def decide(facts: StrategyFacts, devices: Sequence[str] | None = None) -> Decision:
    """Picks a strategy for ``facts``; a pure function, nothing is built.

    Rules, in order (each verdict is appended to ``reasons``):

    0. A cluster with ``ps`` tasks, seen from its ``chief`` -> ParameterServerStrategy
       (:func:`_parameter_server`).
    1. A cluster of several training tasks -> MultiWorkerMirroredStrategy, NCCL when every
       worker has GPUs and NCCL exists, RING otherwise.
    2. Several local GPUs -> MirroredStrategy (NcclAllReduce where NCCL exists,
       HierarchicalCopyAllReduce otherwise, ReductionToOneDevice for logical GPUs sharing
       one physical GPU).
    3. Several logical CPU devices -> MirroredStrategy over them (ReductionToOneDevice).
    4. Otherwise OneDeviceStrategy on the best device (GPU:0, else CPU:0).

    Args:
        facts: From :func:`gather_facts` (or a fake in tests).
        devices: Restrict replicas to these device names (None: use every device).

    Returns:
        The decision.

    Raises:
        DeviceConfigError: ``devices`` names a device the facts do not list.
        ClusterConfigError: Declared worker device kinds contradict this worker's devices.
        StrategyError: The cluster has parameter servers but no chief, or this process is
            one of their ps/worker tasks (which run a server, not the script).
    """
    selected = _select(facts, devices)
    reasons: list[str] = []
    cluster = facts.cluster
    if cluster is not None and cluster.num_ps and cluster.task_type != "evaluator":
        return _parameter_server(facts, cluster, reasons)
    if cluster is not None and cluster.task_type == "evaluator":
        reasons.append(
            "This process is the evaluator: it runs beside the cluster on local devices."
        )
    elif cluster is not None and cluster.num_workers > 1:
        return _multi_worker(facts, cluster, selected, reasons)
    return _local(facts, selected, reasons)
