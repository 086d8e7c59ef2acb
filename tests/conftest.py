"""Test session set-up: TensorFlow, when a test imports it, gets 4 logical CPU devices.

Importing the test package does not import TensorFlow: pure tests (advice, scheduler, hostlist,
projection, the launcher's decisions) never pay its start-up. The first ``import tensorflow``
of the pytest process, wherever it comes from, splits the CPU into 4 logical devices before
the runtime starts (through tfscale's import hook, ``tfscale/tf_import.py``), so tests pick 1,
2 or 4 of them. Tests that need another layout, a fresh runtime or several workers run code in
a child process (``tfscale.testing.run_python``).

Markers say what a test needs (``tests/README.md``): a test that imports TensorFlow in the
test process is marked ``tf``, one that starts a child process ``multiprocess``; an unmarked
test that does either fails here, so ``make check`` (``-m "not tf and not multiprocess"``)
stays fast and honest.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# One thread per TensorFlow op, in this process and every child it starts (workers, scripts):
# the pytest processes and their children share 2 cores, and TensorFlow's default per-op
# thread pool (one thread per core, spinning while it waits) made the same tests take 3x the
# wall time for the same CPU time (test_custom_loops.py: 147 s against 52 s, 42 s of CPU both).
# Results compared within a test run under the same setting.
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
# TensorFlow's oneDNN kernels (on by default on x86 CPUs) cost the suite's small models more
# than they save: the parity and Keras-features modules took 128 and 120 user CPU-s without
# them against 148 and 134 with them, run alternately (-n 2). A GPU, which the CPU stands in
# for, never runs them; results are compared within a run under the same setting. The tests of
# what a user sees (tests/cli/test_demo.py, tests/launch/test_jobs.py, tests/profiling/
# test_cli.py: no start-up chatter) unset it in their children, so the oneDNN notice is there
# to be dropped.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.pop("TF_CONFIG", None)
os.environ.pop("TFSCALE_VIRTUAL_DEVICES", None)

# numpy < 2 runs `lscpu` when numpy.testing is first imported (its SVE check, numpy
# gh-22982, `_SUPPORTS_SVE = check_support_sve()` at module level; numpy 2 calls it lazily):
# numpy's child process, not the test's. Imported here, before any test, so that the lowest
# versions' numpy (1.26, make test-lowest) does not fail whichever unmarked test first
# touches np.testing, as it did in a fresh lowest virtualenv.
import numpy.testing  # noqa: F401
import pytest

from tfscale.runtime import tf_import
from tfscale.testing import child_pids

NUM_TEST_DEVICES = 4


def _split_cpu() -> None:
    # Runs once TensorFlow has finished importing and before any op starts its runtime. It
    # calls TensorFlow directly: tfscale.devices.discovery may be the module whose import is
    # running.
    tf = sys.modules["tensorflow"]
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(NUM_TEST_DEVICES)]
    )


tf_import.on_import(_split_cpu)

# A module whose source marks all its tests as needing TensorFlow, read without importing it.
_MODULE_MARK = re.compile(r"^pytestmark\s*=\s*(\[[^\]]*\]|.*)$", re.MULTILINE)
_TF_MARK = re.compile(r"\bpytest\.mark\.tf\b")


def _deselects_tf(config: pytest.Config) -> bool:
    expression = config.getoption("markexpr") or ""
    return bool(re.search(r"\bnot\s+tf\b", expression))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m "not tf"`` a test module marked ``tf`` as a whole is not even imported, so
    collecting the fast tier never imports TensorFlow."""
    if collection_path.suffix == ".py" and _deselects_tf(config):
        try:
            marks = _MODULE_MARK.search(collection_path.read_text(encoding="utf-8"))
            if marks and _TF_MARK.search(marks.group(1)):
                return True
        except OSError:
            return None
    return None


