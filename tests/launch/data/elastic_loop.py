"""A worker of an elastic job whose training is a custom loop (``tfscale.prepare_loop``).

Usage: elastic_loop.py --out FILE [--checkpoint-dir DIR] [--kill-after STEP] [--record DIR]

The loop of TensorFlow's multi-worker custom-training tutorial: MultiWorkerMirroredStrategy
(``tfscale.choose_strategy``), the model and Adam made in its scope, ``tfscale.prepare_loop``,
a ``tf.function`` around ``strategy.run`` of a ``GradientTape`` step on a per-example loss,
and ``tf.train.CheckpointManager`` (model, optimizer, step counter) every 4 steps: the chief
writes to DIR, the other workers to a scratch folder they delete, as the tutorial's
``write_filepath`` does. A (re)started worker restores DIR's latest checkpoint and skips to
the global batch after its step.

The data is the same global batches (48) whatever the number of workers, as docs/launch.md
recommends for a ``dataset_fn``: one fixed shuffled order, sharded by example over the input
pipelines, batched per replica, so the union of the workers' k-th batches is the k-th 48
examples on any number of workers; a resumed job skips the batches already trained.

With --kill-after, the last worker of a 3-worker cluster SIGKILLs itself once the step
counter reaches STEP, on every start (a machine that fails for good); on 2 workers nobody
dies. The chief saves the final weights to FILE (.npz). --record writes, per worker and
attempt, the cluster size and the step it started from. The test runs the uninterrupted
reference in its own process (``train`` under MirroredStrategy over 3 logical CPUs: one input
pipeline, the same global batches).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tfscale

# The same examples, sizes and records as the Keras-fit worker next to it.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from elastic_train import BATCH, CLASSES, EPOCHS, EXAMPLES, FEATURES, arguments, examples, record

STEPS = EPOCHS * EXAMPLES // BATCH  # 40 global batches, 10 per epoch
SAVE_EVERY = 4


def make_dataset(start: int) -> Callable[[tf.distribute.InputContext], tf.data.Dataset]:
    """The ``input_fn`` of ``distribute_datasets_from_function``, from global batch ``start``."""

    def input_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        # One fixed order for every epoch and every process (reshuffle_each_iteration=False);
        # shuffle before sharding, shard by example before batching per replica.
        shard = examples().shard(context.num_input_pipelines, context.input_pipeline_id)
        batches = shard.batch(context.get_per_replica_batch_size(BATCH), drop_remainder=True)
        return batches.repeat(EPOCHS).skip(start)

    return input_fn


def train(
    strategy: tf.distribute.Strategy,
    cluster: Any = None,
    checkpoint_dir: str | None = None,
    kill_after: int | None = None,
    record_to: str | None = None,
) -> tuple[int, list[np.ndarray]]:
    """The loop over all 40 global batches, or what remains of them after
    ``checkpoint_dir``'s latest checkpoint: the step it started from and the final weights."""
    workers = cluster.num_workers if cluster is not None else 1
    index = cluster.task_index if cluster is not None else 0
    chief = cluster is None or cluster.is_chief

    keras.utils.set_random_seed(2)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(16, activation="tanh"),
                keras.layers.Dense(CLASSES),
            ]
        )
        optimizer = keras.optimizers.Adam(0.01)
        per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    tfscale.prepare_loop(model, optimizer)  # the one added line
    step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")

    manager = scratch = None
    if checkpoint_dir:
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)
        # The tutorial's write_filepath: every worker saves (saving may run collectives), the
        # chief where the job resumes from, the others to a scratch folder deleted after.
        directory = checkpoint_dir
        if not chief:
            scratch = directory = os.path.join(checkpoint_dir, f"scratch-worker{index}")
        manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=2)
        latest = tf.train.latest_checkpoint(checkpoint_dir)
        if latest:
            checkpoint.restore(latest).assert_consumed()
    start = int(step.numpy())

    if record_to:
        record(record_to, workers, start)
    doomed = bool(kill_after) and workers == 3 and index == 2

    def train_step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            losses = per_example(yb, model(xb, training=True))
        gradients = tape.gradient(losses, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return losses

    @tf.function
    def distributed_train_step(batch: tuple[tf.Tensor, tf.Tensor]) -> tf.Tensor:
        return strategy.run(train_step, args=batch)

    batches = strategy.distribute_datasets_from_function(make_dataset(start))
    for batch in batches:
        distributed_train_step(batch)
        step.assign_add(1)
        done = int(step.numpy())
        if manager is not None and (done % SAVE_EVERY == 0 or done == STEPS):
            manager.save(checkpoint_number=done)
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        if doomed and kill_after is not None and done >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    assert int(step.numpy()) == STEPS == int(optimizer.iterations.numpy()), step.numpy()
    return start, [np.asarray(w) for w in model.get_weights()]


def main() -> None:
    args = arguments(argparse.ArgumentParser())
    choice = tfscale.choose_strategy(strict=True)
    cluster = choice.cluster
    start, weights = train(
        choice.strategy, cluster, args.checkpoint_dir, args.kill_after, args.record
    )
    workers = cluster.num_workers if cluster is not None else 1
    print(f"loop on {workers} workers from step {start}: done", flush=True)
    if cluster is None or cluster.is_chief:
        np.savez(args.out, *weights)


if __name__ == "__main__":
    main()
