"""``tfscale launch --slurm``: one Slurm task becomes one TensorFlow worker.

Inside an allocation, ``srun`` starts one copy of ``tfscale launch --slurm script.py`` per
task. Each copy derives its place in the cluster from Slurm's environment
(:class:`tfscale.cluster.SlurmSource`), sets ``TF_CONFIG`` and replaces itself with
the script, so the process Slurm watches and signals is the script itself. ``srun
--kill-on-bad-exit=1`` then does what the local supervisor does: one task fails, all stop.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

from tfscale.cluster import (
    DEFAULT_SLURM_PORT,
    DEVICE_KINDS_ENV,
    SOURCE_ENV,
    SlurmSource,
    TFConfigSource,
)
from tfscale.errors import LaunchError, explain
from tfscale.launch.gpus import assign_gpus, visible_gpus
from tfscale.launch.plan import WORKER_MODULE
from tfscale.launch.together import LABEL_ENV
from tfscale.processes import replace_process

__all__ = ["DEFAULT_SLURM_PORT", "exec_slurm_task", "sbatch_script", "slurm_task_env"]

# The sbatch loops' stop: a step whose worker trained alone (status 78, or a verdict file in
# the report folder) is never restarted, as the local supervisor never restarts it.
_STOP_IF_ALONE = [
    '    if [ "$status" = 78 ] || compgen -G "$TFSCALE_LAUNCH_REPORT_DIR/*.json" >/dev/null; then',
    '        echo "tfscale: a worker did not train with the others (why: above); not'
    ' restarting" >&2',
    "        exit 78",
    "    fi",
]


def slurm_task_env(
    env: Mapping[str, str],
    *,
    port_base: int = DEFAULT_SLURM_PORT,
    list_gpus: Callable[[], str] | None = None,
) -> dict[str, str]:
    """The environment for this Slurm task's script: ``env`` plus its ``TF_CONFIG``.

    Several tasks on one node each get their own block of the node's GPUs
    (``CUDA_VISIBLE_DEVICES``, by position on the node, as TensorFlow's SlurmClusterResolver
    does), unless Slurm already gave each task fewer GPUs than there are tasks on the node
    (``--gpus-per-task``). ``TFSCALE_WORKER_DEVICE_KINDS`` says whether workers train on GPUs.

    Args:
        env: The task's environment (Slurm's variables).
        port_base: The first port on each node.
        list_gpus: ``nvidia-smi -L`` output, for tests; None runs ``nvidia-smi``.

    Raises:
        tfscale.ClusterConfigError: The Slurm environment is missing or malformed.
    """
    config = SlurmSource(port_base).resolve(env)
    out = dict(env)
    out["TF_CONFIG"] = config.to_json()
    out[SOURCE_ENV] = TFConfigSource.name  # written here from Slurm's variables: read as is
    gpus = visible_gpus(env) if list_gpus is None else visible_gpus(env, list_gpus)
    host, _, port = (config.address or ":0").rpartition(":")
    on_node = sum(a.rpartition(":")[0] == host for a in config.workers)
    if on_node > 1 and len(gpus) >= on_node:
        block = assign_gpus(gpus, on_node)[int(port) - port_base]
        if block is not None:
            out["CUDA_VISIBLE_DEVICES"] = block
    out[DEVICE_KINDS_ENV] = "GPU" if gpus else "CPU"
    return out


def exec_slurm_task(
    script: Sequence[str],
    env: Mapping[str, str],
    *,
    port_base: int = DEFAULT_SLURM_PORT,
    python: str = sys.executable,
) -> NoReturn:
    """Replaces this process with ``python script...`` running with its ``TF_CONFIG``,
    through the strict worker runner (``launch/worker.py``): a worker that would train alone
    exits with status 78 and says why, and ``srun --kill-on-bad-exit`` stops the others."""
    task_env = slurm_task_env(env, port_base=port_base)
    task_env.setdefault(LABEL_ENV, f"Slurm task {task_env.get('SLURM_PROCID', '?')}")
    replace_process([python, "-m", WORKER_MODULE, *script], task_env)


def sbatch_script(
    script: Sequence[str],
    *,
    nodes: int,
    tasks_per_node: int = 1,
    gpus_per_node: int = 0,
    cpus_per_task: int | None = None,
    time_limit: str = "01:00:00",
    job_name: str = "tfscale",
    port_base: int = DEFAULT_SLURM_PORT,
    max_restarts: int = 0,
    min_workers: int | None = None,
) -> str:
    """A ready-to-edit sbatch script that runs ``script`` as ``nodes * tasks_per_node`` workers.

    Args:
        script: The script and its arguments.
        nodes: Nodes to allocate.
        tasks_per_node: Workers per node (one per GPU is usual).
        gpus_per_node: GPUs per node (``--gpus-per-node``); 0 leaves the line out.
        cpus_per_task: CPU cores per worker, or None to leave the line out.
        time_limit: Slurm ``--time``.
        job_name: Slurm ``--job-name``.
        port_base: First port on each node.
        max_restarts: How many times the job step is started again after a failure
            (the script resumes from its checkpoint with ``tfscale.fit(checkpoint_dir=...)``);
            with ``min_workers``, per size.
        min_workers: Elastic: a node whose task fails on every start until the restarts
            are used up, or that Slurm reports unusable, is left out and the step restarts
            on the nodes left (``launch/slurm_elastic.py``), down to this many workers.

    Returns:
        The script text.

    Raises:
        LaunchError: A count is out of range.
    """
    for option, value in (("--nodes", nodes), ("--tasks-per-node", tasks_per_node)):
        if value < 1:
            raise LaunchError(
                explain(
                    f"{option} must be at least 1.",
                    received=value,
                    allowed="an integer >= 1",
                    fix=f"pass {option} 1 or more.",
                )
            )
    if not script:
        raise LaunchError(
            explain(
                "--print-sbatch needs the script to run.",
                received="no script",
                allowed="tfscale launch --slurm --print-sbatch train.py [args...]",
                fix="name the training script after the options.",
            )
        )
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={tasks_per_node}",
    ]
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={cpus_per_task}")
    if min_workers is not None:
        return "\n".join(
            lines + _elastic_loop(script, time_limit, job_name, port_base, max_restarts,
                                  min_workers, tasks_per_node, nodes)
        ) + "\n"  # fmt: skip
    lines += [
        f"#SBATCH --time={time_limit}",
        f"#SBATCH --output={job_name}-%j.out",
        "",
        f"# {nodes * tasks_per_node} workers, one Slurm task each. Every task derives its",
        "# TF_CONFIG from SLURM_PROCID, SLURM_STEP_NODELIST and SLURM_STEP_TASKS_PER_NODE.",
        "# --kill-on-bad-exit=1 stops every task when one fails, so none waits forever",
        "# in a collective for a dead peer; the loop starts the step again, and a script",
        "# using tfscale.fit(checkpoint_dir=...) resumes from its last checkpoint.",
        "# A worker that would train alone exits 78 and leaves why in this folder (the",
        "# submit folder, which every node sees): a restart would do the same, so the loop",
        "# stops (srun may report 143 instead, for a task it stopped first).",
        'export TFSCALE_LAUNCH_REPORT_DIR="$PWD/.tfscale-$SLURM_JOB_ID"',
        'mkdir -p "$TFSCALE_LAUNCH_REPORT_DIR"',
        """trap 'rm -rf "$TFSCALE_LAUNCH_REPORT_DIR"' EXIT""",
        f"MAX_RESTARTS={max_restarts}",
        'for attempt in $(seq 0 "$MAX_RESTARTS"); do',
        "    export TFSCALE_LAUNCH_ATTEMPT=$attempt",
        "    srun --kill-on-bad-exit=1 tfscale launch --slurm"
        f" --port {port_base} {shlex.join(script)} && exit 0",
        "    status=$?",
        *_STOP_IF_ALONE,
        '    echo "tfscale: job step failed (status $status), attempt $attempt" >&2',
        "done",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def _elastic_loop(
    script: Sequence[str],
    time_limit: str,
    job_name: str,
    port_base: int,
    max_restarts: int,
    min_workers: int,
    tasks_per_node: int,
    nodes: int,
) -> list[str]:
    decide = (
        'tfscale launch --slurm --next-step "$STATE"'
        f" --max-restarts {max_restarts} --min-workers {min_workers}"
        f" --nodes {nodes} --tasks-per-node {tasks_per_node}"
    )
    return [
        f"#SBATCH --time={time_limit}",
        f"#SBATCH --output={job_name}-%j.out",
        "",
        f"# {nodes * tasks_per_node} workers, one Slurm task each, elastic down to {min_workers}:",
        "# the step restarts after a failure; a node whose task fails on every start until",
        f"# its {max_restarts} restart(s) are used up, or that Slurm reports down, drained or not",
        "# responding, is left out (srun --exclude) and the step restarts on the nodes left,",
        "# with a new TF_CONFIG; tfscale.fit(checkpoint_dir=...) resumes at the exact batch.",
        "# `tfscale launch --slurm --next-step` decides (tfscale/launch/slurm_elastic.py) from",
        "# srun's stderr (the first failed task's node) and `scontrol show node`.",
        'export TFSCALE_LAUNCH_REPORT_DIR="$PWD/.tfscale-$SLURM_JOB_ID"',
        'STATE="$TFSCALE_LAUNCH_REPORT_DIR/elastic"',
        'mkdir -p "$STATE"',
        """trap 'rm -rf "$TFSCALE_LAUNCH_REPORT_DIR"' EXIT""",
        'OPTIONS=""',
        "attempt=0",
        "while :; do",
        "    export TFSCALE_LAUNCH_ATTEMPT=$attempt",
        "    # shellcheck disable=SC2086  # OPTIONS holds several options",
        "    srun --kill-on-bad-exit=1 $OPTIONS tfscale launch --slurm"
        f' --port {port_base} {shlex.join(script)} 2> >(tee "$STATE/srun-$attempt.err" >&2)',
        "    status=$?",
        "    wait $! 2>/dev/null  # tee has written srun's stderr",
        '    if [ "$status" = 0 ]; then',
        f"        {decide}",
        "        exit 0",
        "    fi",
        *_STOP_IF_ALONE,
        '    echo "tfscale: job step failed (status $status), attempt $attempt" >&2',
        f'    OPTIONS=$({decide} --step-attempt "$attempt") || exit "$status"',
        "    attempt=$((attempt + 1))",
        "done",
    ]
