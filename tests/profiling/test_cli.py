"""``tfscale bench`` and ``tfscale profile`` end to end, in one fresh process (own devices)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tfscale.processes import Completed
from tfscale.profiling.projection import interconnect, project
from tfscale.runtime.chatter import is_chatter
from tfscale.testing import run_python

_SCRIPT = textwrap.dedent(
    """
    import sys
    import keras, numpy as np, tensorflow as tf
    from neighbour import WIDTH  # sub/neighbour.py, next to the script
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(WIDTH, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    data = tf.data.Dataset.from_tensor_slices(
        (rng.standard_normal((1024, 32)).astype("float32"), rng.integers(0, 10, 1024))
    ).batch(64)
    model.fit(data, epochs=int(sys.argv[1]), verbose=0)
    """
)

# The README's path: tfscale.fit on arrays, the batch only in the call, no strategy named.
_TFSCALE_FIT_SCRIPT = textwrap.dedent(
    """
    import keras, numpy as np
    import tfscale
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((1024, 32)).astype("float32"), rng.integers(0, 10, 1024)
    tfscale.fit(model, x, y, batch_size=48, epochs=2, verbose=0)
    """
)

# Exits 3 after its fit; and TensorFlow's profiler aborts the process each time it stops the
# trace, the upstream crash (tensorflow/tensorboard#3149) made certain: profile runs it again
# traced, then untraced.
_CRASHING_SCRIPT = textwrap.dedent(
    """
    import os
    import keras, numpy as np, tensorflow as tf
    tf.profiler.experimental.stop = lambda *args, **kwargs: os.abort()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(np.zeros((320, 4), "float32"), np.zeros((320, 1), "float32"), verbose=0)
    raise SystemExit(3)
    """
)


def _commands(code: str, folder: Path) -> Completed:
    """Runs ``code`` (tfscale commands through ``main``) in a fresh process on 2 logical CPUs,
    in ``folder``, with TensorFlow's logging at its defaults, as for a user; fails on any
    TensorFlow start-up chatter it prints, from the commands or from profile's children."""
    done = run_python(
        code,
        env={
            "TFSCALE_VIRTUAL_DEVICES": "2",
            "TF_CPP_MIN_LOG_LEVEL": "",
            "TF_ENABLE_ONEDNN_OPTS": "",
        },
        timeout=240,
        cwd=str(folder),
    )
    lines = (done.stdout + done.stderr).splitlines()
    assert not [line for line in lines if is_chatter(line) or "oneDNN" in line]
    return done


@pytest.mark.multiprocess
@pytest.mark.slow
# make test profiles a script through the same command (a custom loop's, test_loops) and 2
# workers' (test_stragglers), and measures and judges a bench in-process (test_bench).
@pytest.mark.full(
    "tests/profiling/test_loops.py::test_profile_reports_a_custom_loop_like_fit",
    "tests/profiling/test_stragglers.py::"
    "test_profile_of_two_workers_names_the_one_whose_input_sleeps",
    "tests/profiling/test_bench.py::test_injected_input_delay_is_reported_as_input_share",
)
def test_bench_and_profile_commands_write_reports(tmp_path: Path) -> None:
    # `tfscale profile sub/train.py` runs the script as `python sub/train.py` would (and as
    # `doctor --script` does): its folder is on sys.path, so it imports its neighbours.
    (tmp_path / "sub").mkdir()
    script = tmp_path / "sub" / "train.py"
    script.write_text(_SCRIPT)
    (tmp_path / "sub" / "neighbour.py").write_text("WIDTH = 64\n")
    (tmp_path / "tfit.py").write_text(_TFSCALE_FIT_SCRIPT)
    code = f"""
    import sys
    from tfscale.cli.main import main
    bench = main(["bench", "--model", "mlp", "--replicas", "1,2", "--steps", "5",
                  "--warmup", "2", "--trace-steps", "2", "--out", {str(tmp_path / "bench")!r},
                  "--project", "8,64", "--interconnect", "roce-25g"])
    profile = main(["profile", "--out", {str(tmp_path / "profile")!r}, "--trace-steps", "4,8",
                    "sub/train.py", "2"])
    tfit = main(["profile", "--out", {str(tmp_path / "tfit")!r}, "tfit.py"])
    sys.exit(bench * 100 + profile * 10 + tfit)
    """
    done = _commands(code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # bench says what it measured as it goes, one line per configuration (no terminal here:
    # the progress bar is not drawn, the lines are).
    assert "Measuring mlp on CPU" in done.stderr
    assert "weak scaling, 2 replica(s), batch 64/replica, accumulation 1:" in done.stderr
    bench = json.loads((tmp_path / "bench" / "report.json").read_text())
    modes = {(p["mode"], p["replicas"]) for p in bench["points"]}
    assert modes == {
        ("weak", 1),
        ("weak", 2),
        ("strong", 1),
        ("strong", 2),
        ("projected", 8),
        ("projected", 64),
    }
    # Projected rows: marked, with the assumptions they rest on, in every report file.
    projected = [p for p in bench["points"] if p["mode"] == "projected"]
    assumptions = bench["settings"]["projection"]
    assert assumptions["inter"]["name"] == "roce-25g" and assumptions["model"] == "ring all-reduce"
    weak1 = next(p for p in bench["points"] if p["mode"] == "weak" and p["replicas"] == 1)
    for p in projected:
        assert p["method"] == "alpha-beta" and p["compute_ms"] == pytest.approx(
            assumptions["local_step_ms"]
        )
        # The alpha-beta model's own figures for the report's stated assumptions.
        (row,) = project(
            local_step_s=assumptions["local_step_ms"] / 1000,
            gradient_bytes=bench["settings"]["gradient_bytes"],
            batch_per_replica=p["batch_per_replica"],
            replicas=[p["replicas"]],
            inter=interconnect("roce-25g"),
        )
        assert p["communication_ms"] == pytest.approx(row.allreduce_s * 1000)
        assert p["efficiency"] == pytest.approx(row.efficiency)
    assert assumptions["local_step_ms"] == pytest.approx(
        weak1["step_ms"] - weak1["communication_ms"]
    )
    assert projected[1]["efficiency"] < projected[0]["efficiency"]
    assert bench["settings"]["alpha_beta"]["beta_s_per_byte"] > 0
    assert any(
        "Projected rows (mode 'projected') are not measurements" in n for n in bench["notes"]
    )
    markdown = (tmp_path / "bench" / "report.md").read_text()
    assert "| projected | 64 |" in markdown
    assert "projected" in (tmp_path / "bench" / "report.html").read_text()
    weak2 = next(p for p in bench["points"] if p["mode"] == "weak" and p["replicas"] == 2)
    assert weak2["trace_shares"] and abs(sum(weak2["trace_shares"].values()) - 1) < 1e-6
    assert bench["collectives"][0]["busbw"] == bench["collectives"][0]["algbw"]  # 2 ranks
    assert "Report:" in done.stdout and (tmp_path / "bench" / "report.html").exists()
    profiled = json.loads((tmp_path / "profile" / "report.json").read_text())
    # model.fit over the script's 2 devices, compared with the same script on 1 replica
    # (its MirroredStrategy placed on one device) at the same global batch.
    one, point = profiled["points"]
    assert (one["replicas"], one["global_batch"], one["speedup"]) == (1, 64, 1.0)
    assert point["mode"] == "script" and point["replicas"] == 2 and point["global_batch"] == 64
    assert point["speedup"] == point["examples_per_s"] / one["examples_per_s"]
    assert profiled["settings"] == {"fit_calls": 1, "exit_status": 0, "reference_exit_status": 0}
    # Mirrored over 2 devices: the trace sees the all-reduce and the input fetch.
    # Which event classes the trace holds (every event lasts): compute, and the all-reduce
    # or the input fetch.
    classes = {kind for kind, share in point["trace_shares"].items() if share}
    assert point["method"] == "trace" and "compute" in classes
    assert classes & {"communication", "input"}
    # tfscale.fit (its strategy chosen over the 2 logical devices the runner split the CPU
    # into): the batch it was called with, non-zero examples/s, and the comparison.
    tfit = json.loads((tmp_path / "tfit" / "report.json").read_text())
    one, two = tfit["points"]
    assert (one["replicas"], two["replicas"]) == (1, 2)
    assert one["global_batch"] == two["global_batch"] == 48
    assert two["method"] == "trace" and two["speedup"] == pytest.approx(
        two["examples_per_s"] / one["examples_per_s"]
    )
    assert any("Compared with the same script on 1 replica" in n for n in tfit["notes"])


@pytest.mark.multiprocess
@pytest.mark.slow
# Three runs of a script (traced, traced again, untraced): make test has the same retries in
# the 2-worker profile whose worker 0 aborts as its trace stops, and their judgement in-process.
@pytest.mark.full(
    "tests/profiling/test_stragglers.py::"
    "test_profile_of_two_workers_names_the_one_whose_input_sleeps",
    "tests/profiling/test_stragglers.py::test_a_crash_while_traced_is_told_from_other_failures",
)
def test_profile_of_a_script_that_crashes_while_traced_and_exits_3(tmp_path: Path) -> None:
    (tmp_path / "crash.py").write_text(_CRASHING_SCRIPT)
    code = f"""
    import sys
    from tfscale.cli.main import main
    sys.exit(main(["profile", "--no-compare", "--out", {str(tmp_path / "crash")!r}, "crash.py"]))
    """
    done = _commands(code, tmp_path)
    # The crashing script's own status (3) is the command's: the report does not hide it.
    assert done.returncode == 3, done.stderr[-3000:]
    # A script that exits 3 after training: status 3 recorded, its steps still reported.
    crash = json.loads((tmp_path / "crash" / "report.json").read_text())
    assert crash["settings"]["exit_status"] == 3
    assert any("exited with status 3" in n for n in crash["notes"])
    assert "crashed (exit status -6) while traced: running it again." in done.stderr
    assert "crashed (exit status -6) while traced: running it again without a trace." in done.stderr
    assert "run 3, without a trace" in crash["notes"][0] and "#3149" in crash["notes"][0]


@pytest.mark.parametrize(
    "window", ["10,5", "abc", "-1,4", "5;10"], ids=["reversed", "text", "negative", "separator"]
)
def test_profile_refuses_a_trace_window_it_cannot_use_before_running(
    window: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tfscale.cli.main import main

    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    assert main(["profile", f"--trace-steps={window}", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tfscale: ProfileError: --trace-steps is a window")
    assert f"Received: {window}" in err and "Traceback" not in err
