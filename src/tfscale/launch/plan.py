"""The tasks of a local job: who runs what, on which port, with which TF_CONFIG.

A MultiWorkerMirrored job (``--ps 0``) is N ``worker`` tasks that all run the script; worker
0 is the chief (TensorFlow's rule when the cluster has no ``chief`` task). A
parameter-server job (``--ps P``) is one ``chief`` task that runs the script and drives
training through a ClusterCoordinator, N ``worker`` tasks and P ``ps`` tasks that run
``python -m tfscale.launch.server`` (a ``tf.distribute.Server`` that waits for work).

    --ps 0 -n 2:  worker 0 (script, chief)   worker 1 (script)
    --ps 1 -n 2:  chief 0 (script)   worker 0 (server)   worker 1 (server)   ps 0 (server)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from tfscale.cluster import DEVICE_KINDS_ENV, SOURCE_ENV, TFConfigSource, tf_config
from tfscale.launch.supervisor import Task
from tfscale.launch.together import LABEL_ENV

__all__ = ["ATTEMPT_ENV", "SERVER_MODULE", "WORKER_MODULE", "LocalJob", "plan_tasks"]

#: Set in every task: the attempt number (0 first, 1 after the first restart, ...).
ATTEMPT_ENV = "TFSCALE_LAUNCH_ATTEMPT"
SERVER_MODULE = "tfscale.launch.server"
WORKER_MODULE = "tfscale.launch.worker"
_VIRTUAL_DEVICES_ENV = "TFSCALE_VIRTUAL_DEVICES"


@dataclass(frozen=True)
class LocalJob:
    """What ``tfscale launch`` was asked to run on this machine.

    Attributes:
        script: The script's command line after the interpreter (``train.py --epochs 4``).
        workers: Number of worker tasks (N).
        ps: Number of parameter-server tasks (P); 0 for MultiWorkerMirroredStrategy.
        devices_per_worker: Logical devices per task (``TFSCALE_VIRTUAL_DEVICES``), or None.
        gpus_per_worker: GPUs per worker (None: split the visible GPUs evenly; 0: none).
        host: The address every task listens on.
        python: The interpreter that runs the tasks.
    """

    script: tuple[str, ...]
    workers: int
    ps: int = 0
    devices_per_worker: int | None = None
    gpus_per_worker: int | None = None
    host: str = "127.0.0.1"
    python: str = sys.executable

    @property
    def num_tasks(self) -> int:
        """Processes per attempt (a chief is added when there are parameter servers)."""
        return self.workers + self.ps + (1 if self.ps else 0)


def plan_tasks(
    job: LocalJob,
    ports: Sequence[int],
    attempt: int,
    base_env: Mapping[str, str] | None = None,
    gpus: Sequence[str | None] | None = None,
    slots: Sequence[int] | None = None,
) -> list[Task]:
    """Builds the tasks of one attempt.

    Args:
        job: The job.
        ports: ``job.num_tasks`` ports; in order chief, workers, ps.
        attempt: The attempt number, exported as ``TFSCALE_LAUNCH_ATTEMPT``.
        base_env: The environment the tasks inherit (``os.environ`` by default).
        gpus: ``CUDA_VISIBLE_DEVICES`` per worker from :func:`~tfscale.launch.gpus.assign_gpus`
            (None entries leave it alone); None: no GPU decisions.
        slots: The worker slots this attempt runs, of an elastic job that may have dropped
            some (``--min-workers``): ``worker {slot}`` keeps its label and GPUs, its
            ``TF_CONFIG`` index is its position among them. None: every worker.

    Returns:
        One task per process, chief (if any) first.
    """
    base = dict(os.environ if base_env is None else base_env)
    base.pop("TF_CONFIG", None)
    # The launcher writes TF_CONFIG: read it as written, even in a Kubernetes pod (where
    # TF_CONFIG would otherwise be checked as a TFJob's).
    base[SOURCE_ENV] = TFConfigSource.name
    base["PYTHONUNBUFFERED"] = "1"  # lines reach the [worker i] prefixer as they are printed
    base[ATTEMPT_ENV] = str(attempt)
    if job.devices_per_worker:
        base[_VIRTUAL_DEVICES_ENV] = str(job.devices_per_worker)
    per_worker: list[str | None] = list(gpus) if gpus is not None else [None] * job.workers
    if slots is not None:
        return _elastic_tasks(job, ports, base, per_worker, slots, gpus is not None)
    if gpus is not None:
        _set_device_kinds(base, per_worker, job.ps)
    no_gpu = "" if any(g is not None for g in per_worker) else None
    addresses = [f"{job.host}:{port}" for port in ports]
    # The script runs through the strict worker runner: a worker that would train alone
    # stops the job and says why (launch/worker.py).
    script = (job.python, "-m", WORKER_MODULE, *job.script)
    server = (job.python, "-m", SERVER_MODULE)
    if not job.ps:
        return [
            _task(f"worker {i}", script, base, i, tf_config(addresses, i), True, per_worker[i])
            for i in range(job.workers)
        ]
    chief, workers, ps = addresses[0], addresses[1 : 1 + job.workers], addresses[1 + job.workers :]
    config: Callable[[str, int], str] = lambda kind, i: tf_config(  # noqa: E731
        workers, i, task_type=kind, chief=chief, ps=ps
    )
    # The chief only coordinates and the ps only hold variables: the GPUs go to workers.
    tasks = [_task("chief 0", script, base, 0, config("chief", 0), True, no_gpu)]
    tasks += [
        _task(f"worker {i}", server, base, 1 + i, config("worker", i), False, per_worker[i])
        for i in range(job.workers)
    ]
    tasks += [
        _task(f"ps {i}", server, base, 1 + job.workers + i, config("ps", i), False, no_gpu)
        for i in range(job.ps)
    ]
    return tasks


def _set_device_kinds(base: dict[str, str], per_worker: Sequence[str | None], ps: int = 0) -> None:
    # What each worker trains on, for choose_strategy's collective choice (NCCL needs
    # GPUs on every worker); TF_CONFIG cannot say it. One kind stands for all workers.
    kinds = sorted({"GPU" if g else "CPU" for g in per_worker})
    if len(kinds) == 1:
        base[DEVICE_KINDS_ENV] = kinds[0]
    elif not ps:
        base[DEVICE_KINDS_ENV] = ",".join("GPU" if g else "CPU" for g in per_worker)


def _elastic_tasks(
    job: LocalJob,
    ports: Sequence[int],
    base: dict[str, str],
    per_worker: list[str | None],
    slots: Sequence[int],
    gpu_decisions: bool,
) -> list[Task]:
    """The workers of an elastic MultiWorkerMirrored job on ``slots`` (see ``plan_tasks``)."""
    if job.ps:
        raise ValueError("an elastic job has no parameter servers")
    if gpu_decisions:
        _set_device_kinds(base, [per_worker[s] for s in slots])
    addresses = [f"{job.host}:{port}" for port in ports[: len(slots)]]
    script = (job.python, "-m", WORKER_MODULE, *job.script)
    tasks = []
    for index, slot in enumerate(slots):
        config = tf_config(addresses, index)
        task = _task(f"worker {slot}", script, base, index, config, True, per_worker[slot])
        tasks.append(replace(task, slot=slot))
    return tasks


def _task(
    label: str,
    argv: tuple[str, ...],
    base: Mapping[str, str],
    rank: int,
    config: str,
    must_finish: bool,
    cuda_visible_devices: str | None,
) -> Task:
    env = dict(base)
    env[LABEL_ENV] = label
    env["TF_CONFIG"] = config
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    return Task(label=label, argv=argv, env=env, rank=rank, must_finish=must_finish)
