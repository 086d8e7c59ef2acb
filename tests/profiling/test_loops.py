"""``tfscale profile`` on a custom training loop: its steps found (the ``tf.function`` around
``strategy.run``), timed, split and compared with one replica, as for ``fit``."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tfscale.testing import run_python

pytestmark = pytest.mark.tf

# TensorFlow's distributed-training tutorial's shape: the optimizer built in the scope, a
# tf.function around strategy.run, the loop over a distributed dataset.
LOOP_SCRIPT = textwrap.dedent(
    """
    import sys
    import keras, numpy as np, tensorflow as tf
    strategy = tf.distribute.MirroredStrategy()
    GLOBAL = 64
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    rng = np.random.default_rng(0)
    data = tf.data.Dataset.from_tensor_slices(
        (rng.standard_normal((512, 32)).astype("float32"), rng.integers(0, 10, 512))
    ).batch(GLOBAL, drop_remainder=True)
    dist = strategy.experimental_distribute_dataset(data)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_example = loss_fn(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step(batch):
        return strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None)

    for epoch in range(int(sys.argv[1])):
        for batch in dist:
            train_step(batch)
    """
)


def test_a_loop_step_is_the_gap_as_input_and_the_call_or_the_trace_shares() -> None:
    from tfscale.profiling.loopsteps import LoopSteps

    class Strategy:
        num_replicas_in_sync = 2

    steps = LoopSteps(Strategy(), batch_size=64)
    steps.step_s, steps.fetch_s = [0.5, 0.5, 0.5], [0.1, 0.1, 0.1]
    plain = steps.breakdown()
    assert (plain.method, plain.communication_s) == ("wall-clock", 0.0)
    assert plain.input_s == pytest.approx(0.1)
    assert plain.compute_s == pytest.approx(0.4)
    steps.trace_shares = {"input": 0.0, "compute": 0.5, "communication": 0.25, "other": 0.25}
    traced = steps.breakdown()  # the marker spans fetch and call: shares of the whole step
    assert traced.method == "trace" and traced.input_s == 0.0
    assert (traced.compute_s, traced.communication_s) == pytest.approx((0.375, 0.125))
    assert steps.replicas == 2 and steps.summary()["examples_per_s"] == pytest.approx(128)
    # --trace-steps 0,0 (or FIRST alone) is no trace at all, not a trace of step 0.
    for window in ((0, 0), (4, 4)):
        assert LoopSteps(Strategy(), trace_steps=window).trace_steps is None
    assert LoopSteps(Strategy(), trace_steps=(3, 6)).trace_steps == (3, 6)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_profile_reports_a_custom_loop_like_fit(tmp_path: Path) -> None:
    (tmp_path / "loop.py").write_text(LOOP_SCRIPT)
    code = f"""
import sys
from tfscale.cli.main import main
sys.exit(main(["profile", "--out", {str(tmp_path / "out")!r}, "--trace-steps", "3,6",
               "loop.py", "2"]))
"""
    done = run_python(code, timeout=300, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    # Both runs found the loop's step function: 2 replicas, compared with 1 at batch 64.
    one, point = report["points"]
    assert (one["replicas"], one["global_batch"]) == (1, 64)
    assert (point["replicas"], point["global_batch"], point["mode"]) == (2, 64, "script")
    assert point["speedup"] == pytest.approx(point["examples_per_s"] / one["examples_per_s"])
    assert point["method"] == "trace" and point["trace_shares"]
    assert any("Compared with the same script on 1 replica" in n for n in report["notes"])
    # The trace windows stay, one TensorBoard run per process (its profile plugin reads them).
    for run in ("script", "one-replica"):
        assert list((tmp_path / "out" / "trace" / run).glob("plugins/profile/*/*.xplane.pb"))
