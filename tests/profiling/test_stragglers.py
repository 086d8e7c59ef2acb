"""The straggler of a multi-worker job: decided from per-worker step records (pure), and one
2-worker ``tfscale profile -n 2`` run whose worker 1 sleeps in its input pipeline."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tfscale.profiling.report import to_markdown
from tfscale.profiling.script import merge_workers
from tfscale.profiling.stragglers import WorkerStep, judge
from tfscale.testing import run_python


def test_a_worker_that_waits_for_its_input_is_the_straggler_wall_clock() -> None:
    # Wall-clock: worker 1 waits 200 ms for each batch; worker 0's call waits as long for it
    # in the all-reduce (the calls' difference is the wait: equal compute assumed).
    steps = [
        WorkerStep(0, 0.207, 0.001, 0.206, 0.0),
        WorkerStep(1, 0.207, 0.201, 0.006, 0.0),
    ]
    table, straggler = judge(steps)
    assert straggler is not None
    assert (straggler.worker, straggler.cause) == (1, "input-bound")
    assert straggler.advice.key == "straggler" and "Worker 1" in straggler.advice.text
    assert "input" in straggler.advice.text
    assert [r.wait_s for r in table] == pytest.approx([0.2, 0.0])
    assert [r.compute_s for r in table] == pytest.approx([0.006, 0.006])


def test_a_worker_with_slow_compute_is_the_straggler_with_a_trace() -> None:
    # Trace: worker 0 computes 3x longer; worker 1 spends that time in the collective.
    steps = [
        WorkerStep(0, 0.032, 0.001, 0.027, 0.004, "trace"),
        WorkerStep(1, 0.032, 0.001, 0.009, 0.022, "trace"),
        WorkerStep(2, 0.032, 0.001, 0.009, 0.022, "trace"),
    ]
    table, straggler = judge(steps)
    assert straggler is not None and (straggler.worker, straggler.cause) == (0, "compute-bound")
    assert [r.wait_s for r in table] == pytest.approx([0.0, 0.018, 0.018])
    assert [r.communication_s for r in table] == pytest.approx([0.004] * 3)


def test_a_balanced_job_or_one_worker_names_no_straggler() -> None:
    balanced = [
        WorkerStep(0, 0.016, 0.001, 0.006, 0.009, "trace"),
        WorkerStep(1, 0.016, 0.001, 0.0075, 0.0075, "trace"),
    ]
    assert judge(balanced)[1] is None
    assert judge(balanced[:1])[1] is None


def _part(step: float, fetch: float, compute: float, comm: float) -> dict[str, object]:
    fit = {
        "steps_measured": 10,
        "mean_step_s": step,
        "input_s": fetch,
        "compute_s": compute,
        "communication_s": comm,
        "method": "wall-clock",
        "batch_size": 32,
        "replicas": 2,
        "trace_shares": {},
        "kind": "loop",
    }
    return {"status": 0, "device_kind": "CPU", "physical_devices": 2, "fits": [fit]}


def test_merged_report_has_a_row_per_worker_and_the_straggler_first() -> None:
    parts = {0: _part(0.207, 0.001, 0.206, 0.0), 1: _part(0.207, 0.201, 0.006, 0.0)}
    report = merge_workers(parts, "train.py")
    assert [r.worker for r in report.workers] == [0, 1]
    assert report.straggler is not None and report.straggler.worker == 1
    assert report.advice[0].key == "straggler"
    assert report.settings["workers"] == 2
    markdown = to_markdown(report)
    assert "| worker | step ms |" in markdown and "worker 1, input-bound" in markdown


def test_a_script_that_failed_before_a_step_is_told_from_one_that_ran_none() -> None:
    from tfscale.errors import ProfileError
    from tfscale.profiling.script import measured, script_report

    failed = {"status": 1, "device_kind": "CPU", "physical_devices": 2, "fits": []}
    assert not measured(failed) and measured(_part(0.2, 0.0, 0.2, 0.0))
    with pytest.raises(ProfileError, match=r"failed \(exit status 1\) before a training step"):
        script_report(failed, "train.py")
    with pytest.raises(ProfileError, match="ran no measurable training step"):
        script_report({**failed, "status": 0}, "train.py")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.full(
    "tests/profiling/test_stragglers.py::"
    "test_profile_of_two_workers_names_the_one_whose_input_sleeps",
)
def test_profile_of_workers_that_fail_shows_their_error(tmp_path: Path) -> None:
    # The workers' output goes to files; their error must reach the user, not "run it for
    # more steps".
    (tmp_path / "job.py").write_text('raise SystemExit("bad config: no such bucket")\n')
    code = """
