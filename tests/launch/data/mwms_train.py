"""A worker of `tfscale launch -n N`: trains a small model with tfscale.fit and saves weights.

Usage: mwms_train.py --out WEIGHTS.npz --epochs E [--checkpoint-dir DIR] [--record DIR]
                     [--crash-once-at EPOCH:BATCH]

`train(strategy, ...)` is imported by the tests to train the single-process reference
(MirroredStrategy over logical CPUs) on the same data. With --crash-once-at, worker 1 kills
itself with SIGKILL after that batch, on the job's first attempt only; --record writes each
worker's pid and the step it started from (non-zero after a resume).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

import keras
import numpy as np

import tfscale

EXAMPLES, FEATURES, CLASSES, BATCH = 384, 12, 3, 32


def make_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(FEATURES, CLASSES)), axis=1).astype("int32")
    return x, y


def build_model() -> keras.Model:
    keras.utils.set_random_seed(1)
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


class _CrashOnce(keras.callbacks.Callback):
    """SIGKILLs this process after batch ``batch`` of epoch ``epoch`` (0-based)."""

    def __init__(self, epoch: int, batch: int) -> None:
        super().__init__()
        self._target = (epoch, batch)
        self._epoch = -1

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if (self._epoch, batch) == self._target:
            os.kill(os.getpid(), signal.SIGKILL)


def train(
    strategy: Any,
    *,
    epochs: int,
    checkpoint_dir: str | None = None,
    callbacks: list[Any] | None = None,
) -> tuple[keras.Model, list[np.ndarray]]:
    with strategy.scope():
        model = build_model()
    checkpoint = None
    if checkpoint_dir:
        checkpoint = tfscale.CheckpointConfig(checkpoint_dir, every_steps=5)
    tfscale.fit(
        model,
        *make_data(),
        epochs=epochs,
        batch_size=BATCH,
        checkpoint_dir=checkpoint,
        callbacks=callbacks,
        strategy=strategy,
        verbose=2,
    )
    return model, [np.asarray(w) for w in model.get_weights()]


class _Record(keras.callbacks.Callback):
    def __init__(self, path: str) -> None:
        super().__init__()
        self._path = path

    def on_train_begin(self, logs: Any = None) -> None:
        record = {
            "pid": os.getpid(),
            "pgid": os.getpgrp(),
            "start_step": int(self.model.optimizer.iterations.numpy()),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
        with open(self._path, "w") as handle:
            json.dump(record, handle)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--record")
    parser.add_argument("--crash-once-at")
    args = parser.parse_args()
    choice = tfscale.choose_strategy(strict=True)
    # A bfloat16 variable in the strategy's scope: TensorFlow's broadcast of initial values
    # across workers takes no bfloat16; the strategy tfscale builds carries it as float32.
    with choice.strategy.scope():
        keras.Variable(np.ones(2), dtype="bfloat16")
    cluster = choice.cluster
    index = cluster.task_index if cluster is not None else 0
    attempt = os.environ.get("TFSCALE_LAUNCH_ATTEMPT", "0")
    callbacks: list[Any] = []
    if args.record:
        callbacks.append(_Record(os.path.join(args.record, f"worker{index}-{attempt}.json")))
    if args.crash_once_at and attempt == "0" and index == 1:
        epoch, batch = (int(v) for v in args.crash_once_at.split(":"))
        callbacks.append(_CrashOnce(epoch, batch))
    _, weights = train(
        choice.strategy, epochs=args.epochs, checkpoint_dir=args.checkpoint_dir, callbacks=callbacks
    )
    print(f"{choice.kind} with {choice.num_replicas} replicas: done", flush=True)
    if cluster is None or cluster.is_chief:
        np.savez(args.out, *weights)


if __name__ == "__main__":
    main()
