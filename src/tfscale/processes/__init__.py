"""Every child process tfscale starts goes through here: one process layer, TensorFlow-free.

- :func:`start` / :class:`Child` (``child.py``): a guarded child in its own process group
  that dies with its parent (a middleman with a lifeline pipe and a parent-death signal),
  group-wide SIGTERM then SIGKILL, optional ``[prefix]`` output lines.
- :func:`run` / :class:`Completed`: a command run to its end under a deadline.
- :class:`Channel` (``channel.py``): messages over two pipes to a worker process.
- :func:`replace_process`: become another program (``exec``), for ``launch --slurm``.

``tests/test_process_layer.py`` checks that no other module of tfscale imports
``subprocess`` or ``multiprocessing`` or calls ``os.fork`` / ``os.exec*`` / ``os.spawn*``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import NoReturn

from tfscale.processes.channel import Channel, ChildEnds
from tfscale.processes.child import (
    DEVNULL,
    PIPE,
    STDOUT,
    Child,
    Completed,
    TimeoutExpired,
    run,
    start,
)

__all__ = [
    "DEVNULL",
    "PIPE",
    "STDOUT",
    "Channel",
    "Child",
    "ChildEnds",
    "Completed",
    "TimeoutExpired",
    "replace_process",
    "run",
    "start",
]


def replace_process(argv: Sequence[str], env: Mapping[str, str]) -> NoReturn:
    """Replaces this process with ``argv`` (``execve``): same pid, so whoever watches and
    signals this process (Slurm's ``srun``) watches and signals the program itself.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], list(argv), dict(env))
