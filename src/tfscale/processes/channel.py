"""Messages between a parent and a worker process: length-prefixed bytes over two pipes.

The TaskPool's process backend talks to its workers this way rather than through
``multiprocessing``: a worker is a fresh interpreter started by :func:`tfscale.processes.start`
(never a fork of a process that may run TensorFlow), and it finds its two ends by number::

    parent                                   worker (python -m ... READ_FD WRITE_FD)
    Channel.send(bytes)  ── pipe ──►  Channel.from_fds(READ_FD, WRITE_FD).receive()
    Channel.receive()    ◄── pipe ──  .send(bytes)

End of file on either pipe means the other side is gone.
"""

from __future__ import annotations

import contextlib
import os
from multiprocessing.connection import Connection

__all__ = ["Channel", "ChildEnds"]


class ChildEnds:
    """The worker's two pipe ends, to pass to :func:`tfscale.processes.start`, then close."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.fds = (read_fd, write_fd)

    def close(self) -> None:
        """Closes this process's copies (the started worker keeps its own)."""
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)


class Channel:
    """One side of a two-pipe message channel.

    Args:
        read_fd: The pipe end messages arrive on.
        write_fd: The pipe end messages leave by.
    """

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self._inbox = Connection(read_fd, writable=False)
        self._outbox = Connection(write_fd, readable=False)

    @classmethod
    def pair(cls) -> tuple[Channel, ChildEnds]:
        """A parent's side and the ends a worker gets (``pass_fds=ends.fds``)."""
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        return cls(from_child_r, to_child_w), ChildEnds(to_child_r, from_child_w)

    @classmethod
    def from_fds(cls, read_fd: int, write_fd: int) -> Channel:
        """The worker's side, from the descriptor numbers it was given."""
        return cls(read_fd, write_fd)

    def send(self, message: bytes) -> None:
        """Sends one message.

        Raises:
            OSError: The other side is gone (BrokenPipeError).
        """
        self._outbox.send_bytes(message)

    def receive(self) -> bytes:
        """The next message.

        Raises:
            EOFError: The other side closed its end (or died).
        """
        return self._inbox.recv_bytes()

    def poll(self, timeout: float | None) -> bool:
        """Waits up to ``timeout`` seconds (None: no limit) for a message or end of file."""
        return self._inbox.poll(timeout)

    def close(self) -> None:
        """Closes both ends; safe to call more than once."""
        for end in (self._inbox, self._outbox):
            if not end.closed:
                end.close()
