"""Helpers for tests of multi-device code: fresh processes, bounded waits, tolerances.

TensorFlow fixes its devices once per process, so a test that needs another device layout,
a fresh runtime or several workers runs Python code in a child process here (through
:mod:`tfscale.processes`, like every child tfscale starts). Every child has a timeout, is
killed with its whole process group when it runs over, and dies with the test process.
"""

from __future__ import annotations

import gc
import os
import sys
import textwrap
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tfscale.processes import Completed, TimeoutExpired, run

__all__ = [
    "alive",
    "child_pids",
    "descendants",
    "graphs_left_alive",
    "graphs_traced_by",
    "groups_alive",
    "in_process_parameter_servers",
    "live_graphs",
    "mirrored_on_cpus",
    "paired_ratios",
    "relative_difference",
    "run_python",
]


def run_python(
    code: str,
    *,
    virtual_devices: int | None = None,
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
    timeout: float = 180.0,
    cwd: str | None = None,
) -> Completed:
    """Runs ``code`` in a fresh Python process and returns its result.

    Args:
        code: Python source; dedented before it runs.
        virtual_devices: If given, ``TFSCALE_VIRTUAL_DEVICES`` for the child.
        env: Extra environment variables (a value of ``""`` removes the variable).
        args: Command-line arguments for the child (``sys.argv[1:]``).
        timeout: Seconds before the child and its process group are killed.
        cwd: Working directory of the child.

    Returns:
        The exit code with text stdout and stderr.

    Raises:
        subprocess.TimeoutExpired: The child ran past ``timeout`` (it has been killed).
    """
    child_env = dict(os.environ)
    child_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    child_env.pop("TF_CONFIG", None)
    if virtual_devices is not None:
        child_env["TFSCALE_VIRTUAL_DEVICES"] = str(virtual_devices)
    for key, value in (env or {}).items():
        if value == "":
            child_env.pop(key, None)
        else:
            child_env[key] = value
    argv = [sys.executable, "-c", textwrap.dedent(code), *args]
    done = run(argv, timeout=timeout, env=child_env, cwd=cwd)
    if done.timed_out:
        raise TimeoutExpired(argv, timeout, done.stdout, done.stderr)
    return done


def live_graphs() -> dict[int, Any]:
    """Every traced graph (``FuncGraph``) alive in the process, by ``id``: a caller takes
    them before and after some code to see what it traced or left alive."""
    return {id(o): o for o in gc.get_objects() if type(o).__name__ == "FuncGraph"}


def graphs_traced_by(run: Callable[[], None]) -> list[Any]:
    """The graphs ``run()`` traced that are still alive when it returns (strong
    references: drop them to let them go)."""
    before = live_graphs()
    run()
    return [g for i, g in live_graphs().items() if i not in before]


def graphs_left_alive(fit: Callable[[], None]) -> tuple[list[str], list[str]]:
    """What a finished ``fit()`` leaves of the graphs it traced: runs it, then once more (a
    graph the first left to a cache would be freed by then), collects garbage.

    Returns:
        The names of the graphs (``FuncGraph``) the first call traced, and of those still
        alive. A caller asserts the first holds what its fit must trace (its step), so that a
        renamed graph class cannot make an empty list pass.
    """

    traced = [weakref.ref(g) for g in graphs_traced_by(fit)]
    names = sorted(str(getattr(r(), "name", "")) for r in traced)
    fit()
    gc.collect()
    alive = sorted(str(getattr(r(), "name", "")) for r in traced if r() is not None)
    return names, alive


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> str:
    """``"median R (range A-B, N pairs)"`` of the ratios of two sides' timings taken in
    alternated pairs (the benchmarks' way of reading a ratio on a shared, noisy host)."""
    import statistics

    ratios = [n / d for n, d in zip(numerators, denominators, strict=True)]
    return (
        f"median {statistics.median(ratios):.2f} "
        f"(range {min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} pairs)"
    )


