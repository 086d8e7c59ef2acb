"""The cluster model: :class:`ClusterConfig`, and ``TF_CONFIG`` parsed, validated and built.

This module imports no TensorFlow: the launcher uses it to write each worker's
``TF_CONFIG``, and ``choose_strategy`` reads the variable back through the cluster sources
(:mod:`tfscale.cluster.sources`). Every source of a cluster description (plain ``TF_CONFIG``,
Slurm, a Kubernetes TFJob) produces the same frozen :class:`ClusterConfig`, validated by
:func:`validate`.

A ``TF_CONFIG`` looks like::

    {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]},
     "task": {"type": "worker", "index": 0}}

Ordering of workers: the chief (if any) comes first, then the ``worker`` tasks in order;
this is the order of :attr:`ClusterConfig.workers` and of ``TFSCALE_WORKER_DEVICE_KINDS``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from tfscale.errors import ClusterConfigError, explain

__all__ = [
    "DEVICE_KINDS_ENV",
    "TASK_TYPES",
    "TF_CONFIG_ENV",
    "ClusterConfig",
    "fail",
    "parse_tf_config",
    "tf_config",
    "validate",
    "worker_device_kinds",
]

TF_CONFIG_ENV = "TF_CONFIG"
#: Set by the launcher: the device kind of every worker, chief first, e.g. ``"GPU,GPU,CPU"``
#: (or one kind for all). TF_CONFIG carries no device information about other workers.
DEVICE_KINDS_ENV = "TFSCALE_WORKER_DEVICE_KINDS"
#: Task types TensorFlow's cluster resolvers know. ``chief`` and ``worker`` train (they are
#: the "workers" of MultiWorkerMirroredStrategy), ``ps`` holds variables for
#: ParameterServerStrategy, ``evaluator`` runs beside the cluster, outside the all-reduce.
TASK_TYPES = ("chief", "worker", "ps", "evaluator")
_TRAINING_TYPES = ("chief", "worker")
_WORKER_KINDS = ("CPU", "GPU")
_EXAMPLE = (
    '{"cluster": {"worker": ["host0:2222", "host1:2222"]}, "task": {"type": "worker", "index": 0}}'
)


@dataclass(frozen=True)
class ClusterConfig:
    """A validated cluster and this process's place in it.

    Attributes:
        cluster: Task type -> addresses (``host:port``), read-only.
        task_type: This process's task type (``chief``, ``worker``, ``ps`` or ``evaluator``).
        task_index: This process's index among the tasks of ``task_type``.
        source: Where the description came from (``"TF_CONFIG"``, ``"arguments"``, ...).
    """

    cluster: Mapping[str, tuple[str, ...]]
    task_type: str
    task_index: int
    source: str = field(default=TF_CONFIG_ENV, compare=False)

    def __post_init__(self) -> None:
        frozen = MappingProxyType({k: tuple(v) for k, v in self.cluster.items()})
        object.__setattr__(self, "cluster", frozen)
        validate(self)

    @property
    def workers(self) -> tuple[str, ...]:
        """Addresses of the training tasks: the chief first (if any), then the workers."""
        return tuple(a for t in _TRAINING_TYPES for a in self.cluster.get(t, ()))

    @property
    def num_workers(self) -> int:
        """Number of training tasks (chief plus workers), as MultiWorkerMirroredStrategy counts."""
        return len(self.workers)

    @property
    def num_ps(self) -> int:
        """Number of parameter-server tasks."""
        return len(self.cluster.get("ps", ()))

    @property
    def worker_rank(self) -> int | None:
        """This task's position in :attr:`workers`, or None for a ``ps`` or ``evaluator`` task."""
        if self.task_type == "chief":
            return 0
        if self.task_type == "worker":
            return len(self.cluster.get("chief", ())) + self.task_index
        return None

    @property
    def is_chief(self) -> bool:
        """True for the task that saves checkpoints and writes summaries.

        That is the ``chief`` task, or worker 0 when the cluster has no chief (TensorFlow's
        ``multi_worker_util.is_chief`` rule).
        """
        if self.task_type == "chief":
            return True
        return self.task_type == "worker" and self.task_index == 0 and "chief" not in self.cluster

    @property
    def address(self) -> str | None:
        """This task's own ``host:port``, or None for an evaluator outside the cluster."""
        addresses = self.cluster.get(self.task_type, ())
        return addresses[self.task_index] if self.task_index < len(addresses) else None

    @property
    def is_multi_worker(self) -> bool:
        """True when more than one process trains together (or parameter servers exist)."""
        return self.num_workers > 1 or self.num_ps > 0

    def as_dict(self) -> dict[str, Any]:
        """The ``TF_CONFIG`` object for this task (plain dicts and lists)."""
        return {
            "cluster": {k: list(v) for k, v in self.cluster.items()},
            "task": {"type": self.task_type, "index": self.task_index},
        }

    def to_json(self) -> str:
        """The ``TF_CONFIG`` string for this task."""
        return json.dumps(self.as_dict(), sort_keys=True)


