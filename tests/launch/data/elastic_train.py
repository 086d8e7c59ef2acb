"""A worker of an elastic job: `tfscale launch -n 3 --min-workers 2` that loses worker 2.

Usage: elastic_train.py --data {arrays,tfdata,dataset_fn} --out PREFIX
                        [--checkpoint-dir DIR] [--kill-after UPDATE] [--record DIR]

With --kill-after, the last worker of a 3-worker cluster SIGKILLs itself once
``optimizer.iterations`` reaches UPDATE, on every start, as a machine that fails for good
would; on 2 workers nobody dies. The data
is the same global batches (48) whatever the number of workers:
- arrays: shuffled by tfscale.fit (a permutation per epoch, its seed in the checkpoint);
- tfdata: a tf.data pipeline shuffled with a seed, batched by the global batch (sharded by
  DATA across workers);
- dataset_fn: shuffled with a seed, sharded by example over the input pipelines and batched
  per replica, so the union of the workers' k-th batches is the k-th 48 examples however
  many workers there are.
The chief saves the trained model's weights to PREFIX-KIND.npz. --record writes, per worker
and attempt, the cluster size and the update it started from. The test trains the
uninterrupted reference in its own process (``train`` under MirroredStrategy over 3 logical
CPUs: the same global batches).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import tfscale

EXAMPLES, FEATURES, CLASSES, BATCH, EPOCHS = 480, 8, 3, 48, 4


def make_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(FEATURES, CLASSES)), axis=1).astype("int32")
    return x, y


def build_model() -> keras.Model:
    keras.utils.set_random_seed(2)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(CLASSES),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def examples() -> tf.data.Dataset:
    # One fixed order for every epoch (reshuffle_each_iteration=False): a pipeline reshuffled
    # on each iteration starts its sequence of orders again in a resumed process.
    return tf.data.Dataset.from_tensor_slices(make_data()).shuffle(
        EXAMPLES, seed=3, reshuffle_each_iteration=False
    )


def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
    shard = examples().shard(context.num_input_pipelines, context.input_pipeline_id)
    return shard.batch(context.get_per_replica_batch_size(BATCH))


def inputs(kind: str) -> dict[str, Any]:
    """``tfscale.fit``'s data arguments for ``kind``."""
    if kind == "arrays":
        x, y = make_data()
        return {"x": x, "y": y, "batch_size": BATCH}
    if kind == "tfdata":
        return {"x": examples().batch(BATCH)}
    if kind == "dataset_fn":
        return {"x": dataset_fn}
    raise SystemExit(f"unknown --data {kind}")


class _KillAfter(keras.callbacks.Callback):
    """SIGKILLs this process once the optimizer has made ``update`` updates."""

    def __init__(self, update: int) -> None:
        super().__init__()
        self._update = update

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if int(self.model.optimizer.iterations.numpy()) >= self._update:
            os.kill(os.getpid(), signal.SIGKILL)


def record(folder: str, workers: int, start_step: int) -> None:
    """Writes FOLDER/worker<N>-<attempt>.json: the cluster size and the update it starts from."""
    attempt = os.environ.get("TFSCALE_LAUNCH_ATTEMPT", "0")
    name = f"{os.environ.get('TFSCALE_LAUNCH_TASK', 'worker').replace(' ', '')}-{attempt}"
    with open(os.path.join(folder, name + ".json"), "w") as handle:
        json.dump({"workers": workers, "start_step": start_step}, handle)


class _Record(keras.callbacks.Callback):
    def __init__(self, folder: str, workers: int) -> None:
        super().__init__()
        self._folder, self._workers = folder, workers

    def on_train_begin(self, logs: Any = None) -> None:
        record(self._folder, self._workers, int(self.model.optimizer.iterations.numpy()))


def train(
    strategy: tf.distribute.Strategy,
    kind: str,
    checkpoint_dir: str | None = None,
    callbacks: Sequence[keras.callbacks.Callback] = (),
) -> list[np.ndarray]:
    """A fresh model trained by ``tfscale.fit`` on ``kind``'s data, resuming from
    ``checkpoint_dir``'s checkpoint if it holds one: its final weights (the test runs it
    under MirroredStrategy over 3 logical CPUs, the uninterrupted reference)."""
    with strategy.scope():
        model = build_model()
    checkpoint = None
    if checkpoint_dir:
        checkpoint = tfscale.CheckpointConfig(checkpoint_dir, every_steps=4)
    tfscale.fit(
        model,
        **inputs(kind),
        epochs=EPOCHS,
        checkpoint_dir=checkpoint,
        callbacks=list(callbacks),
        strategy=strategy,
        verbose=0,
    )
    return [np.asarray(w) for w in model.get_weights()]


def arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The options both elastic scripts take, after ``parser``'s own."""
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--kill-after", type=int)
    parser.add_argument("--record")
    return parser.parse_args()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    args = arguments(parser)
    choice = tfscale.choose_strategy(strict=True)
    cluster = choice.cluster
    workers = cluster.num_workers if cluster is not None else 1
    index = cluster.task_index if cluster is not None else 0
    callbacks: list[Any] = []
    if args.record:
        callbacks.append(_Record(args.record, workers))
    if args.kill_after and workers == 3 and index == 2:
        callbacks.append(_KillAfter(args.kill_after))
    weights = train(choice.strategy, args.data, args.checkpoint_dir, callbacks)
    print(f"{args.data} on {workers} workers: done", flush=True)
    if cluster is None or cluster.is_chief:
        np.savez(f"{args.out}-{args.data}.npz", *weights)


if __name__ == "__main__":
    main()