def tier_problems(items: list[pytest.Item]) -> list[str]:
    """What is wrong with the ``full`` marks among ``items`` (every test collected, before
    ``-m`` deselects any): each ``full`` test names, as its marker's arguments, at least one
    node id of a ``make test`` test covering the same code path, which must exist and not be
    ``full`` itself. An equivalent in a file this session did not collect whole (another
    file run alone, or tests selected by node id) is judged by its file only."""
    ids = {item.nodeid: item for item in items}
    files = {nodeid.split("::")[0] for nodeid in ids}
    if items:
        # A file the session selected by node ids (one test run alone) was not collected
        # whole: its equivalents are judged by the file only, as an uncollected file's.
        rootpath = items[0].config.rootpath
        files -= {
            Path(arg.split("::")[0]).resolve().relative_to(rootpath).as_posix()
            for arg in items[0].config.args
            if "::" in arg and Path(arg.split("::")[0]).resolve().is_relative_to(rootpath)
        }
    problems = []
    for item in items:
        for mark in item.iter_markers("full"):
            if not mark.args or not all(isinstance(a, str) for a in mark.args) or mark.kwargs:
                problems.append(
                    f"{item.nodeid}: pytest.mark.full needs the node ids of its `make test` "
                    f"equivalents as arguments, got args={mark.args!r} kwargs={mark.kwargs!r}"
                )
                continue
            for equivalent in mark.args:
                file = equivalent.split("::")[0]
                if file not in files:
                    if not (item.config.rootpath / file).is_file():
                        problems.append(f"{item.nodeid}: no file {file} for {equivalent}")
                    continue
                found = ids.get(equivalent)
                if found is None:
                    problems.append(
                        f"{item.nodeid}: its `make test` equivalent {equivalent} does not exist"
                    )
                elif found.get_closest_marker("full") is not None:
                    problems.append(
                        f"{item.nodeid}: its equivalent {equivalent} is `full` too: name a "
                        "test that `make test` runs"
                    )
    return problems


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Refuses the session where a ``full`` test lacks its ``make test`` equivalent
    (:func:`tier_problems`); first, so that ``-m`` has not deselected the equivalents yet."""
    problems = tier_problems(items)
    if problems:
        raise pytest.UsageError("test tiers:\n" + "\n".join(problems))
    _late_but_not_last(items)


# Where the tests marked ``late`` (the 200-repeat thread tests) go, one before each of these
# modules in turn (the last takes any more): the in-process training suite's last modules run
# after and between them (sharded state, sparse updates, steps per call, the rest of the thread
# tests, XLA: about 150 CPU-s in all). They must run late in a long-lived process (after the
# training suite's fits: tests/training/test_threads.py); run last, they ended the suite alone
# (40-65 s), with the other pytest processes done. Both before one module, the second waited
# 176 s behind the first (pytest-xdist queues two more tests on a busy process) and ran alone
# for the suite's last 81 s (a `make test` with a per-test recorder); 44 tests apart (before
# XLA's), it started 114 s after the first and still ran alone for the last 41 s. With the
# sharded-state module between them, another process took the second 60 s after the first
# began, and the three processes ended within 16 s of each other, none alone for more than 2 s.
LATE_BEFORE = ("tests/training/test_sharded_state.py", "tests/training/test_sparse_updates.py")


def _late_but_not_last(items: list[pytest.Item]) -> None:
    """Moves the ``late`` tests, in their order, each to just before the first test of the
    next :data:`LATE_BEFORE` module collected (pytest-xdist hands tests out in this order; the
    last module takes the rest); where none of them is collected, leaves the order."""
    late = [item for item in items if item.get_closest_marker("late") is not None]
    rest = [item for item in items if item.get_closest_marker("late") is None]
    firsts = (
        next((i for i, item in enumerate(rest) if item.nodeid.startswith(module)), None)
        for module in LATE_BEFORE
    )
    anchors = [i for i in firsts if i is not None]
    if not anchors or not late:
        return
    placed: dict[int, list[pytest.Item]] = {}
    for index, item in enumerate(late):
        placed.setdefault(anchors[min(index, len(anchors) - 1)], []).append(item)
    items[:] = [moved for i, item in enumerate(rest) for moved in [*placed.get(i, []), item]]


# What the marker gates refused since the test began, as (marker, what): code that catches a
# refusal (a probe that records its failure) would go on without TensorFlow or without its
# child process, and pass or fail by which test ran before it in its process. The test fails
# in its teardown instead (_no_leftovers).
_REFUSED: list[tuple[str, str]] = []


class _TensorFlowGate:
    """Refuses ``import tensorflow`` / ``import keras`` during a test not marked ``tf``
    (the import fails at once, naming the marker, instead of after a slow test)."""

    refusing: str | None = None  # the node id of the running unmarked test

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if self.refusing and fullname.partition(".")[0] in ("tensorflow", "keras"):
            _REFUSED.append(("tf", f"its import of {fullname}"))
            raise ImportError(
                f"{self.refusing} imports {fullname}: mark it @pytest.mark.tf or "
                "`pytestmark = pytest.mark.tf` (tests/README.md)"
            )


_GATE = _TensorFlowGate()
sys.meta_path.insert(0, _GATE)  # type: ignore[arg-type]


def pytest_collectstart(collector: pytest.Collector) -> None:
    """Under ``-m "not tf"``, a test module that imports TensorFlow without being marked
    ``tf`` as a whole fails to collect, naming the marker."""
    if isinstance(collector, pytest.Module) and _deselects_tf(collector.config):
        _GATE.refusing = str(collector.path)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _GATE.refusing = None


def _refuse_children(nodeid: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> None:
        _REFUSED.append(("multiprocess", "its child process"))
        raise AssertionError(
            f"{nodeid} starts a child process: mark it @pytest.mark.multiprocess (tests/README.md)"
        )

    return refuse


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _needs_are_marked(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _needs_are_marked(item):
        outcome = yield
    if outcome.excinfo is not None:
        _REFUSED.clear()  # the test failed (a refusal that reached it names the marker)


@contextlib.contextmanager
def _needs_are_marked(item: pytest.Item) -> Iterator[None]:
    """While a test and its fixtures (of every scope) are set up and run: refuses ``import
    tensorflow`` if the test is not marked ``tf``, and starting a child process if it is not
    marked ``multiprocess``, each with an error naming the marker. Teardown is not watched: a
    session fixture (the Slurm cluster's daemons) is torn down after whichever test ran last."""
    marks = {mark.name for mark in item.iter_markers()}
    if "tf" in marks and "keras" not in sys.modules:
        # TensorFlow's first import runs helper processes of its own (ctypes.util's library
        # search calls ldconfig): done before the child-process gate, as a tf test may.
        import keras  # noqa: F401
    saved = (subprocess.Popen._execute_child, os.fork)  # type: ignore[attr-defined]
    if "multiprocess" not in marks:
        subprocess.Popen._execute_child = _refuse_children(item.nodeid)  # type: ignore[attr-defined]
        os.fork = _refuse_children(item.nodeid)
    if "tf" not in marks:
        _GATE.refusing = item.nodeid
    try:
        yield
    finally:
        subprocess.Popen._execute_child, os.fork = saved  # type: ignore[attr-defined]
        _GATE.refusing = None


# A fit's iterators are destroyed in threads of their own (training/data.py RELEASE_THREAD,
# FitInputs): destroying one waits for tf.data's threads, up to the iterator's age (60 s at
# most: the lost wake-up of docs/ARCHITECTURE.md's known problems) with the CPU idle. A test
# does not wait for them (its caller would not either): they are waited for at the end of
# the session, and one still running then fails it.
_RELEASE = "tfscale-input-release"
_RELEASE_DEADLINE_S = 120.0


@pytest.fixture(scope="session", autouse=True)
def _releases_end() -> Iterator[None]:
    """Fails the session if an input-release thread outlives it by 120 s."""
    yield
    deadline = time.monotonic() + _RELEASE_DEADLINE_S
    releases = [t for t in threading.enumerate() if t.name == _RELEASE]
    for thread in releases:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t for t in releases if t.is_alive()]
    assert not stuck, f"{len(stuck)} input-release thread(s) still running after the session"


