"""A TaskPool(backend="process") owner for the lifetime tests.

Usage: pool_owner.py OUT_DIR MODE. Starts a pool of 2 worker processes, gives each a task
that writes ``OUT_DIR/task-<pid>`` and sleeps 120 s, writes ``OUT_DIR/ready`` once both run,
then: ``return`` returns from main without ``shutdown()`` once ``OUT_DIR/go`` exists (the
interpreter exits), ``wait`` sleeps (the test signals it).
"""

import os
import sys
import time
from pathlib import Path

from tfscale.tasks import TaskPool


def hold(out_dir: str) -> None:
    Path(out_dir, f"task-{os.getpid()}").write_text("")
    time.sleep(120)


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    pool = TaskPool(["/device:CPU:0"], backend="process", workers_per_device=2)
    for _ in range(2):
        pool.submit(hold, str(out))
    deadline = time.monotonic() + 120
    while len(list(out.glob("task-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    (out / "ready").write_text(str(os.getpid()))
    if mode == "wait":
        time.sleep(120)
    while not (out / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
