"""Does the GPipe schedule really overlap stages? Time per batch, micro-batches 1 against 8.

Two stages on two logical CPU devices; TensorFlow's intra-op threads set to 1 (one core
per op) and inter-op threads to 2 (two ops at once), so each stage can hold one core.
The layers are big Dense matmuls, so compute dominates. For each micro-batch count M the
script times the forward pass (inference) and a training step (forward, backward, SGD
update) of the pipelined model.

Why the training speedup is smaller on CPU: with 2 inter-op threads, even the naive split
(M=1) runs two ops of one stage at once in the backward pass (a layer's input gradient and
its weight gradient do not depend on each other), so its backward already uses both cores.
A GPU runs one stage's ops on one stream, one after another, so there the naive split's
backward does not overlap either, and the pipeline's gain covers both passes.

Bubble estimator. One more run of each setting is traced with TensorFlow's profiler. Each
op of the pipelined model is named after its stage and micro-batch (``stage1_micro3/...``,
forward and backward), which gives, over the pipeline's span T (first op to last):
- stage busy: the union of the stage's op intervals, over T;
- stages at once: the share of T with ops of both stages running (0 without overlap);
- idle measured: 1 - sum over inter-op threads of each thread's busy time / (2 x T). The
  logical CPU devices share TensorFlow's inter-op threads (a thread runs whichever device's
  op is ready, so two micro-batches of one stage may run together), so the cores, one per
  stage, are what idles. With a perfect pipeline of equal stages, T = (M+S-1)*t and each
  core is busy M*t, which is the theory (S-1)/(M+S-1).
The split, the concatenation and the optimizer fall outside T. On a loaded machine op
intervals stretch (a descheduled thread still looks busy), so the trace shows the schedule
even when other processes take the wall-clock speedup away.

    python benchmarks/pipeline_overlap.py            # about 20 s on 2 cores
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # threads and devices must be set before it starts

tf.config.threading.set_intra_op_parallelism_threads(1)
THREADS = 2  # inter-op threads: one core per stage
tf.config.threading.set_inter_op_parallelism_threads(THREADS)

import tfscale  # noqa: E402

tfscale.use_virtual_devices(2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfscale.interop.internals import xplane_pb2  # noqa: E402
from tfscale.parallel.pipeline import PipelineModel, pipeline  # noqa: E402
from tfscale.parallel.schedule import bubble_fraction  # noqa: E402

DEVICES = ["/device:CPU:0", "/device:CPU:1"]
S = len(DEVICES)


def build(width: int, depth: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    layers: list[keras.layers.Layer] = [keras.Input((width,))]
    layers += [keras.layers.Dense(width, activation="tanh") for _ in range(depth)]
    return keras.Sequential(layers)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_fn(piped: PipelineModel, x: tf.Tensor, y: tf.Tensor) -> Callable[[], object]:
    """One training step of the pipelined model: forward, backward, SGD update."""
    optimizer = keras.optimizers.SGD(1e-4)
    optimizer.build(piped.trainable_variables)

    @tf.function
    def step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(piped(x, training=True) - y))
        grads = tape.gradient(loss, piped.trainable_variables)
        optimizer.apply(grads, piped.trainable_variables)
        return loss

    return lambda: step().numpy()


def forward_fn(piped: PipelineModel, x: tf.Tensor) -> Callable[[], object]:
    """The forward pass alone (inference, what ``predict`` runs per batch)."""

    @tf.function
    def forward() -> tf.Tensor:
        return tf.reduce_sum(piped(x, training=False))

    return lambda: forward().numpy()


@dataclass(frozen=True)
class Trace:
    """Where one traced run spent its time (seconds)."""

    span: float  # first pipeline op start to last pipeline op end
    thread_busy: float  # sum over threads of the union of their pipeline ops' intervals
    stage_busy: list[float]  # per stage, union of its ops' intervals
    stages_at_once: float  # time with ops of stage 0 and stage 1 running together


def trace_run(fn: Callable[[], object]) -> Trace:
    """Runs ``fn`` once under TensorFlow's profiler and reads its op intervals."""
    folder = tempfile.mkdtemp(prefix="pipeline_trace_")
    try:
        tf.profiler.experimental.start(folder)
        fn()
        tf.profiler.experimental.stop()
        space = xplane_pb2().XSpace()
        for path in glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True):
            with open(path, "rb") as handle:
                space.ParseFromString(handle.read())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    by_stage: list[list[tuple[int, int]]] = [[] for _ in range(S)]
    by_thread: list[list[tuple[int, int]]] = []
    for plane in space.planes:
        for line in plane.lines:
            spans = []
            for event in line.events:
                match = _STAGE.search(plane.event_metadata[event.metadata_id].name)
                if match:
                    start = line.timestamp_ns * 1000 + event.offset_ps
                    spans.append((start, start + event.duration_ps))
                    by_stage[int(match.group(1))].append(spans[-1])
            if spans:
                by_thread.append(_union(spans))
    if not all(by_stage):
        nan = float("nan")
        return Trace(nan, nan, [nan] * S, nan)
    merged = [_union(spans) for spans in by_stage]
    first = min(spans[0][0] for spans in merged)
    last = max(spans[-1][1] for spans in merged)
    return Trace(
        span=(last - first) * 1e-12,
        thread_busy=sum(_length(spans) for spans in by_thread) * 1e-12,
        stage_busy=[_length(spans) * 1e-12 for spans in merged],
        stages_at_once=_intersection(merged[0], merged[1]) * 1e-12,
    )


