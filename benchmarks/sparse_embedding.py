"""A 500k-row embedding: bytes handed to the gradient all-reduce and examples/s, tfscale.fit
against Keras ``model.fit`` under the same strategy (2 logical CPUs, ReductionToOneDevice).

The embedding's gradient is a ``tf.IndexedSlices`` holding one row per token of the batch;
both loops all-reduce it as slices (a gather of the rows each replica touched), so the bytes
per step grow with the batch, not with the vocabulary. The bytes are those of the tensors
each replica hands to ``ReplicaContext.all_reduce`` in one step (counted when the step is
traced, from their static shapes); the densified gradient of the embedding alone would be
``rows x dim x 4`` bytes. Each measurement trains one warm-up epoch (tracing), then times
``--epochs`` epochs and keeps the fastest; the two loops alternate ``--repeats`` times.

    python benchmarks/sparse_embedding.py [--rows 500000] [--dim 16] [--batches 64,256]
        [--epochs 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TFSCALE_VIRTUAL_DEVICES"] = "2"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import keras
import numpy as np
import tensorflow as tf

import tfscale
from tfscale.profiling.callback import EpochClock

SEQUENCE, EXAMPLES = 20, 8192


def _bytes(value: Any) -> int:
    if isinstance(value, tf.IndexedSlices):
        return _bytes(value.values) + _bytes(value.indices)
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    count = value.shape.num_elements()
    if count is None:
        raise ValueError(f"a tensor of unknown static shape {value.shape}")
    return int(count) * value.dtype.size


@contextmanager
def _counted(seen: list[int]) -> Iterator[None]:
    """Records the bytes of what each traced ``ReplicaContext.all_reduce`` call is given."""
    original = tf.distribute.ReplicaContext.all_reduce

    def counting(self: Any, reduce_op: Any, value: Any, options: Any = None) -> Any:
        seen.append(_bytes(tf.nest.flatten(value, expand_composites=False)))
        return original(self, reduce_op, value, options)

    tf.distribute.ReplicaContext.all_reduce = counting  # type: ignore[method-assign]
    try:
        yield
    finally:
        tf.distribute.ReplicaContext.all_reduce = original  # type: ignore[method-assign]


def _model(strategy: tf.distribute.Strategy, rows: int, dim: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = keras.Input((SEQUENCE,), dtype="int32")
        hidden = keras.layers.Embedding(rows, dim)(inputs)
        hidden = keras.layers.GlobalAveragePooling1D()(hidden)
        model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(32)(hidden)))
        model.compile(keras.optimizers.Adam(1e-3), "mse")
    return model


def _run(runner: str, strategy: Any, args: argparse.Namespace, batch: int) -> tuple[float, int]:
    """Examples/s of the fastest timed epoch, and the all-reduce bytes of one step."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, args.rows, (EXAMPLES, SEQUENCE)).astype("int32")
    y = rng.normal(size=(EXAMPLES, 1)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
    model = _model(strategy, args.rows, args.dim)
    clock, seen = EpochClock(), []
    fit = {"epochs": args.epochs + 1, "callbacks": [clock], "verbose": 0}
    with _counted(seen):
        if runner == "keras":
            model.fit(dataset, **fit)
        else:
            tfscale.fit(model, dataset, strategy=strategy, **fit)
    per_replica_traces = strategy.num_replicas_in_sync
    step_bytes = sum(seen) // per_replica_traces
    return EXAMPLES / min(clock.times[1:]), step_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    strategy = tf.distribute.MirroredStrategy(devices, tf.distribute.ReductionToOneDevice())
    dense = args.rows * args.dim * 4
    table = Table(
        title=f"{args.rows:,}-row embedding (dense gradient {dense / 1e6:.1f} MB), "
        f"2 replicas, median of {args.repeats}"
    )
    for column in (
        "global batch",
        "keras bytes/step",
        "tfscale bytes/step",
        "keras ex/s",
        "tfscale ex/s",
        "ratio",
    ):
        table.add_column(column, justify="right")
    for batch in (int(b) for b in args.batches.split(",")):
        rates: dict[str, list[float]] = {"keras": [], "tfscale": []}
        sizes: dict[str, int] = {}
        for _ in range(args.repeats):
            for runner, values in rates.items():
                rate, sizes[runner] = _run(runner, strategy, args, batch)
                values.append(rate)
        ratio = statistics.median(
            t / k for t, k in zip(rates["tfscale"], rates["keras"], strict=True)
        )
        row = (
            str(batch),
            f"{sizes['keras']:,}",
            f"{sizes['tfscale']:,}",
            f"{statistics.median(rates['keras']):,.0f}",
            f"{statistics.median(rates['tfscale']):,.0f}",
            f"{ratio:.2f}x",
        )
        table.add_row(*row)
        print(*row, flush=True)
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