import sys
from tfscale.cli.main import main
sys.exit(main(["profile", "-n", "2", "--timeout", "120", "job.py"]))
"""
    done = run_python(code, timeout=180, cwd=str(tmp_path))
    assert done.returncode == 2, done.stderr[-4000:]
    assert "failed (exit status 1) before any worker measured a training step" in done.stderr
    assert "bad config: no such bucket" in done.stderr


_SLOW_INPUT_JOB = textwrap.dedent(
    """
    import json, os, sys, time
    import keras, numpy as np, tensorflow as tf
    from tensorflow.python.data.experimental.ops import testing
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    SLEEP = 0.2 if index == 1 else 0.0  # worker 1's input pipeline: 0.2 s per batch
    if index == 0 and not os.path.exists("crashed-once"):
        # TensorFlow's profiler aborting worker 0 as it stops the trace, as it did in CI
        # (munmap_chunk(): invalid pointer; tensorflow/tensorboard#3149), made certain once.
        open("crashed-once", "w").close()
        tf.profiler.experimental.stop = lambda *args, **kwargs: os.abort()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)

    def dataset_fn(context):
        x = np.random.default_rng(index).standard_normal((12 * 16, 8)).astype("float32")
        batches = tf.data.Dataset.from_tensor_slices(x).batch(16)
        if SLEEP:
            # A wait in the pipeline's own threads, not in Python: TensorFlow's profiler can
            # crash when it stops a trace while another thread runs Python, as a
            # from_generator input's does (tensorflow/tensorboard#3149; docs/profiling.md).
            # tf.data's own sleep (its testing transformation) waits without using a core:
            # the earlier busy-wait kept one core spinning, and on the 2 shared cores of
            # make test it stretched worker 0's compute until no straggler stood out.
            batches = batches.apply(testing.sleep(int(SLEEP * 1e6)))
        return batches

    def replica_step(x):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(tf.reduce_sum(model(x) ** 2, axis=1))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step(x):
        return strategy.run(replica_step, args=(x,))

    for x in strategy.distribute_datasets_from_function(dataset_fn):
        train_step(x)
    """
)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_profile_of_two_workers_names_the_one_whose_input_sleeps(tmp_path: Path) -> None:
    # Worker 0 crashes as its trace stops, once: the job runs again, traced, and the report
    # names the straggler, with a note that says so.
    (tmp_path / "job.py").write_text(_SLOW_INPUT_JOB)
    code = f"""
import sys
from tfscale.cli.main import main
sys.exit(main(["profile", "-n", "2", "--trace-steps", "3,9", "--timeout", "240",
               "--out", {str(tmp_path / "out")!r}, "job.py"]))
"""
    done = run_python(code, timeout=300, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-8000:]
    assert "A worker crashed (exit status 134) while traced: running the job again." in done.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [w["worker"] for w in report["workers"]] == [0, 1]
    note = report["notes"][0]
    if "without a trace" in note:
        # The upstream crash, a race, struck the second, traced run as well:
        # the numbers come from a third run, untraced, which says so; across workers such a run
        # cannot tell input from waiting for the other worker (docs/profiling.md).
        assert "exit status 134, " in note and "run 3" in note, note
        return
    assert report["straggler"] is not None, (report["notes"], done.stderr[-3000:])
    assert report["straggler"]["worker"] == 1
    assert report["straggler"]["cause"] == "input-bound"
    assert report["advice"][0]["key"] == "straggler"
    assert "Straggler: worker 1, input-bound" in done.stdout
    assert "exit status 134" in note and "from a second run" in note, note
    # The trace windows of the second run stay, one TensorBoard run per worker.
    for worker in ("worker-0", "worker-1"):
        assert list((tmp_path / "out" / "trace" / worker).glob("plugins/profile/*/*.xplane.pb"))


def test_launch_profile_runs_each_worker_under_the_profiler_writing_its_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from tfscale.cli.launch import _profiled
    from tfscale.profiling.script import worker_output

    args = argparse.Namespace(profile=str(tmp_path / "parts"))
    command = _profiled(args, ("train.py", "--epochs", "1"))
    folder = str(tmp_path / "parts") + "/"
    assert command == (
        "-m",
        "tfscale.profiling.script",
        folder,
        "5",
        "10",
        "train.py",
        "--epochs",
        "1",
    )
    assert _profiled(argparse.Namespace(profile=None), ("train.py",)) == ("train.py",)
    config = {"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    assert worker_output(folder) == folder + "worker-1.json"
    assert worker_output(str(tmp_path / "steps.json")) == str(tmp_path / "steps.json")


def test_profile_merge_builds_one_report_from_the_workers_parts(tmp_path: Path) -> None:
    from tfscale.cli.main import main

    parts = tmp_path / "parts"
    parts.mkdir()
    for index, part in ((0, _part(0.2, 0.001, 0.199, 0.0)), (1, _part(0.2, 0.2, 0.0, 0.0))):
        (parts / f"worker-{index}.json").write_text(json.dumps(part))
    assert main(["profile", "--merge", str(parts), "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["straggler"]["worker"] == 1 and report["straggler"]["cause"] == "input-bound"
    assert main(["profile", "--merge", str(tmp_path / "empty"), "--out", str(tmp_path)]) == 2


def test_a_crash_while_traced_is_told_from_other_failures() -> None:
    from tfscale.profiling.script import crash_retries, crashed, trace_crash_note
    from tfscale.profiling.timeline import traced

    # -11/-6: a child killed by SIGSEGV/SIGABRT; 139/134: the launcher's status for one; or
    # faulthandler's line where the status says less.
    for status, output in (
        (-11, ""),
        (-6, ""),
        (139, ""),
        (134, ""),
        (1, "Fatal Python error: Abort"),
    ):
        assert crashed(status, output)
    assert not crashed(1, "ValueError: bad input") and not crashed(0) and not crashed(None)
    assert not crashed(137)  # SIGKILL: the timeout's, not a crash
    assert traced((3, 9)) and not traced((0, 0)) and not traced((5, 5))
    assert crash_retries((3, 9)) == [(3, 9), (0, 0)] and crash_retries((0, 0)) == []
    once = trace_crash_note("A worker", [134], (3, 9))
    assert "exit status 134" in once and "steps 3-9" in once and "#3149" in once
    assert "from a second run" in once and "without a trace" not in once
    twice = trace_crash_note("A worker", [134, -11], (3, 9))
    assert "exit status 134, -11" in twice and "run 3, without a trace" in twice
