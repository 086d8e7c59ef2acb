"""Starting a child process that cannot outlive tfscale, and stopping it with everything it began.

Every child goes through :func:`start`, which runs it under a small guard process
(``_guard.py``, see there) in a new session::

    tfscale (parent) ── lifeline pipe ──► guard (session + group leader) ──► the command
                                                                        └─► its children

- The child and everything it starts form one process group whose id is :attr:`Child.pid`,
  so :meth:`Child.terminate` / :meth:`Child.kill` reach a worker's own children too, and a
  Ctrl-C at the terminal reaches only tfscale, which then stops its children itself.
- The guard watches the parent: when the parent dies, however (SIGKILL included), or drops
  the :class:`Child` without closing it, the guard sends SIGTERM to the group, waits the
  grace period and SIGKILLs it. No worker is left waiting forever for a dead peer.
- The guard exits as the command did (by the same signal when it was killed), so exit codes
  read as the command's own.

This module imports no TensorFlow: the launcher, the doctor's parent side and the command
line use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from tfscale.processes.output import start_prefixing

__all__ = [
    "DEVNULL",
    "PIPE",
    "STDOUT",
    "Child",
    "Completed",
    "TimeoutExpired",
    "run",
    "start",
]

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT
#: Raised by :meth:`Child.communicate` past its timeout (the child keeps running).
TimeoutExpired = subprocess.TimeoutExpired

Stream = int | IO[Any] | None

_GUARD = str(Path(__file__).resolve().with_name("_guard.py"))
_DRAIN_S = 10.0  # after a kill: how long to wait for the pipes' last bytes


class Child:
    """A started child process, its group and its lifeline. Use :func:`start` to make one.

    Also what the launcher's supervisor needs of a task (``tfscale.launch.supervisor.
    WorkerHandle``).
    """

    def __init__(
        self,
        popen: subprocess.Popen[Any],
        lifeline: int,
        reader: threading.Thread | None,
        argv: Sequence[str],
        grace_s: float,
    ) -> None:
        self._popen = popen
        self._reader = reader
        self._closed = False
        self.argv = tuple(argv)
        self.grace_s = grace_s
        # Dropped without close(): the lifeline closes with it and the guard stops the child.
        self._release = weakref.finalize(self, _close_fd, lifeline)

    @property
    def pid(self) -> int:
        """The guard's pid, which is the id of the child's process group."""
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while running."""
        return self._popen.returncode

    @property
    def stdin(self) -> IO[Any] | None:
        """The child's stdin when started with ``stdin=PIPE``."""
        return self._popen.stdin

    @property
    def stdout(self) -> IO[Any] | None:
        """The child's stdout when started with ``stdout=PIPE`` (and no prefix)."""
        return self._popen.stdout

    @property
    def stderr(self) -> IO[Any] | None:
        """The child's stderr when started with ``stderr=PIPE``."""
        return self._popen.stderr

    def poll(self) -> int | None:
        """The exit code, or None while the child runs."""
        return self._popen.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        """Waits up to ``timeout`` seconds (None: no limit); the exit code, or None if running."""
        try:
            return self._popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """``Popen.communicate``: writes ``input``, reads the pipes to their end, reaps.

        Raises:
            TimeoutExpired: Past ``timeout``; the child still runs.
        """
        return self._popen.communicate(input, timeout)

    def terminate(self) -> None:
        """SIGTERM to the child's process group."""
        self._signal_group(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the child's process group."""
        self._signal_group(signal.SIGKILL)

    def stop(self, grace_s: float | None = None) -> int:
        """SIGTERM to the group, up to ``grace_s`` seconds (default: the child's), SIGKILL.

        Returns:
            The exit code.
        """
        if self.poll() is None:
            self.terminate()
            if self.wait(self.grace_s if grace_s is None else grace_s) is None:
                self.kill()
        code = self.wait(_DRAIN_S)
        return code if code is not None else -int(signal.SIGKILL)

    def close(self) -> None:
        """Kills what is left of the group (a finished child's children), releases the rest.

        Safe to call more than once; the child has ended when it returns.
        """
        if self._closed:
            return
        self._closed = True
        self.kill()
        self.wait(_DRAIN_S)
        self._release()
        if self._reader is not None:
            self._reader.join(timeout=_DRAIN_S)
        for stream in (self._popen.stdin, self._popen.stdout, self._popen.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # group gone already
            os.killpg(self._popen.pid, signum)

    def __repr__(self) -> str:
        return f"Child(pid={self.pid}, argv={list(self.argv)!r}, returncode={self.returncode})"


def _close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def start(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdin: Stream = None,
    stdout: Stream = None,
    stderr: Stream = None,
    pass_fds: Sequence[int] = (),
    prefix: str | None = None,
    sink: IO[str] | None = None,
    text: bool = False,
    grace_s: float = 5.0,
) -> Child:
    """Starts ``argv`` as a guarded child in its own process group.

    Args:
        argv: The command line (``argv[0]`` is looked up on ``PATH``).
        env: The child's complete environment (None: this process's).
        cwd: The child's working directory (None: this one's).
        stdin: As ``subprocess.Popen``'s (None inherits).
        stdout: As ``subprocess.Popen``'s; ignored with ``prefix``.
        stderr: As ``subprocess.Popen``'s; ignored with ``prefix``.
        pass_fds: Descriptors the child inherits with the same numbers.
        prefix: If given, stdout and stderr are read line by line and written to ``sink``
            with this prefix (e.g. ``"[worker 0] "``).
        sink: Where prefixed lines go (None: ``sys.stdout``).
        text: Text rather than bytes on ``PIPE`` streams.
        grace_s: Seconds between SIGTERM and SIGKILL when the guard stops the child
            because this process died, and the default of :meth:`Child.stop`.

    Returns:
        The started child; :meth:`Child.close` it (or use ``with``) when done.

    Raises:
        ValueError: ``argv`` is empty.
        OSError: The guard could not be started (a command that cannot be executed is
            reported by the child: exit code 127 and a line on its stderr).
    """
    if not argv:
        raise ValueError("start() needs a command: argv is empty")
    lifeline, keep = os.pipe()  # the guard reads; only this process holds the write end
    config = json.dumps(
        {"lifeline": lifeline, "parent": os.getpid(), "grace": grace_s, "fds": list(pass_fds)}
    )
    if prefix is not None:
        stdout, stderr, text = PIPE, STDOUT, False
    try:
        popen = subprocess.Popen(
            # -I -S: the guard needs the standard library only, not PYTHONPATH or site.
            [sys.executable, "-I", "-S", _GUARD, config, "--", *argv],
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            env=None if env is None else dict(env),
            cwd=cwd,
            pass_fds=(lifeline, *pass_fds),
            start_new_session=True,
            text=text,
        )
    except BaseException:
        os.close(keep)
        raise
    finally:
        os.close(lifeline)
    reader = None
    if prefix is not None:
        assert popen.stdout is not None
        reader = start_prefixing(popen.stdout, prefix, sink)
    return Child(popen, keep, reader, argv, grace_s)


@dataclass(frozen=True)
class Completed:
    """How a command run by :func:`run` ended.

    Attributes:
        args: The command line.
        returncode: Its exit code (negative: killed by that signal).
        stdout: What it wrote to stdout (text), None when not captured.
        stderr: What it wrote to stderr (text), None when not captured.
        timed_out: It ran past the timeout and was killed with its group.
    """

    args: tuple[str, ...]
    returncode: int
    stdout: Any
    stderr: Any
    timed_out: bool = False


def run(
    argv: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    capture: bool = True,
    text: bool = True,
) -> Completed:
    """Runs ``argv`` to its end, at most ``timeout`` seconds, then kills its process group.

    Args:
        argv: The command line.
        timeout: Seconds before the command and its children are killed.
        env: The complete environment (None: this process's).
        cwd: The working directory.
        capture: Capture stdout and stderr (else they are inherited).
        text: Decode captured output as text.

    Returns:
        The exit code, the output and whether the time ran out. A command that cannot be
        executed ends with code 127.
    """
    stream = PIPE if capture else None
    with start(
        argv, env=env, cwd=cwd, stdin=DEVNULL, stdout=stream, stderr=stream, text=text
    ) as child:
        timed_out = False
        try:
            out, err = child.communicate(timeout=timeout)
        except TimeoutExpired:
            timed_out = True
            child.kill()
            try:
                out, err = child.communicate(timeout=_DRAIN_S)
            except TimeoutExpired:  # a grandchild that left the group holds the pipes
                out, err = None, None
        code = child.wait(_DRAIN_S)
    return Completed(
        tuple(argv), code if code is not None else -int(signal.SIGKILL), out, err, timed_out
    )
