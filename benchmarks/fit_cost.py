"""The CPU cost of one small ``tfscale.fit`` call on 2 replicas against Keras's one-device
``model.fit`` of the same model: what every in-process training test pays, and what a
hyperparameter sweep or a TaskPool of small fits pays per fit (issue #41).

Each side trains a FRESH model (built and compiled anew, tracing included) for 2 epochs of 256
examples (batch 32), after a warm-up fit of another model in the same process, so that
process-wide start-up (TensorFlow's first graph, Keras's imports) is paid by neither. Keras
trains on one device (``/device:CPU:0``); tfscale.fit on MirroredStrategy over 2 logical CPUs,
as the tests' ``strategy_for(2)`` does. The CPU seconds are the process's (user + system,
``time.process_time``); the sides alternate over ``--repeats`` rounds and the table shows each
side's median and the median of the per-round ratios. Both fits start from the same initial
weights and read the same batches, and their weights are compared (relative difference).

    python benchmarks/fit_cost.py [--repeats 5] [--profile tfscale|keras] [--steps-per-call]
                                  [--sweep N]

``--profile`` runs cProfile over one more fit of that side (a fresh model after the rounds)
and prints the 40 functions with the most cumulative time. ``--steps-per-call`` adds the
measurement behind ``fit.AUTO_MIN_STEPS``: tfscale.fit's CPU seconds at one and at 16 steps
per call for fits of 16 to 256 steps (2 to 32 epochs of 8 batches), same rounds and medians.
``--sweep N`` adds what a sweep of fits in one process keeps: each side in turn makes N fresh
fits after ``WARM_FITS`` of its own, and the table shows the process's resident memory growth
per fit over them (after ``malloc_trim``: what is kept, not the allocator's free pages) and
the graphs (``FuncGraph``) its fits left alive; tfscale.fit with ``remat=True``
(``tf.recompute_grad``) and Keras's ``model.fit`` under the same MirroredStrategy are two more
sides.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import gc
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TFSCALE_VIRTUAL_DEVICES"] = "2"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import keras
import numpy as np
import tensorflow as tf

import tfscale
from tfscale.testing import live_graphs, mirrored_on_cpus, relative_difference
from tfscale.workloads import build_model, synthetic_classification

FEATURES, CLASSES, EXAMPLES, BATCH, EPOCHS = 12, 4, 256, 32, 2
# Fits each side of --sweep makes before it measures: a process's first fits grow it by more
# than the later ones (TensorFlow's caches filling: 4.7 MiB a fit over a tfscale sweep's first
# 10 fits, 1.7 over the next 50).
WARM_FITS = 5


def _model(strategy: tf.distribute.Strategy | None) -> keras.Model:
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        return build_model(
            "mlp", input_shape=(FEATURES,), classes=CLASSES, width=4, learning_rate=0.1
        )


def _keras_fit(x: np.ndarray, y: np.ndarray, initial: list[np.ndarray]) -> keras.Model:
    with tf.device("/device:CPU:0"):
        model = _model(None)
        model.set_weights(initial)
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model


def _tfscale_fit(
    strategy: tf.distribute.Strategy,
    epochs: int = EPOCHS,
    steps_per_execution: int | None = None,
    remat: bool = False,
) -> Callable[[np.ndarray, np.ndarray, list[np.ndarray]], keras.Model]:
    def fit(x: np.ndarray, y: np.ndarray, initial: list[np.ndarray]) -> keras.Model:
        model = _model(strategy)
        model.set_weights(initial)
        tfscale.fit(
            model, x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
            strategy=strategy, steps_per_execution=steps_per_execution, remat=remat,
        )  # fmt: skip
        return model

    return fit


def _cpu(run: Callable[[], Any]) -> tuple[float, Any]:
    start = time.process_time()
    result = run()
    return time.process_time() - start, result


def _keras_mirrored_fit(strategy: tf.distribute.Strategy) -> Callable[..., keras.Model]:
    def fit(x: np.ndarray, y: np.ndarray, initial: list[np.ndarray]) -> keras.Model:
        model = _model(strategy)
        model.set_weights(initial)
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        return model

    return fit


def _resident_mib() -> float:
    """The process's resident memory, after glibc has returned its free pages to the system
    (``malloc_trim``): what the fits keep, not what the allocator holds on to. Not glibc: the
    figure includes the allocator's free pages."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _sweep(
    sides: dict[str, Callable[..., keras.Model]], x: Any, y: Any, initial: Any, n: int
) -> None:
    print(f"\n{n} fresh fits per side in turn, one process (resident memory, Linux /proc,")
    print("after malloc_trim)")
    print("| fit | MiB per fit | graphs left alive by its fits |\n| --- | --- | --- |")
    for name, fit in sides.items():
        for _ in range(WARM_FITS):  # its first fits: what is made once per process
            fit(x, y, initial)
        gc.collect()
        graphs, start = set(live_graphs()), _resident_mib()
        for _ in range(n):
            fit(x, y, initial)
        gc.collect()
        left = len(set(live_graphs()) - graphs)
        print(f"| {name} | {(_resident_mib() - start) / n:.2f} | {left} |")


