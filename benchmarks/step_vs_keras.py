"""Steady-state time of one training step: tfscale's Trainer against Keras's train function.

The per-epoch costs that ``fit_vs_keras.py`` also counts (making and destroying the
distributed iterator, epoch logs) are left out: each side gets one long-lived iterator
over a repeating dataset and its compiled train function is called once per step, one
update per call, in alternating blocks of ``--steps`` calls. ``tfscale-nocond`` is
tfscale's update without the cross-replica ``tf.cond`` that skips a non-finite update
(for measuring that cond only; it would apply NaN updates). Small CNN, 2 logical CPUs,
MirroredStrategy with ``ReductionToOneDevice`` (what ``choose_strategy`` picks there)
or its default all-reduce.

    python benchmarks/step_vs_keras.py [--repeats 40] [--steps 32] [--all-reduce one|default]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TFSCALE_VIRTUAL_DEVICES"] = "2"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import tensorflow as tf

import tfscale  # noqa: F401  (splits the CPU into 2 logical devices)
from tfscale.interop.internals import symbolic_build
from tfscale.training.trainer import Trainer
from tfscale.workloads import build_model, synthetic_images

BATCH = 64


class _NoSkipTrainer(Trainer):
    """The same update, applied unconditionally (no cross-replica cond)."""

    def _update(self, batch: Any) -> tf.Tensor:
        strategy = self.strategy
        grads, loss, examples, finite_grads, finite_loss = strategy.run(
            self.step_fn.fused, args=(batch,)
        )
        values = [
            strategy.experimental_local_results(v)[0]
            for v in (finite_grads, finite_loss, loss, examples)
        ]
        finite_grads, finite_loss, loss, examples = values
        strategy.run(self.step_fn.apply, args=(grads,))
        self._loss_total.assign_add(tf.where(finite_loss, loss * examples, 0.0))
        self._examples.assign_add(examples)
        return tf.logical_and(finite_loss, finite_grads)


def _runner(name: str, strategy: Any, dataset: Any, sample: Any, steps: int) -> Callable[[], None]:
    with strategy.scope():
        model = build_model("cnn", input_shape=(8, 8, 1), optimizer="adam", learning_rate=1e-3)
        model.compile(optimizer=model.optimizer, loss=model.loss, metrics=["accuracy"])
        # What Keras's fit does before its first step (both sides start built).
        symbolic_build(model, sample)
        model.optimizer.build(model.trainable_variables)
    iterator = iter(dataset)
    if name == "keras":
        model.make_train_function()
        function = model.train_function

        def run() -> None:
            for _ in range(steps):
                function(iterator)

    else:
        cls = _NoSkipTrainer if name == "tfscale-nocond" else Trainer
        trainer = cls(model, strategy, sample_batch=sample, nominal_batch=BATCH)

        def run() -> None:
            for _ in range(steps):
                trainer.train(iterator, 1, logs=False)

    run()  # traces
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--all-reduce", choices=("one", "default"), default="one")
    parser.add_argument("--runners", default="keras,tfscale,tfscale-nocond")
    args = parser.parse_args(argv)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    reduction = tf.distribute.ReductionToOneDevice() if args.all_reduce == "one" else None
    strategy = tf.distribute.MirroredStrategy(devices, reduction)
    x, y = synthetic_images(4096)
    pipeline = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
    dataset = strategy.experimental_distribute_dataset(pipeline.repeat().prefetch(4))
    names = args.runners.split(",")
    runs = {n: _runner(n, strategy, dataset, (x[:BATCH], y[:BATCH]), args.steps) for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for name in names:
            start, start_cpu = time.perf_counter(), time.process_time()
            runs[name]()
            wall[name].append((time.perf_counter() - start) / args.steps * 1e3)
            cpu[name].append((time.process_time() - start_cpu) / args.steps * 1e3)
    first = names[0]
    print(f"ms per step, median of {args.repeats} blocks of {args.steps} ({args.all_reduce})")
    for name in names:
        speed = statistics.median(b / a for a, b in zip(wall[name], wall[first], strict=True))
        print(
            f"{name:15s} wall {statistics.median(wall[name]):6.2f}  "
            f"cpu {statistics.median(cpu[name]):6.2f}  speed vs {first} {speed:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