def fail(
    field_name: str, problem: str, received: object, allowed: str, fix: str
) -> ClusterConfigError:
    return ClusterConfigError(
        explain(
            f"TF_CONFIG field `{field_name}`: {problem}",
            received=repr(received),
            allowed=allowed,
            fix=fix,
        )
    )


def _check_address(field_name: str, address: object) -> None:
    allowed = "'host:port' with a port from 1 to 65535, e.g. '10.0.0.2:2222' or '[::1]:2222'"
    if not isinstance(address, str):
        raise fail(field_name, "an address must be a string.", address, allowed, "quote it.")
    host, sep, port = address.rpartition(":")
    if not sep or not host or host in ("[", "[]"):
        raise fail(field_name, "the address has no host:port.", address, allowed, "add the port.")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise fail(
            field_name, f"the port {port!r} is not valid.", address, allowed, "fix the port."
        )


def _check_cluster(cluster: Mapping[str, Any]) -> None:
    if not cluster:
        raise fail(
            "cluster",
            "the cluster is empty.",
            dict(cluster),
            "at least one task type",
            f"e.g. {_EXAMPLE}",
        )
    seen: dict[str, str] = {}
    for task_type, addresses in cluster.items():
        where = f"cluster.{task_type}"
        if task_type not in TASK_TYPES:
            raise fail(
                where,
                f"unknown task type {task_type!r}.",
                task_type,
                ", ".join(TASK_TYPES),
                "rename or remove it.",
            )
        if isinstance(addresses, str) or not isinstance(addresses, (list, tuple)) or not addresses:
            raise fail(
                where,
                "expected a non-empty list of addresses.",
                addresses,
                "a list like ['host0:2222', 'host1:2222']",
                f"e.g. {_EXAMPLE}",
            )
        if task_type == "chief" and len(addresses) != 1:
            raise fail(
                where,
                "a cluster has exactly one chief.",
                list(addresses),
                "one address",
                "list the other addresses under 'worker'.",
            )
        for index, address in enumerate(addresses):
            _check_address(f"{where}[{index}]", address)
            here = f"{where}[{index}]"
            if address in seen:
                raise fail(
                    here,
                    f"address {address!r} is also used by {seen[address]}.",
                    address,
                    "every task at its own host:port",
                    "give each task its own port.",
                )
            seen[address] = here


def _check_task(cluster: Mapping[str, Sequence[str]], task_type: object, index: object) -> None:
    if task_type not in TASK_TYPES:
        raise fail(
            "task.type",
            "unknown task type.",
            task_type,
            ", ".join(TASK_TYPES),
            "use one of the allowed types.",
        )
    assert isinstance(task_type, str)
    if task_type not in cluster and task_type != "evaluator":
        raise fail(
            "task.type",
            f"the cluster has no {task_type!r} tasks.",
            task_type,
            ", ".join(sorted(cluster)) + " (or 'evaluator')",
            "fix task.type or add the task type to cluster.",
        )
    if isinstance(index, bool) or not isinstance(index, int):
        raise fail(
            "task.index",
            "the index must be an integer.",
            index,
            "an int, e.g. 0",
            'write "index": 0 (no quotes).',
        )
    size = len(cluster.get(task_type, ())) or 1  # an evaluator outside the cluster is task 0
    if not 0 <= index < size:
        raise fail(
            "task.index",
            f"out of range for the {size} {task_type!r} task(s).",
            index,
            f"0 to {size - 1}",
            f"use this process's position in cluster.{task_type}.",
        )


def validate(config: ClusterConfig) -> None:
    """Checks a cluster and task the way every source must satisfy.

    Raises:
        ClusterConfigError: A malformed address, duplicate address, unknown or absent task
            type, or an index out of range, naming the field and the value received.
    """
    _check_cluster(config.cluster)
    _check_task(config.cluster, config.task_type, config.task_index)