@pytest.fixture(autouse=True)
def _no_leftovers() -> Iterator[None]:
    """Fails a test that leaves a child process or a Python thread behind (after collecting
    the garbage it left), or that went on after a marker gate refused it TensorFlow or a child
    process."""
    threads_before = set(threading.enumerate())
    children_before = child_pids()
    _REFUSED.clear()
    yield
    if _REFUSED:
        marker, what = _REFUSED[0]
        pytest.fail(
            f"the test went on after {what} was refused: mark it @pytest.mark.{marker} "
            "(tests/README.md)"
        )
    if "tensorflow" in sys.modules:
        # The test's garbage is collected now, and what survives is frozen (never scanned
        # again). A tf.data iterator left in a reference cycle (a model's, an error's) is
        # destroyed young, not minutes later wherever the collector runs: destroying an old
        # one can wait up to 60 s for its autotuning thread (docs/ARCHITECTURE.md, known
        # problems; 140 s in one test of one make test run). And the collector's full passes
        # no longer walk every earlier test's survivors: on the parity, Keras-features,
        # inputs, custom-loop and checkpoint modules (-n 2), 215 s and 299 user CPU-s before,
        # 144 s and 219 after.
        gc.collect()
        gc.freeze()
    deadline = time.monotonic() + 5.0
    while True:
        threads = [
            t
            for t in threading.enumerate()
            if t not in threads_before and t.is_alive() and not t.daemon and t.name != _RELEASE
        ]
        children = child_pids() - children_before
        if (not threads and not children) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not threads, f"test left threads running: {[t.name for t in threads]}"
    assert not children, f"test left child processes running: {sorted(children)}"


@pytest.fixture
def cpu_devices() -> list[str]:
    """The names of the session's logical CPU devices (the test imports TensorFlow)."""
    return [f"/device:CPU:{i}" for i in range(NUM_TEST_DEVICES)]
