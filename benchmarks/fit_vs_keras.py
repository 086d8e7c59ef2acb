"""Examples/s of tfscale.fit against Keras ``model.fit`` under the same strategy, same data,
and the cost of a whole call of each on an already trained model.

Configurations: MLP and small CNN, 1 device (OneDeviceStrategy) and 2 logical CPUs
(MirroredStrategy), steps_per_execution 1 and 8. On 2 devices both loops run under the
same all-reduce: MirroredStrategy's default one (under which Keras fit with
steps_per_execution > 1 fails, keras-team/keras#19246; the row shows the failure) and
``ReductionToOneDevice`` (what ``tfscale.choose_strategy`` picks for logical CPUs, under
which Keras runs every row). The process splits its CPU into 2 logical devices before
TensorFlow starts and uses subsets. Each measurement trains one warm-up epoch (tracing),
then times ``--epochs`` epochs and keeps the fastest; runs of the two loops alternate, and
the table shows the median over ``--repeats`` runs of each side and the median of the
per-repeat ratios, so a noisy machine affects both sides alike.

``--calls N`` measures instead the wall time of a whole call of ``--call-epochs`` epochs
(default 2; ``tfscale.fit`` or ``model.fit``) on a model that has already been trained once,
N calls per side, alternating: what a second call costs when the compiled functions are
reused (no retrace), and, with many short epochs, what an iterator per epoch costs. Each
call's time outside training (before the callbacks' ``on_train_begin`` and after their
``on_train_end``: set-up and tear-down) is shown as its median and worst over the N calls,
for arrays and a ``tf.data`` dataset (``--call-inputs``); tfscale.fit runs with its
non-finite guard on, as by default.

    python benchmarks/fit_vs_keras.py [--epochs 4] [--repeats 5] [--examples 4096]
        [--models mlp,cnn] [--devices 1,2] [--steps-per-execution 1,8]
        [--calls N [--call-epochs E] [--call-inputs arrays,tf.data]]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TFSCALE_VIRTUAL_DEVICES"] = "2"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import keras
import tensorflow as tf

import tfscale
from tfscale.profiling.callback import EpochClock
from tfscale.workloads import build_model, synthetic_classification, synthetic_images

BATCH = 64


def _data(kind: str, n: int) -> tuple[Any, Any]:
    return synthetic_images(n) if kind == "cnn" else synthetic_classification(n, 64)


def _model(kind: str, strategy: tf.distribute.Strategy, spe: int) -> keras.Model:
    shape = (8, 8, 1) if kind == "cnn" else (64,)
    with strategy.scope():
        model = build_model(kind, input_shape=shape, optimizer="adam", learning_rate=1e-3)
        model.compile(
            optimizer=model.optimizer,
            loss=model.loss,
            metrics=["accuracy"],
            steps_per_execution=spe,
        )
    return model


def _measure(runner: str, kind: str, strategy: Any, spe: int, data: Any, epochs: int) -> float:
    model = _model(kind, strategy, spe)
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
            steps_per_execution=spe,
            callbacks=[clock],
            strategy=strategy,
            verbose=0,
        )
    # The first epoch traces. The fastest later epoch is the least disturbed by other
    # processes on a shared machine; both loops are measured the same way.
    return len(x) / min(clock.times[1:])


class _Window(keras.callbacks.Callback):  # type: ignore[misc]
    """When training began and ended, as the callbacks see it."""

    def on_train_begin(self, logs: Any = None) -> None:
        self.begin = time.perf_counter()

    def on_train_end(self, logs: Any = None) -> None:
        self.end = time.perf_counter()


def _call_seconds(
    kind: str, strategy: Any, data: Any, input_kind: str, calls: int, epochs: int
) -> dict[str, tuple[list[float], list[float]]]:
    """Wall seconds of ``calls`` calls of ``epochs`` epochs on a warm model, for each loop,
    alternating: ``{runner: (whole calls, time outside training)}``."""
    x, y = data
    models = {"keras": _model(kind, strategy, 1), "tfscale": _model(kind, strategy, 1)}
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x)).batch(BATCH)
    given = {"x": x, "y": y, "batch_size": BATCH} if input_kind == "arrays" else {"x": dataset}

    def call(runner: str) -> tuple[float, float]:
        window = _Window()
        start = time.perf_counter()
        if runner == "keras":
            models[runner].fit(**given, epochs=epochs, callbacks=[window], verbose=0)
        else:
            tfscale.fit(
                models[runner], **given, epochs=epochs, callbacks=[window], strategy=strategy,
                verbose=0,
            )  # fmt: skip
        seconds = time.perf_counter() - start
        return seconds, seconds - (window.end - window.begin)

    for runner in models:
        call(runner)  # traces
    out: dict[str, tuple[list[float], list[float]]] = {runner: ([], []) for runner in models}
    for i in range(calls):
        for runner in models if i % 2 == 0 else reversed(list(models)):
            whole, outside = call(runner)
            out[runner][0].append(whole)
            out[runner][1].append(outside)
    return out


def _calls_table(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"a {args.call_epochs}-epoch call of {args.examples} examples on a trained model, "
        f"{args.calls} calls each; outside training: median / worst, ms"
    )
    columns = ("model", "devices", "all-reduce", "input", "keras fit s", "tfscale.fit s",
               "ratio", "keras outside", "tfscale outside")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    strategies = _strategies(args.devices)  # once: see tensorflow/tensorflow#62790
    for kind in args.models.split(","):
        data = _data(kind, args.examples)
        for replicas, reduction, strategy in strategies:
            for input_kind in args.call_inputs.split(","):
                seconds = _call_seconds(
                    kind, strategy, data, input_kind, args.calls, args.call_epochs
                )
                whole = {r: statistics.median(v[0]) for r, v in seconds.items()}
                outside = {
                    r: f"{statistics.median(v[1]) * 1e3:.0f} / {max(v[1]) * 1e3:.0f}"
                    for r, v in seconds.items()
                }
                ratio = whole["tfscale"] / whole["keras"]
                row = (kind, str(replicas), reduction, input_kind)
                cells = (
                    f"{whole['keras']:.3f}", f"{whole['tfscale']:.3f}", f"{ratio:.2f}x",
                    outside["keras"], outside["tfscale"],
                )  # fmt: skip
                table.add_row(*row, *cells)
                print(*row, *cells, flush=True)
    Console().print(table)
    return 0


def _strategies(replicas: list[int]) -> list[tuple[int, str, tf.distribute.Strategy]]:
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    out: list[tuple[int, str, tf.distribute.Strategy]] = []
    if 1 in replicas:
        out.append((1, "-", tf.distribute.OneDeviceStrategy(devices[0])))
    if 2 in replicas:
        out.append((2, "default", tf.distribute.MirroredStrategy(devices)))
        one = tf.distribute.ReductionToOneDevice()
        out.append((2, "to one device", tf.distribute.MirroredStrategy(devices, one)))
    return out


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--examples", type=int, default=4096)
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--devices", type=_ints, default=[1, 2])
    parser.add_argument("--steps-per-execution", type=_ints, default=[1, 8])
    parser.add_argument("--calls", type=int, default=0)
    parser.add_argument("--call-epochs", type=int, default=2)
    parser.add_argument("--call-inputs", default="arrays,tf.data")
    args = parser.parse_args(argv)
    if args.calls:
        return _calls_table(args)
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"tfscale.fit vs keras fit, examples/s (global batch {BATCH}, "
        f"median of {args.repeats} repeats)"
    )
    columns = ("model", "devices", "all-reduce", "steps/exec", "keras fit", "tfscale.fit")
    for column in (*columns, "ratio"):
        table.add_column(column, justify="right")
    strategies = _strategies(args.devices)
    for kind in args.models.split(","):
        data = _data(kind, args.examples)
        for replicas, reduction, strategy in strategies:
            for spe in args.steps_per_execution:
                rates: dict[str, list[float]] = {"keras": [], "tfscale": []}
                failed: dict[str, str] = {}
                for _ in range(args.repeats):
                    for runner, values in rates.items():
                        if runner in failed:
                            continue
                        try:
                            values.append(_measure(runner, kind, strategy, spe, data, args.epochs))
                        except Exception as error:  # report it in the table, go on
                            failed[runner] = f"fails ({type(error).__name__})"
                shown = {
                    r: failed[r] if r in failed else f"{statistics.median(v):,.0f}"
                    for r, v in rates.items()
                }
                ratio = "-"
                if not failed:
                    pairs = zip(rates["tfscale"], rates["keras"], strict=True)
                    ratio = f"{statistics.median(t / k for t, k in pairs):.2f}x"
                row = (kind, str(replicas), reduction, str(spe), shown["keras"], shown["tfscale"])
                table.add_row(*row, ratio)
                print(" ".join(row), ratio, flush=True)
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
