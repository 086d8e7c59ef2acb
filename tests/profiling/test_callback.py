"""``tfscale.ProfileCallback`` under ``tfscale.fit`` (Trainer timings) and Keras ``model.fit``."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tfscale
from tfscale.profiling.steptime import robust_means

pytestmark = pytest.mark.tf


def _model() -> keras.Model:
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
    )
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.standard_normal((256, 8)).astype("float32"), rng.integers(0, 3, 256)


def test_under_tfscale_fit_it_gets_fetch_and_step_seconds(cpu_devices: list[str]) -> None:
    # choose_strategy's Mirrored (ReductionToOneDevice on CPUs): two collective-based
    # strategies in one process would share group keys (tensorflow/tensorflow#61314).
    strategy = tfscale.choose_strategy(cpu_devices[:2]).strategy
    with strategy.scope():
        model = _model()
    callback = tfscale.ProfileCallback(batch_size=32, warmup=1)
    tfscale.fit(model, *_data(), batch_size=32, callbacks=[callback], strategy=strategy, verbose=0)
    assert len(callback.step_s) == 256 // 32 - 1 == len(callback.fetch_s)
    breakdown = callback.breakdown()
    assert breakdown.method == "wall-clock"
    # bench's statistics on the same record: means over the fastest 90% of steps.
    wait, execution = robust_means(callback.step_times())
    assert breakdown.step_s == pytest.approx(wait + execution)
    assert callback.step_times().wait_s == tuple(callback.fetch_s)
    assert 0 < breakdown.input_s < breakdown.step_s
    summary = callback.summary()
    assert summary["replicas"] == 2 and summary["examples_per_s"] == pytest.approx(
        32 / breakdown.step_s
    )


def test_under_keras_fit_it_times_steps_and_classifies_a_trace(cpu_devices: list[str]) -> None:
    # choose_strategy's Mirrored (ReductionToOneDevice on CPUs): two collective-based
    # strategies in one process would share group keys (tensorflow/tensorflow#61314).
    strategy = tfscale.choose_strategy(cpu_devices[:2]).strategy
    with strategy.scope():
        model = _model()
    callback = tfscale.ProfileCallback(batch_size=32, warmup=1, trace_steps=(2, 5))
    x, y = _data()
    model.fit(x, y, batch_size=32, epochs=1, callbacks=[callback], verbose=0)
    assert len(callback.step_s) == 7
    shares = callback.trace_shares
    assert shares and sum(shares.values()) == pytest.approx(1.0)
    # Which event classes the trace holds (a classification: every event lasts): the
    # replicas' compute and the reduction's copies.
    assert {kind for kind, share in shares.items() if share} >= {"compute", "communication"}
    assert callback.breakdown().method == "trace"
