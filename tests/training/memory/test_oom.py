"""A step that runs out of memory ends in tfscale's OutOfMemoryError: the device, the plan's
breakdown, at least two fixes whose predicted bytes fit, and the last checkpoint.

The out-of-memory error is TensorFlow's own: each child caps the CPU's BFC allocator
(``TF_CPU_BFC_MEM_LIMIT_IN_MB=130``, two logical CPUs sharing it) and trains an MLP whose
per-replica batch of 4096 needs 158-192 MiB over both (measured with and without oneDNN;
planned: 209 MiB).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tfscale.testing import descendants, run_python

_ENV = {
    "TF_CPU_ALLOCATOR_USE_BFC": "true",
    "TF_CPU_BFC_MEM_LIMIT_IN_MB": "130",
    "TF_ENABLE_ONEDNN_OPTS": "0",
}

_PRELUDE = """
import json, os, sys
import numpy as np
import keras
import tfscale

def build(strategy):
    with strategy.scope():
        inputs = keras.Input((256,))
        h = keras.layers.Dense(1024, activation="relu")(inputs)
        h = keras.layers.Dense(1024, activation="relu")(h)
        model = keras.Model(inputs, keras.layers.Dense(4)(h))
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model

rng = np.random.default_rng(3)
x = rng.standard_normal((8192, 256)).astype(np.float32)
y = rng.integers(0, 4, 8192)
strategy = tfscale.choose_strategy().strategy

def report(error):
    print("RESULT " + json.dumps({
        "message": str(error),
        "device": error.device,
        "checkpoint": error.checkpoint,
        "batch": error.plan.options.batch_per_replica,
        "replicas": error.plan.options.replicas,
        "capacity": error.plan.devices[0].capacity,
        "planned_peak": error.plan.peak,
        "fitting": [[f.change, f.peak] for f in error.fixes if f.fits],
    }))
"""


def _result(code: str, tmp_path: Path) -> dict[str, object]:
    done = run_python(
        _PRELUDE + code, virtual_devices=2, env=_ENV, args=[str(tmp_path)], timeout=240
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])  # type: ignore[no-any-return]


def _check(result: dict[str, object], batch: int = 4096, fixes: int = 2) -> None:
    message = str(result["message"])
    assert result["device"] in ("/device:CPU:0", "/device:CPU:1")
    assert f"ran out of memory on {result['device']}" in message
    for part in ("weights", "optimizer", "gradients", "activations", "peak"):
        assert part in message
    # TensorFlow's own line, not its graph dump (Keras's traceback filter drops __cause__).
    assert "Received: ResourceExhaustedError: " in message
    assert "OOM when allocating" in message
    assert result["batch"] == batch and result["replicas"] == 2
    assert result["capacity"] == 65 * 2**20  # the allocator's 130 MiB over two devices
    assert isinstance(result["planned_peak"], int) and result["planned_peak"] > 65 * 2**20
    fitting = result["fitting"]
    assert isinstance(fitting, list) and len(fitting) >= fixes, message
    assert all(peak <= 0.9 * 65 * 2**20 for _, peak in fitting)
    assert any("accumulation_steps=" in change for change, _ in fitting), message


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fit_out_of_memory_names_the_plan_the_fixes_and_the_last_checkpoint(
    tmp_path: Path,
) -> None:
    # A first fit at a small batch saves a checkpoint; the same run resumed at a batch that
    # does not fit fails at its first step, and the error names that checkpoint.
    code = """
folder = os.path.join(sys.argv[1], "ckpt")
model = build(strategy)
tfscale.fit(model, x, y, batch_size=256, epochs=1, verbose=0, checkpoint_dir=folder)
try:
    tfscale.fit(model, x, y, batch_size=8192, epochs=3, verbose=0, checkpoint_dir=folder)
except tfscale.OutOfMemoryError as error:
    report(error)
"""
    before = descendants(os.getpid())  # a session fixture's daemons may share this process
    result = _result(code, tmp_path)
    _check(result)
    checkpoint = str(result["checkpoint"])
    assert checkpoint.startswith(str(tmp_path / "ckpt"))
    assert Path(checkpoint + ".index").exists()
    assert f"the last checkpoint is {checkpoint}" in str(result["message"])
    assert not descendants(os.getpid()) - before


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.full(
    "tests/training/memory/test_oom.py::"
    "test_fit_out_of_memory_names_the_plan_the_fixes_and_the_last_checkpoint"
)
def test_prepared_model_fit_and_custom_loop_out_of_memory_explained(tmp_path: Path) -> None:
    code = """
# Twice the examples of tfscale.fit's case: Keras's own input path may run the two replicas'
# steps one after the other, whose peak 4096 per replica can stay under the allocator's cap.
model = build(strategy)
tfscale.prepare(model, strategy)
try:
    model.fit(np.concatenate([x, x]), np.concatenate([y, y]), batch_size=16384, epochs=1,
              verbose=0)
except tfscale.OutOfMemoryError as error:
    report(error)

import tensorflow as tf
loop_model = build(strategy)
with strategy.scope():
    optimizer = keras.optimizers.Adam()
tfscale.prepare_loop(loop_model, optimizer)

def step(batch):
    features, labels = batch
    with tf.GradientTape() as tape:
        logits = loop_model(features, training=True)
        loss = tf.reduce_mean(
            keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        )
    grads = tape.gradient(loss, loop_model.trainable_variables)
    optimizer.apply_gradients(zip(grads, loop_model.trainable_variables))
    return loss

@tf.function
def train(batch):
    return strategy.run(step, args=(batch,))

data = tf.data.Dataset.from_tensor_slices((np.concatenate([x, x]), np.concatenate([y, y])))
batches = iter(strategy.experimental_distribute_dataset(data.batch(16384)))
try:
    with tfscale.out_of_memory_explained(loop_model, batch_per_replica=8192):
        train(next(batches))
except tfscale.OutOfMemoryError as error:
    report(error)
"""
    before = descendants(os.getpid())  # a session fixture's daemons may share this process
    done = run_python(
        _PRELUDE + code, virtual_devices=2, env=_ENV, args=[str(tmp_path)], timeout=240
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and len(lines) == 2, done.stdout[-3000:] + done.stderr[-3000:]
    prepared_fit, loop = (json.loads(line[len("RESULT ") :]) for line in lines)
    _check(prepared_fit, batch=8192, fixes=1)  # twice the batch: only a smaller one fits
    assert prepared_fit["checkpoint"] is None
    assert "No checkpoint was saved" in prepared_fit["message"]
    _check(loop, batch=8192, fixes=1)  # twice the batch: only a smaller one fits
    assert not descendants(os.getpid()) - before


def test_only_an_allocators_exhaustion_is_explained_as_memory() -> None:
    from tfscale.training.memory.oom import error_device, is_out_of_memory

    oom = (
        "Graph execution error:\n(0) RESOURCE_EXHAUSTED:  OOM when allocating tensor with "
        "shape[4096,1024] and type float on /job:localhost/replica:0/task:0/device:GPU:1 "
        "by allocator GPU_1_bfc"
    )
    assert is_out_of_memory(RuntimeError(oom))
    assert error_device(oom) == "/device:GPU:1"
    assert not is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: queue is full"))
    assert error_device("no device here") is None
