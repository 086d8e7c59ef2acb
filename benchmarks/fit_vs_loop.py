"""tfscale.fit against the engine's ceiling: a hand-written ``strategy.run`` loop.

The loop is what a user writing tf.distribute by hand would write (TensorFlow's custom
training loop guide): a ``tf.data`` pipeline distributed with
``experimental_distribute_dataset``, one ``tf.function`` running ``strategy.run`` of a
``GradientTape`` step, ``optimizer.apply_gradients``, the loss summed across replicas and
read once per epoch. By default (the faster form) one iterator serves a call's epochs (the
data repeated, as tfscale.fit does) and each step reads its batch inside the function (the
guide's "iterating inside a tf.function"); ``--loop batches`` is the guide's first form, a
``for batch in dist_dataset`` pass per epoch (an iterator per epoch, batches read in
Python). Both sides train the same model (same initial weights), on the same data, global
batch and update (Adam on the mean gradient over the global batch), from the same input:

- ``arrays``: ``tfscale.fit(model, x, y, shuffle=True)``; the loop reshuffles
  ``from_tensor_slices((x, y))`` every epoch (``shuffle(n)``).
- ``tf.data``: the same batched dataset given to both.
- ``generator``: a Python generator of batches; ``tfscale.fit`` reads it as ``model.fit``
  does, the loop through ``from_generator``. Its ceiling is the generator itself.

Both sides run as a user would write them: the loop one step per ``tf.function`` call (the
tutorial's), ``tfscale.fit`` with ``verbose=0`` and no callback, where it runs several steps
per call (``fit.auto_steps_per_execution``: nothing watches batches).

A measurement is one whole call of ``--epochs`` epochs on a model already trained once (the
functions are traced): ``tfscale.fit(...)`` against one loop call (its iterators included).
Calls of the two sides alternate; the table shows each side's median seconds and the median
and range of the per-repeat ratio loop seconds / tfscale seconds (above 1: tfscale is
faster). Devices are logical CPUs (``TFSCALE_VIRTUAL_DEVICES=2``); 1 device is
``OneDeviceStrategy``, 2 is ``MirroredStrategy`` with ``ReductionToOneDevice``, what
``tfscale.choose_strategy`` picks for logical CPUs.

    python benchmarks/fit_vs_loop.py [--repeats 9] [--examples 8192] [--batch 128]
        [--epochs 3] [--models mlp,cnn] [--devices 1,2] [--inputs arrays,tf.data,generator]
        [--loop iterator|batches]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TFSCALE_VIRTUAL_DEVICES"] = "2"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import keras
import numpy as np
import tensorflow as tf

import tfscale
from tfscale.workloads import build_model, synthetic_classification, synthetic_images

INPUTS = ("arrays", "tf.data", "generator")


def _data(kind: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    return synthetic_images(n) if kind == "cnn" else synthetic_classification(n, 64)


def _model(kind: str, strategy: tf.distribute.Strategy) -> keras.Model:
    """The same initial weights on every call (seeded initialisers); loss only, no metric,
    so both sides compute the same things per step."""
    shape = (8, 8, 1) if kind == "cnn" else (64,)
    with strategy.scope():
        model = build_model(kind, input_shape=shape, optimizer="adam", learning_rate=1e-3)
        model.compile(optimizer=model.optimizer, loss=model.loss)
    return model


def _batches(x: np.ndarray, y: np.ndarray, batch: int, epochs: int) -> Iterator[Any]:
    """The generator input: every epoch in a new random order, a batch at a time."""
    rng = np.random.default_rng(0)
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for start in range(0, len(x), batch):
            index = order[start : start + batch]
            yield x[index], y[index]


class _Loop:
    """The hand-written tf.distribute loop (one per model, traced on its first call).

    ``form="iterator"`` (the default, the faster): one iterator for all epochs, each call of
    the compiled step reading its batch inside the function (``next(iterator)``);
    ``form="batches"``: the tutorial's ``for batch in distributed_dataset: step(batch)`` per
    epoch, which reads each batch in Python.
    """

    def __init__(
        self, model: keras.Model, strategy: tf.distribute.Strategy, batch: int, form: str
    ) -> None:
        self.strategy = strategy
        self.form = form
        with strategy.scope():
            # Built in the scope, before the first step (see DESIGN.md's custom-loop notes).
            model.optimizer.build(model.trainable_variables)
        per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

        def replica_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = tf.nn.compute_average_loss(per_example(y, logits), global_batch_size=batch)
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        def step(x: Any, y: Any) -> tf.Tensor:
            losses = strategy.run(replica_step, args=(x, y))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

        self.on_batch = tf.function(step)
        self.on_iterator = tf.function(lambda iterator: step(*next(iterator)))

    def __call__(self, dataset: tf.data.Dataset, epochs: int, steps: int) -> float:
        """Trains ``epochs`` epochs of ``steps`` batches: with ``form="iterator"`` the data
        of all epochs (``dataset``: repeated) through one iterator, as tfscale.fit does;
        with ``"batches"`` one pass over ``dataset`` (one epoch) per epoch."""
        distributed = self.strategy.experimental_distribute_dataset(dataset)
        loss = 0.0
        iterator = iter(distributed) if self.form == "iterator" else None
        for _ in range(epochs):
            total = tf.constant(0.0)
            if iterator is None:
                for x, y in distributed:
                    total += self.on_batch(x, y)
            else:
                for _ in range(steps):
                    total += self.on_iterator(iterator)
            loss = float(total) / steps  # read once per epoch, as a loop that logs would
        return loss


def _sides(
    input_kind: str, kind: str, strategy: Any, data: tuple[Any, Any], args: argparse.Namespace
) -> dict[str, Callable[[], None]]:
    """The two calls of one row: ``{"loop": ..., "tfscale": ...}``."""
    x, y = data
    batch, epochs = args.batch, args.epochs
    steps = -(-len(x) // batch)
    fitted = _model(kind, strategy)
    loop = _Loop(_model(kind, strategy), strategy, batch, args.loop)
    signature = (
        tf.TensorSpec((None, *x.shape[1:]), tf.float32),
        tf.TensorSpec((None,), tf.int32),
    )

    def pipeline() -> tf.data.Dataset:
        sliced = tf.data.Dataset.from_tensor_slices((x, y))
        return sliced.shuffle(len(x)).batch(batch).prefetch(tf.data.AUTOTUNE)

    dataset = pipeline()
    fit = {"batch_size": None, "epochs": epochs, "verbose": 0, "strategy": strategy}

    def run_loop() -> None:
        # One iterator over every epoch's data ("iterator"), or one pass per epoch.
        passes = epochs if loop.form == "iterator" else 1
        if input_kind == "generator":
            source = tf.data.Dataset.from_generator(
                lambda: _batches(x, y, batch, passes), output_signature=signature
            )
            loop(source.prefetch(tf.data.AUTOTUNE), epochs, steps)
        else:
            # Arrays: the pipeline a loop writer makes of them; tf.data: the given dataset.
            data = pipeline() if input_kind == "arrays" else dataset
            loop(data.repeat(passes) if passes > 1 else data, epochs, steps)

    def run_fit() -> None:
        if input_kind == "arrays":
            tfscale.fit(fitted, x, y, **{**fit, "batch_size": batch})
        elif input_kind == "tf.data":
            tfscale.fit(fitted, dataset, **fit)
        else:
            tfscale.fit(fitted, _batches(x, y, batch, epochs), steps_per_epoch=steps, **fit)

    return {"loop": run_loop, "tfscale": run_fit}


def _strategies(replicas: list[int]) -> list[tuple[int, tf.distribute.Strategy]]:
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    out: list[tuple[int, tf.distribute.Strategy]] = []
    for n in replicas:
        if n == 1:
            out.append((1, tf.distribute.OneDeviceStrategy(devices[0])))
        else:
            one = tf.distribute.ReductionToOneDevice()
            out.append((n, tf.distribute.MirroredStrategy(devices[:n], one)))
    return out


def _row(
    sides: dict[str, Callable[[], None]], repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU seconds of ``repeats`` calls of each side, alternating."""
    for call in sides.values():
        call()  # traces
    wall: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(repeats):
        # Alternating, and the order flipped every repeat: neither side always goes first.
        for name in sides if i % 2 == 0 else reversed(list(sides)):
            start, start_cpu = time.perf_counter(), time.process_time()
            sides[name]()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return wall, cpu