def _length(spans: list[tuple[int, int]]) -> int:
    return sum(end - start for start, end in spans)


_STAGE = re.compile(r"stage(\d+)_micro\d+/")


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _intersection(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--width", type=int, default=1024, help="units of each Dense layer")
    parser.add_argument("--depth", type=int, default=4, help="Dense layers (cut in 2 stages)")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=9, help="timed steps per setting")
    args = parser.parse_args()
    model = build(args.width, args.depth)
    rng = np.random.default_rng(1)
    x = tf.constant(rng.standard_normal((args.batch, args.width)), tf.float32)
    y = tf.constant(rng.standard_normal((args.batch, args.width)), tf.float32)
    runs: dict[tuple[str, int], Callable[[], object]] = {}
    for m in args.micro:
        piped = pipeline(model, DEVICES, microbatches=m)
        assert isinstance(piped, PipelineModel)
        runs["forward", m] = forward_fn(piped, x)
        runs["train", m] = step_fn(piped, x, y)
    for fn in runs.values():
        fn()  # trace and warm up
    # Interleave the settings so that noise from other processes hits them alike.
    times: dict[tuple[str, int], list[float]] = {key: [] for key in runs}
    for _ in range(args.repeats):
        for key, fn in runs.items():
            times[key].append(timed(fn))

    sizes = piped.plan.sizes if piped.plan else "?"
    print(
        f"2 stages {sizes} of Dense({args.width}) x {args.depth}, batch {args.batch}, "
        f"intra-op threads 1, inter-op threads 2, median of {args.repeats} runs"
    )
    header = (
        f"{'pass':<8} {'micro':>5}  {'ms/batch':>8}  {'speedup':>7}  {'stage0 busy':>11}  "
        f"{'stage1 busy':>11}  {'stages at once':>14}  {'idle measured':>13}  {'bubble theory':>13}"
    )
    print(header)
    print("-" * len(header))
    for kind in ("forward", "train"):
        base = statistics.median(times[kind, args.micro[0]])
        for m in args.micro:
            t = statistics.median(times[kind, m])
            trace = trace_run(runs[kind, m])
            idle = 1 - trace.thread_busy / (THREADS * trace.span)
            busy0, busy1 = (b / trace.span for b in trace.stage_busy)
            print(
                f"{kind:<8} {m:>5}  {t * 1e3:>8.1f}  {base / t:>6.2f}x  {busy0:>11.0%}  "
                f"{busy1:>11.0%}  {trace.stages_at_once / trace.span:>14.0%}  {idle:>13.2f}  "
                f"{bubble_fraction(S, m):>13.2f}"
            )
    print(
        f"forward = the model's forward pass (inference); train = forward, backward, SGD update.\n"
        f"speedup = time at micro={args.micro[0]} / time. From one profiled run, over the "
        "pipeline's span: stage busy = union of the stage's op intervals; stages at once =\n"
        "both stages running together; idle measured = 1 - (each thread's busy time, "
        f"summed) / ({THREADS} threads x span), to compare with the bubble theory."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