def parse_tf_config(raw: str) -> ClusterConfig:
    """Parses and validates a ``TF_CONFIG`` string.

    Args:
        raw: The JSON text of the variable.

    Returns:
        The cluster and this process's task.

    Raises:
        ClusterConfigError: The text is not a JSON object with valid ``cluster`` and
            ``task`` fields; the message names the field and the value received.
    """
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as error:
        shown = raw if len(raw) <= 200 else raw[:200] + "..."
        raise ClusterConfigError(
            explain(
                f"TF_CONFIG is not valid JSON ({error.msg} at character {error.pos}).",
                received=shown,
                allowed="a JSON object",
                fix=f"e.g. {_EXAMPLE}",
            )
        ) from None
    if not isinstance(data, dict):
        raise fail(
            "TF_CONFIG",
            "expected a JSON object.",
            data,
            "an object with 'cluster' and 'task'",
            f"e.g. {_EXAMPLE}",
        )
    for key in ("cluster", "task"):
        if key not in data:
            raise fail(
                key,
                "the field is missing.",
                sorted(data),
                "an object with 'cluster' and 'task'",
                f"e.g. {_EXAMPLE}",
            )
        if not isinstance(data[key], dict):
            raise fail(key, "expected a JSON object.", data[key], "an object", f"e.g. {_EXAMPLE}")
    cluster, task = data["cluster"], data["task"]
    for key in ("type", "index"):
        if key not in task:
            raise fail(
                f"task.{key}",
                "the field is missing.",
                task,
                '{"type": "worker", "index": 0}',
                f"add task.{key}.",
            )
    _check_cluster(cluster)
    _check_task(cluster, task["type"], task["index"])
    return ClusterConfig(cluster, task["type"], task["index"])


def worker_device_kinds(
    config: ClusterConfig, env: Mapping[str, str] | None = None
) -> tuple[str, ...] | None:
    """Every worker's device kind (``"GPU"``/``"CPU"``), from ``TFSCALE_WORKER_DEVICE_KINDS``.

    Args:
        config: The cluster; gives the number of workers (chief first).
        env: The environment to read (``os.environ`` by default).

    Returns:
        One kind per worker in :attr:`ClusterConfig.workers` order, or None when the
        variable is unset (callers then assume every worker resembles this one).

    Raises:
        ClusterConfigError: A kind other than CPU/GPU, or a count that is neither 1 nor the
            number of workers.
    """
    env = os.environ if env is None else env
    raw = env.get(DEVICE_KINDS_ENV, "").strip()
    if not raw:
        return None
    kinds = tuple(k.strip().upper() for k in raw.split(","))
    allowed = f"{', '.join(_WORKER_KINDS)}, one for all workers or one per worker (chief first)"
    bad = [k for k in kinds if k not in _WORKER_KINDS]
    if bad or len(kinds) not in (1, config.num_workers):
        raise ClusterConfigError(
            explain(
                f"{DEVICE_KINDS_ENV} does not describe the {config.num_workers} workers.",
                received=f"{DEVICE_KINDS_ENV}={raw!r}",
                allowed=allowed,
                fix=f"e.g. {DEVICE_KINDS_ENV}=" + ",".join(["GPU"] * config.num_workers),
            )
        )
    return kinds * config.num_workers if len(kinds) == 1 else kinds


def tf_config(
    workers: Sequence[str],
    task_index: int,
    *,
    task_type: str = "worker",
    chief: str | None = None,
    ps: Sequence[str] = (),
) -> str:
    """Builds a validated ``TF_CONFIG`` string for one task.

    Args:
        workers: Addresses (``host:port``) of the ``worker`` tasks.
        task_index: This task's index among the tasks of ``task_type``.
        task_type: This task's type.
        chief: Address of a separate chief task, if any.
        ps: Addresses of parameter-server tasks.

    Returns:
        JSON text for the ``TF_CONFIG`` environment variable.

    Raises:
        ClusterConfigError: The result would be malformed (see :func:`parse_tf_config`).
    """
    cluster: dict[str, list[str]] = {}
    if chief is not None:
        cluster["chief"] = [chief]
    if workers:
        cluster["worker"] = list(workers)
    if ps:
        cluster["ps"] = list(ps)
    raw = json.dumps({"cluster": cluster, "task": {"type": task_type, "index": task_index}})
    return parse_tf_config(raw).to_json()
