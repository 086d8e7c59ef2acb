"""Building the ``tf.distribute`` strategy a :class:`Decision` names, and its preparations.

Everything here touches TensorFlow's runtime; the decision itself is made in ``rules.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import tensorflow as tf

from tfscale.cluster import ClusterConfig
from tfscale.errors import StrategyError, explain
from tfscale.interop.internals import (
    broadcast_any_initial_value,
    context_initialized,
    context_started,
    coordination_config_pb2,
    eager_context,
    forget_collective_setup,
)
from tfscale.strategy.rules import Decision

__all__ = [
    "DEFAULT_START_TIMEOUT_S",
    "START_TIMEOUT_ENV",
    "apply_memory_growth",
    "build_strategy",
    "enable_memory_growth",
    "first_line",
    "forget_failed_cluster",
    "remedy",
    "start_timeout_s",
]

#: Seconds every worker of a cluster gets to start before MultiWorkerMirroredStrategy fails.
START_TIMEOUT_ENV = "TFSCALE_WORKER_START_TIMEOUT"
DEFAULT_START_TIMEOUT_S = 300.0


def apply_memory_growth(
    gpus: Iterable[Any], setter: Callable[[Any, bool], None]
) -> tuple[str, ...]:
    """Turns on memory growth per GPU; says which GPUs could not be changed and why."""
    late: list[str] = []
    virtual: list[str] = []
    done = 0
    for gpu in gpus:
        try:
            setter(gpu, True)
            done += 1
        except RuntimeError:
            late.append(gpu.name)
        except ValueError:
            virtual.append(gpu.name)
    reasons = []
    if done:
        reasons.append(f"Memory growth is on for {done} GPU(s): each takes memory as it needs it.")
    if late:
        reasons.append(
            f"Memory growth could not be turned on for {', '.join(late)}: TensorFlow's runtime "
            "had already started. Call choose_strategy() first, or set "
            "TF_FORCE_GPU_ALLOW_GROWTH=true before starting Python."
        )
    if virtual:
        reasons.append(
            f"Memory growth left off for {', '.join(virtual)}: it has logical devices with "
            "memory limits, which replace growth."
        )
    return tuple(reasons)


def enable_memory_growth(enabled: bool) -> tuple[str, ...]:
    """Turns on (or leaves off) memory growth on every physical GPU; returns the reasons."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return ()
    if not enabled:
        return ("memory_growth=False: TensorFlow reserves most of each GPU's memory at start-up.",)
    return apply_memory_growth(gpus, tf.config.experimental.set_memory_growth)


def _cross_device_ops(name: str | None) -> Any:
    factories: dict[str, Callable[[], Any]] = {
        "NcclAllReduce": tf.distribute.NcclAllReduce,
        "HierarchicalCopyAllReduce": tf.distribute.HierarchicalCopyAllReduce,
        "ReductionToOneDevice": tf.distribute.ReductionToOneDevice,
    }
    return factories[name]() if name else None


def start_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """The worker start-up deadline from ``TFSCALE_WORKER_START_TIMEOUT`` (default 300 s).

    Raises:
        StrategyError: The variable is not a positive number.
    """
    raw = (os.environ if env is None else env).get(START_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_START_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise StrategyError(
            explain(
                f"{START_TIMEOUT_ENV} must be a positive number of seconds.",
                received=f"{START_TIMEOUT_ENV}={raw!r}",
                allowed="a number > 0",
                fix=f"export {START_TIMEOUT_ENV}=300",
            )
        )
    return value


def _bound_worker_start(cluster: ClusterConfig, timeout_s: float) -> None:
    """Makes MultiWorkerMirroredStrategy fail after ``timeout_s`` if a worker never starts.

    Workaround (TF 2.21, reproduced): MultiWorkerMirroredStrategy configures the
    coordination service without a registration deadline, so the first worker waits for a
    peer that never starts with no end in sight (a launch typo becomes a silent hang).
    Configuring the same service first, with a deadline and the registration barrier on
    every task, makes construction raise DeadlineExceededError instead; the strategy then
    keeps this configuration (it only configures one when none exists).
    """
    coordination = coordination_config_pb2()
    ctx = eager_context()  # private: the public API has no deadline
    if context_started(ctx) or ctx.coordination_service:
        return  # too late (the build will say so), or someone configured it already
    jobs = [
        coordination.CoordinatedJob(name=job, num_tasks=len(cluster.cluster[job]))
        for job in ("chief", "worker")
        if job in cluster.cluster
    ]
    leader = "chief" if "chief" in cluster.cluster else "worker"
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=f"/job:{leader}/replica:0/task:0",
        coordinated_jobs=jobs,
        cluster_register_timeout_in_ms=int(timeout_s * 1000),
    )
    ctx.coordination_service.cluster_register_with_barrier = True