def relative_difference(a: object, b: object) -> float:
    """``max|a - b| / max(max|b|, tiny)`` over every array of two (nested) weight lists."""
    left = [np.asarray(x, dtype=np.float64) for x in _flatten(a)]
    right = [np.asarray(x, dtype=np.float64) for x in _flatten(b)]
    if len(left) != len(right):
        raise ValueError(f"{len(left)} arrays against {len(right)}")
    worst = 0.0
    for x, y in zip(left, right, strict=True):
        if x.shape != y.shape:
            raise ValueError(f"shapes differ: {x.shape} against {y.shape}")
        scale = max(float(np.max(np.abs(y))) if y.size else 0.0, 1e-12)
        diff = float(np.max(np.abs(x - y))) if x.size else 0.0
        worst = max(worst, diff / scale)
    return worst


def _flatten(value: object) -> list[object]:
    if isinstance(value, (list, tuple)):
        out: list[object] = []
        for item in value:
            out.extend(_flatten(item))
        return out
    return [value]


def alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie (read from /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, their children, ...), read from /proc."""
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        for child in child_pids(frontier.pop()):
            if child not in found and alive(child):
                found.add(child)
                frontier.append(child)
    return found


def groups_alive(pgids: list[int]) -> list[int]:
    """Pids of live (not zombie) processes whose process group is one of ``pgids``, from
    /proc: what is left of a job whose tasks each ran in their own group."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in pgids:
            found.append(int(entry))
    return found


def child_pids(pid: int | None = None) -> set[int]:
    """Direct children of process ``pid`` (this one by default), read from /proc."""
    pid = os.getpid() if pid is None else pid
    found: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as handle:
                found.update(int(p) for p in handle.read().split())
        except OSError:
            continue
    return found


_SERVERS: list[Any] = []  # kept alive as long as the process: a stopped server ends the cluster


def in_process_parameter_servers(workers: int = 1, ps: int = 1) -> Any:
    """A ParameterServerStrategy over ``workers`` worker and ``ps`` ps servers started in
    this process on free ports of 127.0.0.1 (TensorFlow's in-process cluster, as its own
    parameter-server tests build it). Worker servers run 3 inter-op threads, so a worker can
    run a scheduled step while it serves a variable read."""
    import tensorflow as tf

    from tfscale.launch.ports import free_ports

    ports = free_ports(workers + ps)
    spec = tf.train.ClusterSpec(
        {
            "worker": [f"localhost:{p}" for p in ports[:workers]],
            "ps": [f"localhost:{p}" for p in ports[workers:]],
        }
    )
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=3)
    for index in range(workers):
        _SERVERS.append(
            tf.distribute.Server(spec, "worker", task_index=index, protocol="grpc", config=config)
        )
    for index in range(ps):
        _SERVERS.append(tf.distribute.Server(spec, "ps", task_index=index, protocol="grpc"))
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")
    return tf.distribute.ParameterServerStrategy(resolver)


_MIRRORED: dict[int, Any] = {}


def mirrored_on_cpus(n: int) -> Any:
    """One MirroredStrategy over logical CPUs ``0..n-1`` per process, reused by every caller.

    A second MirroredStrategy with TensorFlow's default collective all-reduce reuses the
    first one's collective group and instance keys, and its all-reduces then fail with
    "Shape mismatch in the collective instance 100" (tensorflow/tensorflow#62790). Tests
    share one strategy per device set, with ``ReductionToOneDevice`` (what
    ``choose_strategy`` picks for logical CPUs), so they can run in any order in one process.
    """
    import tensorflow as tf

    if n not in _MIRRORED:
        _MIRRORED[n] = tf.distribute.MirroredStrategy(
            [f"/device:CPU:{i}" for i in range(n)],
            cross_device_ops=tf.distribute.ReductionToOneDevice(),
        )
    return _MIRRORED[n]
