"""The allocator's measured peak beside the plan, read where bench and profile read it: logical
CPUs share one BFC allocator (checked here first), and a profiled fit records both."""

from __future__ import annotations

import json

import pytest

from tfscale.testing import run_python

pytestmark = [pytest.mark.multiprocess]

_ENV = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}


def test_logical_cpus_share_one_allocator_and_a_profiled_fit_records_plan_and_peak() -> None:
    code = """
import json
import numpy as np
import keras
import tensorflow as tf
import tfscale

# 4 MiB placed on CPU:1 shows on CPU:0: one allocator; resetting one resets both.
tf.config.experimental.reset_memory_stats("CPU:0")
with tf.device("/cpu:1"):
    held = tf.ones([1024, 1024])
shared = [tf.config.experimental.get_memory_info(d)["current"] for d in ("CPU:0", "CPU:1")]

strategy = tfscale.choose_strategy().strategy
with strategy.scope():
    inputs = keras.Input((256,))  # 1.3 M weights: the step, not the runtime, holds the bytes
    h = keras.layers.Dense(1024, activation="relu")(inputs)
    h = keras.layers.Dense(1024, activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(4)(h))
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
rng = np.random.default_rng(1)
x = rng.standard_normal((2048, 256)).astype("float32")
y = rng.integers(0, 4, 2048)
callback = tfscale.ProfileCallback(batch_size=256, warmup=2)
tfscale.fit(model, x, y, batch_size=256, epochs=1, verbose=0, callbacks=[callback])
print("RESULT " + json.dumps({"shared": shared, "memory": callback.summary()["memory"]}))
"""
    done = run_python(code, virtual_devices=2, env=_ENV, timeout=180)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["shared"][0] == result["shared"][1] >= 4 * 2**20
    memory = result["memory"]
    plan = memory["plan"]
    assert [d["device"] for d in plan["devices"]] == ["/device:CPU:0", "/device:CPU:1"]
    assert plan["options"]["batch_per_replica"] == 128
    (measured,) = memory["measured"]
    assert measured["devices"] == ["/device:CPU:0", "/device:CPU:1"]
    # The steps' own peak: at least the variables the plan counts (both replicas' weights
    # and Adam's moments), which were held when the measured steps began.
    held = sum(d["weights_bytes"] + d["optimizer_bytes"] for d in plan["devices"])
    assert measured["start_bytes"] >= held
    assert measured["peak_bytes"] > measured["start_bytes"]
    assert 0.6 <= measured["planned_over_measured"] <= 1.5
