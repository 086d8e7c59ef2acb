"""A child's output, line by line, with a prefix: ``[worker 1] loss 0.31``.

One thread per child reads its stdout (stderr merged) and writes each line with the child's
prefix to a sink, under one lock shared by every child, so that lines of several children
interleave whole.
"""

from __future__ import annotations

import sys
import threading
from typing import IO

from tfscale.runtime import chatter

__all__ = ["start_prefixing"]

_WRITE_LOCK = threading.Lock()


def start_prefixing(stream: IO[bytes], prefix: str, sink: IO[str] | None) -> threading.Thread:
    """Starts a daemon thread copying ``stream``'s lines to ``sink`` (``sys.stdout``).

    Args:
        stream: The child's output pipe; read to its end.
        prefix: Written before every line, e.g. ``"[worker 0] "``.
        sink: Where lines go; None means ``sys.stdout`` at the time of each write.

    Returns:
        The started thread; it ends when the child's last writer closes the pipe.
    """
    thread = threading.Thread(
        target=_copy_lines,
        args=(stream, prefix, sink),
        name=f"tfscale-output-{prefix.strip()}",
        daemon=True,
    )
    thread.start()
    return thread


def _copy_lines(stream: IO[bytes], prefix: str, sink: IO[str] | None) -> None:
    writable = True
    drop_chatter = chatter.quiet()  # TensorFlow's start-up lines of the child, unless asked
    for raw in iter(stream.readline, b""):
        if not writable:
            continue  # keep draining: a child blocked on a full pipe would hang
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        if drop_chatter and chatter.is_chatter(line):
            continue
        out = sink if sink is not None else sys.stdout
        try:
            with _WRITE_LOCK:
                out.write(f"{prefix}{line}\n")
                out.flush()
        except (OSError, ValueError):  # closed or broken stdout (e.g. `| head`)
            writable = False
