"""The middleman between tfscale and every child it starts: the child dies with its parent.

Run as ``python -I -S _guard.py CONFIG -- ARGV...`` by :func:`tfscale.processes.start`, in a
new session (so the guard's pid is the process group id of everything below it). It imports
the standard library only and runs by path, so it starts in milliseconds and never imports
tfscale (whose ``import`` may start TensorFlow) or the user's ``PYTHONPATH``.

The guard starts ARGV in its own process group and waits for it. The parent is watched two
ways, as Horovod's ``safe_shell_exec`` does with its middleman:

- the *lifeline*: the read end of a pipe whose only write end the parent holds. End of file
  means the parent process is gone (or dropped the child), whatever killed it, SIGKILL
  included, on every POSIX system;
- a parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG)``), in case a process forked from
  the parent without exec still holds the write end. The kernel sends it when the parent
  *thread* that started the guard exits, so the guard only acts once ``getppid()`` says the
  parent *process* is gone: a TaskPool worker thread that restarts a child and later ends
  does not kill it.

When the parent is gone the guard sends SIGTERM to its process group (ARGV and everything
ARGV started), waits up to the grace period, then SIGKILLs the group, itself included.

Otherwise it mirrors ARGV: it ignores SIGTERM/SIGINT/SIGHUP sent to the group (they reach
ARGV directly; the guard stays to report how ARGV ended) and exits as ARGV did, by the same
signal when ARGV was killed, so the parent sees ``-9`` for a SIGKILLed worker as before.
ARGV itself gets SIGKILL as its parent-death signal: if the guard is killed, so is ARGV.

CONFIG is JSON: ``{"lifeline": FD, "parent": PID, "grace": SECONDS, "fds": [FD, ...]}``
(``fds``: descriptors passed on to ARGV, e.g. a TaskPool worker's pipes).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

_PR_SET_PDEATHSIG = 1
_PARENT_DEATH_SIGNAL = signal.SIGHUP
_POLL_S = 0.2  # where pidfd_open is missing: how often to look at ARGV


class _ParentGone(Exception):  # noqa: N818 (a condition, not an error)
    """The process that started the guard has ended."""


def _set_parent_death_signal(signum: int) -> bool:
    """Asks Linux to send ``signum`` when the parent thread exits; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _kill_argv_with_guard() -> None:
    """Runs in ARGV's process between fork and exec (the guard has one thread: safe)."""
    _set_parent_death_signal(signal.SIGKILL)


def _ignore(signum: int, frame: Any) -> None:
    """Group signals reach ARGV directly; the guard waits to report how ARGV ended."""


def _parent_death_handler(parent: int) -> Callable[[int, Any], None]:
    def handler(signum: int, frame: Any) -> None:
        if os.getppid() != parent:
            raise _ParentGone

    return handler


def _wait_readable(fds: list[int], timeout: float | None) -> list[int]:
    ready, _, _ = select.select(fds, [], [], timeout)
    return ready


def _watch(process: subprocess.Popen[bytes], lifeline: int, parent: int) -> int:
    """Waits for ARGV to end (its exit code) or raises :class:`_ParentGone`."""
    try:
        pidfd: int | None = os.pidfd_open(process.pid)
    except (AttributeError, OSError):  # macOS, or a Linux before 5.3
        pidfd = None
    watched = [lifeline] if pidfd is None else [lifeline, pidfd]
    while True:
        if os.getppid() != parent:
            raise _ParentGone
        ready = _wait_readable(watched, _POLL_S if pidfd is None else None)
        code = process.poll()
        if code is not None:
            return code
        if lifeline in ready and not os.read(lifeline, 1):
            raise _ParentGone


def _stop_group(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM to the group, the grace period, then SIGKILL to the group (the guard too)."""
    try:
        os.killpg(0, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.killpg(0, signal.SIGKILL)


def _exit_like(code: int) -> None:
    """Exits with ``code``, or dies by the same signal when ``code`` is negative."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file of the guard
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(-code, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        time.sleep(1.0)  # the signal arrives meanwhile; the line below is the fallback
        os._exit(128 - code)
    os._exit(code)


def main(argv: list[str]) -> None:
    """``_guard.py CONFIG -- ARGV...``: runs ARGV, tied to the guard's parent."""
    config = json.loads(argv[0])
    command = argv[2:] if argv[1:2] == ["--"] else argv[1:]
    lifeline, parent = int(config["lifeline"]), int(config["parent"])
    grace_s = float(config.get("grace", 5.0))
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _ignore)
    signal.signal(_PARENT_DEATH_SIGNAL, _parent_death_handler(parent))
    _set_parent_death_signal(_PARENT_DEATH_SIGNAL)
    process = None
    try:
        if os.getppid() != parent:  # the parent died before the signal was armed
            raise _ParentGone
        try:
            process = subprocess.Popen(
                command,
                pass_fds=tuple(int(fd) for fd in config.get("fds", ())),
                preexec_fn=_kill_argv_with_guard,  # safe: the guard has a single thread
            )
        except OSError as error:
            print(f"tfscale: cannot start {command[0]!r}: {error}", file=sys.stderr)
            os._exit(127)
        code = _watch(process, lifeline, parent)
    except _ParentGone:
        signal.signal(_PARENT_DEATH_SIGNAL, signal.SIG_IGN)
        if process is None:
            os._exit(1)
        _stop_group(process, grace_s)
        os._exit(1)  # not reached: SIGKILL to the group ends the guard too
    _exit_like(code)


if __name__ == "__main__":
    main(sys.argv[1:])
