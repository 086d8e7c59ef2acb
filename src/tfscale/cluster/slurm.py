"""The Slurm cluster source: a job step's tasks as a MultiWorkerMirrored cluster.

Inside ``srun``, every task derives its place from Slurm's variables (rank, task count, node
list, tasks per node); ``tfscale launch --slurm`` turns it into ``TF_CONFIG`` before starting
the script, and ``choose_strategy`` reads it directly when a script runs under ``srun``
without ``TF_CONFIG``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from tfscale.cluster.config import ClusterConfig
from tfscale.errors import ClusterConfigError, explain

__all__ = ["DEFAULT_SLURM_PORT", "SlurmSource", "cluster_from_slurm"]

#: First port on each node; the k-th task on a node listens on base + k (as TensorFlow's
#: SlurmClusterResolver does).
DEFAULT_SLURM_PORT = 8888
#: Job names of interactive allocations (``salloc``, ``srun --pty bash``): a shell, not a
#: job step of workers (Lightning's SLURMEnvironment makes the same exception).
_INTERACTIVE = ("bash", "interactive")


class SlurmSource:
    """Every task of the Slurm job step, one ``worker`` each (:func:`cluster_from_slurm`).

    Args:
        port_base: The first port on each node.
    """

    name = "Slurm"

    def __init__(self, port_base: int = DEFAULT_SLURM_PORT) -> None:
        self.port_base = port_base

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        """Inside a task started by ``srun`` (not an interactive shell allocation)."""
        return bool(env.get("SLURM_PROCID", "").strip()) and (
            env.get("SLURM_JOB_NAME", "") not in _INTERACTIVE
        )

    def resolve(self, env: Mapping[str, str]) -> ClusterConfig:
        """The cluster (see :func:`cluster_from_slurm`)."""
        return cluster_from_slurm(env, port_base=self.port_base)


#: Slurm variables read by :func:`cluster_from_slurm`, each with the job-wide fallback that
#: ``sbatch`` sets outside a job step.
_SLURM_FIELDS = {
    "ntasks": ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
    "nodelist": ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"),
    "tasks_per_node": ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
}
_SLURM_FIX = "run the script through `srun tfscale launch --slurm script.py` inside an allocation."


def _slurm_error(
    field_name: str, problem: str, received: object, allowed: str
) -> ClusterConfigError:
    return ClusterConfigError(
        explain(
            f"Slurm environment `{field_name}`: {problem}",
            received=received,
            allowed=allowed,
            fix=_SLURM_FIX,
        )
    )


def _slurm_get(env: Mapping[str, str], names: Sequence[str]) -> tuple[str, str]:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    raise _slurm_error(
        names[0],
        "the variable is not set.",
        "not set",
        f"set by srun inside a job step ({' or '.join(names)})",
    )


def _slurm_int(name: str, value: str, low: int) -> int:
    if not value.isdigit() or int(value) < low:
        raise _slurm_error(name, "expected an integer.", value, f"an integer >= {low}")
    return int(value)


def cluster_from_slurm(
    env: Mapping[str, str] | None = None, *, port_base: int = DEFAULT_SLURM_PORT
) -> ClusterConfig:
    """This Slurm task's place in a MultiWorkerMirrored cluster of every task of the job step.

    Tasks are numbered as Slurm's default block distribution places them: the first node of
    the node list holds tasks 0..k-1, and so on. The k-th task on a node listens on
    ``port_base + k``, as in TensorFlow's ``SlurmClusterResolver`` (which sorts host names
    alphabetically instead: the two agree whenever Slurm's node list is sorted, as it
    normally is).

    Args:
        env: The environment (``os.environ`` by default).
        port_base: The first port on each node.

    Returns:
        A cluster of ``worker`` tasks; this task is ``worker`` number ``SLURM_PROCID``.

    Raises:
        ClusterConfigError: A variable is missing or malformed, or the variables disagree
            (rank out of range, tasks per node not matching the node list or task count);
            the message names the variable.
    """
    from tfscale.cluster.hostlist import expand_hostlist, expand_tasks_per_node

    env = os.environ if env is None else env
    if not env.get("SLURM_PROCID", "").strip():
        raise _slurm_error(
            "SLURM_PROCID",
            "the variable is not set (not inside a Slurm task).",
            "not set",
            "set by srun for every task: 0 .. ntasks-1",
        )
    rank = _slurm_int("SLURM_PROCID", env["SLURM_PROCID"].strip(), 0)
    ntasks_name, ntasks_raw = _slurm_get(env, _SLURM_FIELDS["ntasks"])
    ntasks = _slurm_int(ntasks_name, ntasks_raw, 1)
    if rank >= ntasks:
        raise _slurm_error(
            "SLURM_PROCID",
            f"rank {rank} is out of range for {ntasks} tasks.",
            rank,
            f"0 to {ntasks - 1} ({ntasks_name}={ntasks})",
        )
    nodes_name, nodes_raw = _slurm_get(env, _SLURM_FIELDS["nodelist"])
    hosts = expand_hostlist(nodes_raw, field=nodes_name)
    if len(set(hosts)) != len(hosts):
        raise _slurm_error(nodes_name, "a node is listed twice.", nodes_raw, "each node once")
    per_node_name, per_node_raw = _slurm_get(env, _SLURM_FIELDS["tasks_per_node"])
    counts = expand_tasks_per_node(per_node_raw, field=per_node_name)
    if len(counts) != len(hosts):
        raise _slurm_error(
            per_node_name,
            f"{len(counts)} node count(s) for {len(hosts)} nodes.",
            f"{per_node_name}={per_node_raw!r}, {nodes_name}={nodes_raw!r}",
            "one count per node of the node list",
        )
    if sum(counts) != ntasks:
        raise _slurm_error(
            per_node_name,
            f"the counts add up to {sum(counts)}, not {ntasks}.",
            f"{per_node_name}={per_node_raw!r}, {ntasks_name}={ntasks}",
            f"counts that add up to {ntasks_name}",
        )
    if port_base < 1 or port_base + max(counts) - 1 > 65535:
        raise _slurm_error(
            "port_base", "the ports run outside 1..65535.", port_base, f"1 to {65536 - max(counts)}"
        )
    workers = [
        f"{host}:{port_base + k}" for host, n in zip(hosts, counts, strict=True) for k in range(n)
    ]
    return ClusterConfig({"worker": tuple(workers)}, "worker", rank, source="Slurm")
