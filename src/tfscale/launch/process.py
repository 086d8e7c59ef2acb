"""The supervisor's real ``spawn``: a task becomes a guarded child of :mod:`tfscale.processes`.

Each task runs in its own process group (a SIGTERM or SIGKILL to the group reaches the
children the task started too; the terminal's Ctrl-C reaches only the launcher, which then
stops every task itself), and dies with the launcher even when the launcher is SIGKILLed.
Its output (stdout and stderr together) is written as ``[worker 1] line``, or to a file.
"""

from __future__ import annotations

from typing import IO

from tfscale.launch.supervisor import Task
from tfscale.processes import DEVNULL, STDOUT, Child, start

__all__ = ["spawn_process"]


def spawn_process(
    task: Task, *, sink: IO[str] | None = None, log: IO[bytes] | None = None, grace_s: float = 5.0
) -> Child:
    """Starts ``task``; the returned child is the supervisor's handle.

    Args:
        task: What to run.
        sink: Where ``[label]``-prefixed lines go (``sys.stdout`` by default).
        log: A file for the task's raw output instead of prefixed lines.
        grace_s: Seconds between SIGTERM and SIGKILL when the launcher dies.

    Returns:
        The started child (``pid`` is its process group).
    """
    if log is not None:
        return start(
            task.argv, env=task.env, stdin=DEVNULL, stdout=log, stderr=STDOUT, grace_s=grace_s
        )
    return start(
        task.argv,
        env=task.env,
        stdin=DEVNULL,
        prefix=f"[{task.label}] ",
        sink=sink,
        grace_s=grace_s,
    )
