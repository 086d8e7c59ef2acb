"""The worker process of the process backend: runs cloudpickled calls read from a pipe.

Started (through :mod:`tfscale.processes`, so it dies with the pool's process) as
``python -m tfscale.tasks.backends._child READ_FD WRITE_FD`` with the device in
``TFSCALE_TASK_DEVICE`` (the pool's name, for ``current_device()``) and
``TFSCALE_TASK_LOCAL_DEVICE`` (its name inside this process). TensorFlow is imported only if a
task needs it: then the call runs under ``tf.device``. The process exits when the parent
closes the pipe or sends an empty message, so it never outlives the pool.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any

import cloudpickle

from tfscale.processes.channel import Channel
from tfscale.tasks.context import running_on

__all__ = ["READY"]

#: The first message a worker sends, once it can run a call: the pool's task clock starts
#: after it, so a task's timeout does not count the interpreter's start-up.
READY = b"ready"


def _execute(message: bytes, device: str, local: str) -> bytes:
    start = time.perf_counter()
    try:
        fn, args, kwargs = cloudpickle.loads(message)
        with running_on(device):
            if "tensorflow" in sys.modules:
                import tensorflow as tf

                with tf.device(local):
                    start = time.perf_counter()
                    result = fn(*args, **kwargs)
            else:
                start = time.perf_counter()
                result = fn(*args, **kwargs)
        seconds = time.perf_counter() - start
        try:
            return bytes(cloudpickle.dumps(("ok", result, seconds)))
        except Exception as error:
            raise TypeError(f"the task's result cannot be pickled: {error}") from error
    except Exception as error:
        seconds = time.perf_counter() - start
        text = traceback.format_exc()
        try:
            return bytes(cloudpickle.dumps(("err", error, text, seconds)))
        except Exception:
            fallback = RuntimeError(f"{type(error).__name__}: {error} (not picklable)")
            return bytes(cloudpickle.dumps(("err", fallback, text, seconds)))


def main(argv: list[str]) -> int:
    """Serves calls until the pipe closes."""
    channel = Channel.from_fds(int(argv[0]), int(argv[1]))
    device = os.environ.get("TFSCALE_TASK_DEVICE", "")
    local = os.environ.get("TFSCALE_TASK_LOCAL_DEVICE", "/device:CPU:0")
    channel.send(READY)
    while True:
        try:
            message = channel.receive()
        except (EOFError, OSError):
            return 0
        if not message:
            return 0
        channel.send(_execute(message, device, local))


def _entry() -> Any:
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    _entry()