def _ratios(seconds: dict[str, list[float]]) -> list[float]:
    return [loop / fit for loop, fit in zip(seconds["loop"], seconds["tfscale"], strict=True)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--examples", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--devices", default="1,2")
    parser.add_argument("--inputs", default=",".join(INPUTS))
    parser.add_argument("--loop", choices=("iterator", "batches"), default="iterator")
    args = parser.parse_args(argv)
    print(
        f"tfscale.fit vs a hand-written strategy.run loop: {args.examples} examples, global "
        f"batch {args.batch}, {args.epochs} epochs per call, {args.repeats} alternating repeats, "
        f"loop: {'one iterator, read in the step' if args.loop == 'iterator' else 'for batch in'}"
    )
    print(
        "ratio = loop seconds / tfscale.fit seconds, per repeat (>= 1: tfscale.fit at least as "
        "fast); CPU ratio: the same with the process's CPU seconds"
    )
    header = ("loop s", "tfscale.fit s", "ratio", "ratio range", "CPU ratio")
    print(f"{'model':5} {'devices':>7} {'input':>9} " + " ".join(f"{h:>13}" for h in header))
    strategies = _strategies([int(n) for n in args.devices.split(",")])
    for kind in args.models.split(","):
        data = _data(kind, args.examples)
        for replicas, strategy in strategies:
            for input_kind in args.inputs.split(","):
                seconds, cpu = _row(_sides(input_kind, kind, strategy, data, args), args.repeats)
                ratios, cpu_ratios = _ratios(seconds), _ratios(cpu)
                cells = (
                    f"{statistics.median(seconds['loop']):.3f}",
                    f"{statistics.median(seconds['tfscale']):.3f}",
                    f"{statistics.median(ratios):.2f}x",
                    f"{min(ratios):.2f}-{max(ratios):.2f}x",
                    f"{statistics.median(cpu_ratios):.2f}x",
                )
                print(
                    f"{kind:5} {replicas:>7} {input_kind:>9} "
                    + " ".join(f"{c:>13}" for c in cells),
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
