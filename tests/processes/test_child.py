"""The process layer with real processes (no TensorFlow): exit codes, groups, parent death."""

from __future__ import annotations

import contextlib
import gc
import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tfscale.processes import PIPE, Channel, start
from tfscale.processes import run as run_command
from tfscale.testing import alive

pytestmark = pytest.mark.multiprocess

_SRC = str(Path(__file__).resolve().parents[2] / "src")


def _gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("pass", 0),
        ("raise SystemExit(3)", 3),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL),
        ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM),
    ],
)
def test_the_childs_exit_status_is_the_commands(code: str, expected: int) -> None:
    assert run_command(_py(code), timeout=30).returncode == expected


def test_a_command_that_cannot_start_ends_with_127_and_says_why() -> None:
    done = run_command(["tfscale-no-such-command"], timeout=30)
    assert done.returncode == 127
    assert "cannot start 'tfscale-no-such-command'" in done.stderr


def test_output_lines_get_the_prefix_and_a_timeout_kills_the_group() -> None:
    sink = io.StringIO()
    with start(
        _py("print('out'); import sys; print('err', file=sys.stderr)"), prefix="[w] ", sink=sink
    ) as child:
        assert child.wait(30) == 0
    assert sorted(sink.getvalue().splitlines()) == ["[w] err", "[w] out"]
    # The background sleep holds the output pipe: without the group kill, run would wait
    # for it. Its pid is printed first; after the timeout it must be gone too.
    done = run_command(["sh", "-c", "sleep 60 & echo $!; sleep 60"], timeout=1)
    assert done.timed_out and done.returncode == -signal.SIGKILL
    background = int(done.stdout.split()[0])
    assert _gone([background], 10), "the group's other child survived"


def test_terminate_reaches_the_childs_own_children(tmp_path: Path) -> None:
    marker = tmp_path / "pids"
    code = f"""
        import os, subprocess, time
        child = subprocess.Popen(["sleep", "60"])
        open({str(marker)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(60)
    """
    with start(_py(code)) as child:
        assert _exists(marker, 30)
        pids = [int(p) for p in marker.read_text().split()]
        assert child.stop(grace_s=5) == -signal.SIGTERM
    assert _gone(pids, 10)


def _exists(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return path.exists()


# The parent starts one child from a thread that then ends (Linux sends the parent-death
# signal when that *thread* exits: the child must live on), one from the main thread, and
# optionally forks a process that keeps the lifeline's write end open (then only the
# parent-death signal can tell). The test SIGKILLs the parent.
_PARENT = """
import os, sys, threading, time
from tfscale.processes import start
children = []
def spawn():
    children.append(start(["sh", "-c", "sleep 60 & sleep 60"]))
thread = threading.Thread(target=spawn)
thread.start()
thread.join()
children.append(start(["sleep", "60"]))
if sys.argv[1] == "fork" and os.fork() == 0:
    time.sleep(30)
    os._exit(0)
print(" ".join(str(c.pid) for c in children), flush=True)
time.sleep(60)
"""


def _group(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                members.append(int(entry))
    return members


@pytest.mark.parametrize("holder", ["none", "fork"])
def test_children_die_with_a_sigkilled_parent_but_not_with_the_thread_that_started_them(
    holder: str,
) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, holder],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=_SRC),
        start_new_session=True,
    )
    try:
        assert parent.stdout is not None
        groups = [int(p) for p in parent.stdout.readline().split()]
        time.sleep(0.5)
        members = [pid for group in groups for pid in _group(group)]
        # 2 guards, sh with its 2 sleeps, 1 sleep: alive though the spawning thread ended
        assert len(members) == 6, members
        parent.kill()
        parent.wait(30)
        assert _gone(members, 10), [p for p in members if alive(p)]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)  # the forked holder, if any
        parent.wait(30)
        if parent.stdout is not None:
            parent.stdout.close()


def test_a_child_dropped_without_close_is_stopped() -> None:
    child = start(["sleep", "60"])
    guard = child.pid
    deadline = time.monotonic() + 10
    while len(_group(guard)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    members = _group(guard)
    del child
    gc.collect()
    assert _gone(members, 10)
    # The guard was this process's child: reap it (gone above, so this cannot block long).
    deadline = time.monotonic() + 10
    while os.waitpid(guard, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_channel_carries_messages_to_a_worker_and_back() -> None:
    channel, ends = Channel.pair()
    code = """
        import sys
        from tfscale.processes import Channel
        channel = Channel.from_fds(int(sys.argv[1]), int(sys.argv[2]))
        channel.send(channel.receive()[::-1])
    """
    try:
        child = start([*_py(code), *map(str, ends.fds)], pass_fds=ends.fds, stdout=PIPE)
    finally:
        ends.close()
    with child:
        channel.send(b"abc")
        assert channel.poll(30) and channel.receive() == b"cba"
        assert child.wait(30) == 0
        with pytest.raises(EOFError):
            channel.receive()
    channel.close()