def build_strategy(decision: Decision, *, start_timeout: float = DEFAULT_START_TIMEOUT_S) -> Any:
    """Constructs the ``tf.distribute.Strategy`` a decision names.

    Args:
        decision: From :func:`tfscale.strategy.decide`.
        start_timeout: Seconds every worker of a cluster gets to start.

    Returns:
        The strategy.
    """
    if decision.kind == "OneDevice":
        return tf.distribute.OneDeviceStrategy(decision.devices[0])
    if decision.kind == "Mirrored":
        return tf.distribute.MirroredStrategy(
            devices=list(decision.devices),
            cross_device_ops=_cross_device_ops(decision.cross_device_ops),
        )
    cluster = decision.cluster
    if decision.kind == "ParameterServer" and cluster is not None:
        # A resolver built from the validated ClusterConfig, as for MultiWorkerMirrored.
        return tf.distribute.ParameterServerStrategy(
            tf.distribute.cluster_resolver.SimpleClusterResolver(
                tf.train.ClusterSpec({k: list(v) for k, v in cluster.cluster.items()}),
                task_type=cluster.task_type,
                task_id=cluster.task_index,
                rpc_layer="grpc",
            )
        )
    assert cluster is not None and decision.cross_device_ops is not None
    gpus = sum(d.startswith("/device:GPU:") for d in decision.devices)
    # A resolver built from the validated ClusterConfig, so that clusters from any source
    # (TF_CONFIG, Slurm, Kubernetes) build alike and num_accelerators caps the GPUs used.
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({k: list(v) for k, v in cluster.cluster.items() if k != "evaluator"}),
        task_type=cluster.task_type,
        task_id=cluster.task_index,
        num_accelerators={"GPU": gpus},
        rpc_layer="grpc",
    )
    if cluster.task_type in ("chief", "worker"):
        _bound_worker_start(cluster, start_timeout)
    implementation = getattr(
        tf.distribute.experimental.CommunicationImplementation, decision.cross_device_ops
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        cluster_resolver=resolver,
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=implementation
        ),
    )
    # A bfloat16 or int8 model built in its scope: its initial values carried exactly.
    broadcast_any_initial_value(strategy)
    return strategy


def first_line(error: BaseException) -> str:
    """``"TypeName: first line of the message"``."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def remedy(error: BaseException) -> str:
    """What to do about the usual reasons a strategy cannot be built."""
    text = str(error)
    if "program startup" in text:
        return (
            " MultiWorkerMirroredStrategy must be built before any TensorFlow op runs: "
            "call choose_strategy() first in the program."
        )
    if "Wait_for_all_tasks_to_register" in text or "RegisterTask" in text:
        return (
            " Not every worker of TF_CONFIG started in time: start them all (tfscale launch does),"
            f" check their addresses, or raise {START_TIMEOUT_ENV}."
        )
    if "gRPC server" in text:
        return " This worker's port is taken or unreachable: check TF_CONFIG's address for it."
    return ""


def forget_failed_cluster() -> None:
    """Lets the eager context start as a single process after MWMS failed to start.

    Workaround (TF 2.21, reproduced in tests/test_strategy.py): when
    MultiWorkerMirroredStrategy cannot start its gRPC server, ``TFE_EnableCollectiveOps``
    raises inside ``Context.ensure_initialized`` but the context keeps the collective-ops
    server definition and coordination config, so every later op retries the same server
    and fails ("Could not start gRPC server"): no fallback strategy could run. Clearing them
    (private attributes, only while the context is still uninitialized) restores a plain
    local runtime.
    """
    ctx = eager_context()  # private: no public way to undo it
    if context_initialized(ctx):
        return
    forget_collective_setup(ctx)
