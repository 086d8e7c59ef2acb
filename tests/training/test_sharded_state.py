"""Sharded optimizer state (ZeRO stage 1, ``training/sharding.py``): the same weights as the
unsharded update, half the slot bytes per replica over 2, checkpoints that restore on another
replica count, and a refusal by name for optimizers whose update is not elementwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale
from tfscale.errors import TrainingError
from tfscale.testing import relative_difference
from tfscale.training.sharding import ELEMENTWISE, sharded_state, slot_bytes_per_device

from .helpers import DATA, WORKER_PRELUDE, batches, strategy_for, tiered, tiny_model

pytestmark = pytest.mark.tf

EPOCHS = 2

#: Every optimizer the sharded update accepts, with settings that reach its whole update
#: rule (momentum, Nesterov, decoupled weight decay, centring, l1/l2).
OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "lion": lambda: keras.optimizers.Lion(0.001),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "ftrl": lambda: keras.optimizers.Ftrl(0.05, l1_regularization_strength=0.001),
    "adam_schedule_clipped": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.02, 3, 0.5), global_clipnorm=0.5
    ),
}


def _model(strategy: tf.distribute.Strategy, optimizer: Any) -> keras.Model:
    return tiny_model(strategy, optimizer() if callable(optimizer) else optimizer)


def _fit(model: keras.Model, strategy: Any, shard: bool, data: Any = DATA, **fit: Any) -> None:
    """``tfscale.fit`` in order (``shuffle=False``), 32 examples per step unless given."""
    fit.setdefault("batch_size", 32)
    x, y = data
    tfscale.fit(
        model, x, y, shuffle=False, strategy=strategy, verbose=0, shard_optimizer_state=shard, **fit
    )


def _trained(
    replicas: int, optimizer: Any, shard: bool, epochs: int = EPOCHS, **fit: Any
) -> keras.Model:
    strategy = strategy_for(replicas)
    model = _model(strategy, optimizer)
    _fit(model, strategy, shard, epochs=epochs, **fit)
    return model


def test_every_accepted_optimizer_has_a_case() -> None:
    made = {type(make()) for make in OPTIMIZERS.values()}
    assert made == set(ELEMENTWISE)


_IN_MAKE_TEST = ("adam",)
_EQUIVALENT = (
    "tests/training/test_sharded_state.py::"
    "test_two_replicas_sharded_equal_unsharded_after_two_epochs[adam]"
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        name if name in _IN_MAKE_TEST else pytest.param(name, marks=pytest.mark.full(_EQUIVALENT))
        for name in sorted(OPTIMIZERS)
    ],
)
def test_two_replicas_sharded_equal_unsharded_after_two_epochs(name: str) -> None:
    whole = _trained(2, OPTIMIZERS[name], shard=False)
    sharded = _trained(2, OPTIMIZERS[name], shard=True)
    assert sharded_state(sharded.optimizer) is not None
    assert sharded_state(whole.optimizer) is None
    assert int(sharded.optimizer.iterations.numpy()) == int(whole.optimizer.iterations.numpy())
    assert int(sharded.optimizer.iterations.numpy()) == EPOCHS * 256 // 32
    assert relative_difference(sharded.get_weights(), whole.get_weights()) <= 1e-6
    # Trained: the weights moved from the initial ones.
    initial = _model(strategy_for(2), OPTIMIZERS[name]).get_weights()
    assert relative_difference(sharded.get_weights(), initial) > 1e-3


@pytest.mark.full(
    "tests/training/test_sharded_state.py::"
    "test_two_replicas_sharded_equal_unsharded_after_two_epochs[adam]",
)
def test_adam_slot_bytes_per_replica_are_half_and_on_each_replicas_device() -> None:
    strategy = strategy_for(2)
    whole = _trained(2, OPTIMIZERS["adam"], shard=False, epochs=1)
    sharded = _trained(2, OPTIMIZERS["adam"], shard=True, epochs=1)
    unsharded_bytes = slot_bytes_per_device(whole.optimizer, strategy)
    sharded_bytes = slot_bytes_per_device(sharded.optimizer, strategy)
    devices = [tf.DeviceSpec.from_string(d).to_string() for d in strategy.extended.worker_devices]
    assert sorted(unsharded_bytes) == sorted(sharded_bytes) == sorted(devices)
    parameters = sum(int(np.prod(v.shape)) for v in whole.trainable_variables)
    for device in devices:
        # Adam: two float32 moments per parameter; every variable of the tiny MLP has an even
        # size, so each replica's shards are exactly half.
        assert unsharded_bytes[device] == 2 * 4 * parameters
        assert sharded_bytes[device] * 2 == unsharded_bytes[device]
    # Read from the variables themselves: each slot shard is a plain variable on its
    # replica's device (not mirrored), and the optimizer holds no whole slot.
    state = sharded_state(sharded.optimizer)
    assert state is not None
    for replica in state.local:
        assert {tf.DeviceSpec.from_string(s.device).to_string() for s in state.slots(replica)} == {
            replica.device
        }
    assert len(sharded.optimizer.variables) == 2  # iterations and the learning rate


@pytest.mark.full(
    "tests/training/test_sharded_state.py::"
    "test_two_replicas_sharded_equal_unsharded_after_two_epochs[adam]",
)
def test_three_replicas_pad_the_last_shard_and_still_equal_unsharded() -> None:
    # 3 does not divide the tiny MLP's sizes (48x16, 16, 16x16, 16x4, 4): padded shards.
    whole = _trained(3, OPTIMIZERS["adamw"], shard=False, epochs=1)
    sharded = _trained(3, OPTIMIZERS["adamw"], shard=True, epochs=1)
    assert relative_difference(sharded.get_weights(), whole.get_weights()) <= 1e-6


def _embedding_model(strategy: tf.distribute.Strategy, optimizer: Any) -> keras.Model:
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential(
            [
                keras.Input((5,), dtype="int32"),
                keras.layers.Embedding(20, 4),
                keras.layers.Flatten(),
                keras.layers.Dense(2),
            ]
        )
        model.compile(optimizer(), "mse")
    return model


# `make test` runs accumulated micro-batches (the update's inputs reach the shards from
# another path than the step's); an embedding's IndexedSlices, XLA's compiled step and several
# steps per call reach the same sharded apply, in `make test-full`.
@pytest.mark.parametrize(
    "variant",
    tiered(
        ["sparse_gradient", "accumulation_steps", "jit_compile", "steps_per_execution"],
        dict.fromkeys(
            ["sparse_gradient", "jit_compile", "steps_per_execution"], "accumulation_steps"
        ),
        "tests/training/test_sharded_state.py::"
        "test_sharded_state_with_tfscales_other_options_equals_unsharded",
    ),
)
def test_sharded_state_with_tfscales_other_options_equals_unsharded(variant: str) -> None:
    """Every path to the optimizer (DistributedUpdate's) reaches the sharded update: an
    embedding's IndexedSlices (densified for its shard), accumulated micro-batches, XLA's
    deferred apply, several steps per call."""
    strategy = strategy_for(2)
    rng = np.random.default_rng(5)
    y = rng.normal(size=(64, 2)).astype("float32")
    if variant == "sparse_gradient":
        x: Any = rng.integers(0, 20, size=(64, 5)).astype("int32")
        options: dict[str, Any] = {}
    else:
        x = rng.normal(size=(64, 5)).astype("float32")
        options = {
            "accumulation_steps": {"accumulation_steps": 2},
            "jit_compile": {"jit_compile": True},
            "steps_per_execution": {"steps_per_execution": 4},
        }[variant]
    results = []
    for shard in (False, True):
        if variant == "sparse_gradient":
            model = _embedding_model(strategy, lambda: keras.optimizers.Adam(0.01))
        else:
            with strategy.scope():
                keras.utils.set_random_seed(3)
                model = keras.Sequential(
                    [keras.Input((5,)), keras.layers.Dense(8, "tanh"), keras.layers.Dense(2)]
                )
                model.compile(keras.optimizers.AdamW(0.01), "mse")
        _fit(model, strategy, shard, (x, y), batch_size=16, epochs=2, **options)
        assert (sharded_state(model.optimizer) is not None) == shard
        results.append((model.get_weights(), int(model.optimizer.iterations.numpy())))
    (whole, updates), (sharded, sharded_updates) = results
    assert sharded_updates == updates == 8 // options.get("accumulation_steps", 1)
    assert relative_difference(sharded, whole) <= 1e-6


def _checkpoint_keys(folder: Path) -> list[tuple[str, list[int]]]:
    latest = tf.train.latest_checkpoint(str(folder))
    assert latest is not None
    return [(k, s) for k, s in tf.train.list_variables(latest) if k.startswith("optimizer/")]


@pytest.mark.slow
def test_checkpoint_on_two_sharded_replicas_restores_on_one_and_continues(tmp_path: Path) -> None:
    uninterrupted = _trained(2, OPTIMIZERS["adam"], shard=False)
    # The checkpoint of 1 epoch on 2 sharded replicas holds the whole slots, under the keys
    # of the unsharded optimizer's.
    _trained(2, OPTIMIZERS["adam"], shard=True, epochs=1, checkpoint_dir=str(tmp_path / "s"))
    _trained(2, OPTIMIZERS["adam"], shard=False, epochs=1, checkpoint_dir=str(tmp_path / "u"))
    assert _checkpoint_keys(tmp_path / "s") == _checkpoint_keys(tmp_path / "u")
    saved = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(tmp_path / "s")))
    whole = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(tmp_path / "u")))
    for key, _ in _checkpoint_keys(tmp_path / "s"):
        assert relative_difference(saved.get_tensor(key), whole.get_tensor(key)) <= 1e-6, key
    # Resumed for epoch 2 on 1 replica, unsharded and sharded over 1, and on 2 sharded.
    for replicas, shard in ((1, False), (1, True), (2, True)):
        folder = tmp_path / f"resume_{replicas}_{shard}"
        folder.mkdir()
        for file in (tmp_path / "s").iterdir():
            (folder / file.name).write_bytes(file.read_bytes())
        resumed = _trained(replicas, OPTIMIZERS["adam"], shard=shard, checkpoint_dir=str(folder))
        assert int(resumed.optimizer.iterations.numpy()) == EPOCHS * 256 // 32
        difference = relative_difference(resumed.get_weights(), uninterrupted.get_weights())
        assert difference <= 1e-6, (replicas, shard, difference)


def test_a_restore_before_the_build_fills_the_shards_when_they_are_made(tmp_path: Path) -> None:
    """A custom loop's ``tf.train.Checkpoint.restore`` before the optimizer is built: the
    whole slots wait (deferred restoration) and are cut into the shards as they are made."""
    whole = _trained(2, OPTIMIZERS["adam"], shard=False, epochs=1)
    path = tf.train.Checkpoint(model=whole, optimizer=whole.optimizer).write(str(tmp_path / "c"))
    strategy = strategy_for(2)
    model = _model(strategy, OPTIMIZERS["adam"])
    tfscale.prepare(model, strategy, shard_optimizer_state=True)
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(path).expect_partial()
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    state = sharded_state(model.optimizer)
    assert state is not None
    restored = [np.asarray(v.whole() if hasattr(v, "whole") else v) for v in state.view.saved]
    assert len(restored) == len(whole.optimizer.variables) == 14
    assert relative_difference(restored, [v.numpy() for v in whole.optimizer.variables]) == 0.0


@pytest.mark.full(
    "tests/training/test_sharded_state.py::"
    "test_checkpoint_on_two_sharded_replicas_restores_on_one_and_continues",
)
def test_keras_weights_files_hold_the_whole_slots_both_ways(tmp_path: Path) -> None:
    """``model.save_weights`` of a sharded model loads into an unsharded one on 1 device, and
    an unsharded model's file into a sharded one, which then continues as unsharded."""
    strategy = strategy_for(2)
    sharded = _trained(2, OPTIMIZERS["adam"], shard=True, epochs=1)
    whole = _trained(2, OPTIMIZERS["adam"], shard=False, epochs=1)
    sharded.save_weights(str(tmp_path / "sharded.weights.h5"))
    whole.save_weights(str(tmp_path / "whole.weights.h5"))
    one = _model(strategy_for(1), OPTIMIZERS["adam"])
    one.optimizer.build(one.trainable_variables)
    one.load_weights(str(tmp_path / "sharded.weights.h5"))
    assert len(one.optimizer.variables) == len(whole.optimizer.variables) == 14
    saved = [v.numpy() for v in whole.optimizer.variables]
    assert relative_difference([v.numpy() for v in one.optimizer.variables], saved) <= 1e-6
    loaded = _model(strategy, OPTIMIZERS["adam"])
    tfscale.prepare(loaded, strategy, shard_optimizer_state=True)
    with strategy.scope():
        loaded.optimizer.build(loaded.trainable_variables)
    loaded.load_weights(str(tmp_path / "whole.weights.h5"))
    for model, shard in ((loaded, True), (whole, False)):
        _fit(model, strategy, shard, epochs=2, initial_epoch=1)
    assert relative_difference(loaded.get_weights(), whole.get_weights()) <= 1e-6


def _loop_weights(shard: bool) -> list[np.ndarray]:
    """One epoch of a custom GradientTape loop over 2 replicas (``tfscale.prepare_loop``)."""
    x, y = DATA
    strategy = strategy_for(2)
    model = tiny_model(strategy, "adam", lr=0.01)
    optimizer = tfscale.prepare_loop(model, strategy=strategy, shard_optimizer_state=shard)
    assert (sharded_state(optimizer) is not None) == shard
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def replica(features: Any, labels: Any) -> None:
        with tf.GradientTape() as tape:
            value = loss(labels, model(features, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    @tf.function  # type: ignore[misc]
    def step(features: Any, labels: Any) -> None:
        strategy.run(replica, args=(features, labels))

    for features, labels in strategy.experimental_distribute_dataset(batches(x, y, 32)):
        step(features, labels)
    assert int(optimizer.iterations.numpy()) == 256 // 32
    return list(model.get_weights())


@pytest.mark.slow
@pytest.mark.full(
    "tests/training/test_sharded_state.py::"
    "test_two_replicas_sharded_equal_unsharded_after_two_epochs[adam]",
)
def test_custom_loop_with_sharded_state_equals_unsharded() -> None:
    assert relative_difference(_loop_weights(True), _loop_weights(False)) <= 1e-6


@pytest.mark.parametrize(
    ("optimizer", "why"),
    [
        (lambda: keras.optimizers.Adafactor(0.01), "factored over the rows and columns"),
        (lambda: keras.optimizers.Lamb(0.01), "trust ratio"),
        (lambda: keras.optimizers.Muon(0.01), "orthogonalizes"),
    ],
)
def test_optimizers_that_are_not_elementwise_are_refused_by_name(optimizer: Any, why: str) -> None:
    strategy = strategy_for(2)
    model = _model(strategy, optimizer)
    name = type(model.optimizer).__name__
    with pytest.raises(TrainingError, match=f"(?s)cannot shard {name}'s state.*{why}"):
        tfscale.prepare(model, strategy, shard_optimizer_state=True)


def test_a_built_optimizer_ema_and_loss_scaling_are_refused() -> None:
    strategy = strategy_for(2)
    model = tiny_model(strategy, "adam")
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    with pytest.raises(TrainingError, match="before Adam is built"):
        tfscale.prepare(model, strategy, shard_optimizer_state=True)
    model = _model(strategy, lambda: keras.optimizers.Adam(0.01, use_ema=True))
    with pytest.raises(TrainingError, match="use_ema"):
        tfscale.prepare(model, strategy, shard_optimizer_state=True)
    model = tiny_model(strategy, "adam")
    with pytest.raises(TrainingError, match="LossScaleOptimizer"):
        tfscale.prepare(model, strategy, mixed_precision="fp16", shard_optimizer_state=True)
    with pytest.raises(TrainingError, match="yes/no"):
        tfscale.prepare(tiny_model(strategy), strategy, shard_optimizer_state="yes")


_WORKER = (
    WORKER_PRELUDE
    + """
from tfscale.training.sharding import slot_bytes_per_device
for shard in (False, True):
    model = tiny_model(strategy, "adam", lr=0.01)
    folder = os.path.join(os.path.dirname(out), "ckpt" if shard else "ckpt_whole")
    tfscale.fit(
        model, x, y, batch_size=32, epochs=2, shuffle=False, strategy=strategy, verbose=0,
        checkpoint_dir=folder, shard_optimizer_state=shard,
    )
    report[f"bytes_{shard}"] = slot_bytes_per_device(model.optimizer, strategy)
    report[f"updates_{shard}"] = int(model.optimizer.iterations.numpy())
    weights.update({f"{shard}_{i}": w for i, w in enumerate(model.get_weights())})
np.savez(out + ".npz", **weights)
with open(out + ".json", "w") as handle:
    json.dump(report, handle)
"""
)


@pytest.mark.multiprocess
@pytest.mark.slow
# `make test` shards over 2 logical CPUs in-process (the same update and checkpoint) and runs
# the update's collectives across 2 workers in the parity suite's 2-worker group.
@pytest.mark.full(
    "tests/training/test_sharded_state.py::"
    "test_checkpoint_on_two_sharded_replicas_restores_on_one_and_continues",
    "tests/training/test_parity_examples.py::"
    "test_cases_across_two_worker_processes_match_one_device[paths_across_workers]",
)
def test_two_workers_sharded_equal_unsharded_and_their_checkpoint_resumes_on_one(
    tmp_path: Path,
) -> None:
    import json

    from .helpers import run_workers

    tests = Path(__file__).resolve().parents[1]
    run_workers(_WORKER, [str(tmp_path / "w"), str(tests)], timeout=300)
    reports = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(2)]
    weights = [np.load(tmp_path / f"w{i}.npz") for i in range(2)]
    count = len(tiny_model(None).get_weights())
    for report, worker in zip(reports, weights, strict=True):
        assert report["replicas"] == 2
        assert report["updates_True"] == report["updates_False"] == EPOCHS * 256 // 32
        # One CPU device per worker: it holds half of Adam's slots when sharded.
        ((device, whole),) = report["bytes_False"].items()
        assert report["bytes_True"] == {device: whole // 2}
        sharded = [worker[f"True_{i}"] for i in range(count)]
        unsharded = [worker[f"False_{i}"] for i in range(count)]
        assert relative_difference(sharded, unsharded) <= 1e-6
    # The workers agree, and equal Mirrored over 2 logical CPUs (unsharded) in this process.
    mirrored = _trained(2, lambda: keras.optimizers.Adam(0.01), shard=False)
    sharded = [weights[0][f"True_{i}"] for i in range(count)]
    assert relative_difference([weights[1][f"True_{i}"] for i in range(count)], sharded) == 0.0
    assert relative_difference(sharded, mirrored.get_weights()) <= 1e-6
    # The checkpoint the 2 sharded workers wrote (whole slots) resumes on 1 replica for a
    # third epoch and ends where 3 uninterrupted epochs end.
    assert (tmp_path / "ckpt" / "checkpoint").exists()
    resumed = _trained(
        1,
        lambda: keras.optimizers.Adam(0.01),
        shard=False,
        epochs=3,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )
    assert int(resumed.optimizer.iterations.numpy()) == 3 * 256 // 32
    uninterrupted = _trained(2, lambda: keras.optimizers.Adam(0.01), shard=False, epochs=3)
    assert relative_difference(resumed.get_weights(), uninterrupted.get_weights()) <= 1e-6