def _steps_per_call(
    strategy: tf.distribute.Strategy,
    x: np.ndarray,
    y: np.ndarray,
    initial: list[np.ndarray],
    repeats: int,
) -> None:
    steps = EXAMPLES // BATCH
    print("\ntfscale.fit, 2 replicas, CPU-s by steps per call (median of rounds)")
    print("| steps in the fit | 1 per call | 16 per call |\n| --- | --- | --- |")
    for epochs in (2, 4, 8, 16, 32):
        fits = {n: _tfscale_fit(strategy, epochs, n) for n in (1, 16)}
        spent: dict[int, list[float]] = {1: [], 16: []}
        for _ in range(repeats):
            for n, fit in fits.items():
                spent[n].append(_cpu(lambda fit=fit: fit(x, y, initial))[0])
        medians = {n: statistics.median(values) for n, values in spent.items()}
        print(f"| {epochs * steps} | {medians[1]:.3f} | {medians[16]:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", choices=("tfscale", "keras"))
    parser.add_argument("--steps-per-call", action="store_true")
    parser.add_argument("--sweep", type=int, default=0, metavar="N")
    args = parser.parse_args()
    strategy = mirrored_on_cpus(2)
    x, y = synthetic_classification(EXAMPLES, FEATURES, CLASSES, seed=7)
    initial = _model(None).get_weights()
    sides = {
        "keras model.fit, 1 device": _keras_fit,
        "tfscale.fit, 2 replicas": _tfscale_fit(strategy),
    }
    for fit in sides.values():  # the warm-up fits: process-wide start-up paid by neither
        fit(x, y, initial)
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    difference = 0.0
    for _ in range(args.repeats):
        weights = []
        for name, fit in sides.items():
            spent, model = _cpu(lambda fit=fit: fit(x, y, initial))
            seconds[name].append(spent)
            weights.append(model.get_weights())
        difference = max(difference, relative_difference(weights[1], weights[0]))
    keras_name, tfscale_name = sides
    ratios = [t / k for t, k in zip(seconds[tfscale_name], seconds[keras_name], strict=True)]
    print(
        f"{EPOCHS} epochs of {EXAMPLES} examples, batch {BATCH}, a fresh model each fit; ", end=""
    )
    print(f"median of {args.repeats} rounds (CPU-s, user + system)")
    print("| fit | CPU-s | vs Keras |\n| --- | --- | --- |")
    print(f"| {keras_name} | {statistics.median(seconds[keras_name]):.3f} | 1.00x |")
    print(
        f"| {tfscale_name} | {statistics.median(seconds[tfscale_name]):.3f} | "
        f"{statistics.median(ratios):.2f}x |"
    )
    print(f"weights: relative difference {difference:.1e}")
    if args.steps_per_call:
        _steps_per_call(strategy, x, y, initial, args.repeats)
    if args.sweep:
        swept = {
            **sides,
            "tfscale.fit, 2 replicas, remat=True": _tfscale_fit(strategy, remat=True),
            "keras model.fit, MirroredStrategy": _keras_mirrored_fit(strategy),
        }
        _sweep(swept, x, y, initial, args.sweep)
    if args.profile:
        fit = sides[keras_name if args.profile == "keras" else tfscale_name]
        profiler = cProfile.Profile()
        profiler.runcall(fit, x, y, initial)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
