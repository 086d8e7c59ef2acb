"""A local job: the supervisor, real processes, and fresh ports for every attempt.

``tfscale launch`` runs a user's script this way, and ``tfscale bench --workers N`` its
measuring workers: one way to start, watch and stop a job's processes on this machine.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from tfscale.errors import LaunchError, explain
from tfscale.launch.gpus import assign_gpus, visible_gpus
from tfscale.launch.plan import LocalJob, plan_tasks
from tfscale.launch.ports import check_ports, free_ports
from tfscale.launch.process import spawn_process
from tfscale.launch.supervisor import JobResult, Supervisor, Task, WorkerHandle
from tfscale.launch.together import NOT_TOGETHER_STATUS, PORT_TAKEN_STATUS

__all__ = ["log_path", "run_local_job"]


def run_local_job(
    job: LocalJob,
    *,
    port_base: int | None = None,
    max_restarts: int = 0,
    grace_s: float = 5.0,
    timeout_s: float | None = None,
    base_env: Mapping[str, str] | None = None,
    output_dir: str | None = None,
    log: Callable[[str], None] | None = None,
    min_workers: int | None = None,
) -> JobResult:
    """Runs ``job`` as processes on this machine under a :class:`Supervisor`.

    Args:
        job: What to run.
        port_base: First of ``job.num_tasks`` consecutive ports, or None to pick free ports
            (new ones for every attempt).
        max_restarts: Restarts of the whole job after a failure.
        grace_s: Seconds between SIGTERM and SIGKILL when stopping tasks.
        timeout_s: Time limit of the whole job (exit status 124 past it), or None.
        base_env: The environment the tasks inherit (``os.environ`` by default).
        output_dir: If given, each task's output goes to ``output_dir/<label>.log``
            (``worker-0.log``) instead of ``[label]``-prefixed lines on stdout.
        log: Receives the supervisor's messages (default: stderr, ``[tfscale launch]``).
        min_workers: Elastic: a worker slot that fails on every start until its restarts
            are used up is dropped and the job restarts on the others, down to this many
            (``launch/elastic.py``); None: never drop a worker.

    Returns:
        The job's result.

    Raises:
        LaunchError: Invalid counts, or a port of ``port_base``'s range is in use.
        KeyboardInterrupt: Ctrl-C; every task has been stopped.
    """
    _check(job, max_restarts, grace_s, timeout_s, min_workers)
    if port_base is not None:
        check_ports(port_base, job.num_tasks, job.host)  # fail before starting anything
    env = os.environ if base_env is None else base_env
    gpus = assign_gpus(visible_gpus(env), job.workers, job.gpus_per_worker)

    def make_tasks(attempt: int, slots: tuple[int, ...]) -> list[Task]:
        if port_base is None:
            ports = free_ports(job.num_tasks, job.host)
        else:
            ports = check_ports(port_base, job.num_tasks, job.host)
        elastic = slots if min_workers is not None else None
        return plan_tasks(job, ports, attempt, base_env=env, gpus=gpus, slots=elastic)

    def spawn(task: Task) -> WorkerHandle:
        if output_dir is None:
            return spawn_process(task, grace_s=grace_s)
        with open(log_path(output_dir, task.label), "ab") as output:
            return spawn_process(task, log=output, grace_s=grace_s)

    # A worker that would not train with the others (launch/worker.py) does the same again;
    # one whose chosen port was taken meanwhile (ports.free_ports) is not the job's failure.
    # With --port the ports are the user's: the next attempt checks them again (check_ports).
    supervisor = Supervisor(
        spawn,
        grace_s=grace_s,
        log=log,
        final_statuses=(NOT_TOGETHER_STATUS,),
        retry_statuses=(PORT_TAKEN_STATUS,) if port_base is None else (),
    )
    return supervisor.run_elastic(
        make_tasks,
        slots=tuple(range(job.workers)),
        min_workers=min_workers,
        max_restarts=max_restarts,
        timeout_s=timeout_s,
    )


def log_path(output_dir: str, label: str) -> str:
    """Where ``run_local_job(output_dir=...)`` writes the output of the task ``label``."""
    return os.path.join(output_dir, label.replace(" ", "-") + ".log")


def _check(
    job: LocalJob,
    max_restarts: int,
    grace_s: float,
    timeout_s: float | None,
    min_workers: int | None,
) -> None:
    checks = (
        ("-n", job.workers, job.workers >= 1, "an integer >= 1"),
        ("--ps", job.ps, job.ps >= 0, "an integer >= 0"),
        (
            "--devices-per-worker",
            job.devices_per_worker,
            job.devices_per_worker is None or job.devices_per_worker >= 1,
            "an integer >= 1",
        ),
        ("--max-restarts", max_restarts, max_restarts >= 0, "an integer >= 0"),
        (
            "--gpus-per-worker",
            job.gpus_per_worker,
            job.gpus_per_worker is None or job.gpus_per_worker >= 0,
            "an integer >= 0",
        ),
        ("--grace", grace_s, grace_s >= 0, "seconds >= 0"),
        ("--timeout", timeout_s, timeout_s is None or timeout_s > 0, "seconds > 0"),
        (
            "--min-workers",
            min_workers,
            min_workers is None or (1 <= min_workers <= job.workers and not job.ps),
            f"an integer from 1 to -n ({job.workers}), without --ps",
        ),
    )
    for option, value, ok, allowed in checks:
        if not ok:
            raise LaunchError(
                explain(
                    f"tfscale launch: {option} is invalid.",
                    received=value,
                    allowed=allowed,
                    fix=f"pass a valid {option}.",
                )
            )
