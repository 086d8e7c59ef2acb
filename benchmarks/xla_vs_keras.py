"""Examples/s with and without XLA (``jit_compile``), tfscale.fit against Keras ``model.fit``.

Models: an Embedding + LSTM + GRU classifier, a one-block Transformer encoder and a small
CNN. Keras runs on one device (``compile(jit_compile=...)``: its whole step, optimizer
included, is one XLA cluster); tfscale runs on one device and on 2 logical CPUs
(MirroredStrategy, ``ReductionToOneDevice``), where each replica's forward and backward pass
is one cluster and the all-reduce and update stay outside (``training/xla.py``). Keras has no
2-device jit row: under a strategy its ``jit_compile=True`` compiles the collectives too.
Each measurement trains one warm-up epoch (tracing and compiling), then times ``--epochs``
epochs and keeps the fastest; the table shows the median over ``--repeats`` runs and, per
model, every rate against Keras's one-device run without XLA.

    python benchmarks/xla_vs_keras.py [--epochs 3] [--repeats 3] [--examples 2048]
        [--models rnn,transformer,cnn]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TFSCALE_VIRTUAL_DEVICES"] = "2"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import keras
import numpy as np
import tensorflow as tf

import tfscale
from tfscale.profiling.callback import EpochClock

BATCH, LENGTH, VOCAB, CLASSES = 64, 32, 1000, 4


def _data(kind: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    y = rng.integers(0, CLASSES, n).astype("int32")
    if kind == "cnn":
        return rng.normal(size=(n, 16, 16, 1)).astype("float32"), y
    return rng.integers(0, VOCAB, (n, LENGTH)).astype("int32"), y


def _build(kind: str) -> keras.Model:
    layers = keras.layers
    if kind == "cnn":
        inputs = keras.Input((16, 16, 1))
        h = layers.Conv2D(16, 3, activation="relu")(inputs)
        h = layers.Conv2D(16, 3, activation="relu")(h)
        h = layers.GlobalAveragePooling2D()(h)
    else:
        inputs = keras.Input((LENGTH,), dtype="int32")
        h = layers.Embedding(VOCAB, 32)(inputs)
        if kind == "rnn":
            h = layers.LSTM(32, return_sequences=True)(h)
            h = layers.GRU(32)(h)
        else:
            h = layers.LayerNormalization()(h + layers.MultiHeadAttention(4, 8)(h, h))
            h = layers.LayerNormalization()(h + layers.Dense(32)(layers.Dense(64, "relu")(h)))
            h = layers.GlobalAveragePooling1D()(h)
    return keras.Model(inputs, layers.Dense(CLASSES)(h))


def _model(kind: str, strategy: Any, jit: bool) -> keras.Model:
    with strategy.scope():
        model = _build(kind)
        model.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            jit_compile=jit,
        )
    return model


def _rate(runner: str, kind: str, strategy: Any, jit: bool, data: Any, epochs: int) -> float:
    model = _model(kind, strategy, jit)
    clock = EpochClock()
    x, y = data
    if runner == "keras":
        model.fit(x, y, batch_size=BATCH, epochs=epochs + 1, callbacks=[clock], verbose=0)
    else:
        tfscale.fit(
            model,
            x,
            y,
            batch_size=BATCH,
            epochs=epochs + 1,
            jit_compile=jit,
            callbacks=[clock],
            strategy=strategy,
            verbose=0,
        )
    return len(x) / min(clock.times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--examples", type=int, default=2048)
    parser.add_argument("--models", default="rnn,transformer,cnn")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    one = tf.distribute.OneDeviceStrategy(devices[0])
    two = tf.distribute.MirroredStrategy(devices, tf.distribute.ReductionToOneDevice())
    runs = [
        ("keras", 1, one, False),
        ("keras", 1, one, True),
        ("tfscale", 1, one, False),
        ("tfscale", 1, one, True),
        ("tfscale", 2, two, False),
        ("tfscale", 2, two, True),
    ]
    table = Table(
        title=f"examples/s, global batch {BATCH}, median of {args.repeats} repeats "
        f"(ratio: against keras fit, 1 device, no XLA)"
    )
    for column in ("model", "loop", "devices", "jit_compile", "examples/s", "ratio"):
        table.add_column(column, justify="right")
    for kind in args.models.split(","):
        data = _data(kind, args.examples)
        rates: dict[int, list[float]] = {i: [] for i in range(len(runs))}
        for _ in range(args.repeats):  # interleaved: a noisy machine slows every run alike
            for i, (runner, _, strategy, jit) in enumerate(runs):
                rates[i].append(_rate(runner, kind, strategy, jit, data, args.epochs))
        base = statistics.median(rates[0])
        for i, (runner, replicas, _, jit) in enumerate(runs):
            rate = statistics.median(rates[i])
            row = (kind, runner, str(replicas), str(jit), f"{rate:,.0f}", f"{rate / base:.2f}x")
            table.add_row(*row)
            print(*row, flush=True)
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
