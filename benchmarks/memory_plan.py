"""The memory plan against the allocator's measured peak: an MLP, a CNN and a small
Transformer at two per-replica batches each, on 2 logical CPUs (MirroredStrategy, Adam).

Each row runs in its own process with ``TF_CPU_ALLOCATOR_USE_BFC=true`` (the CPU's BFC
allocator reports current and peak bytes), so that no other row's tensors are in its
allocator. The step is ``tfscale bench``'s (``MeasuredStep``: ``tfscale.fit``'s update) and
the measurement is bench's own (``tfscale.training.memory.report.measure_memory``): the plan made
before the first step, then the allocator's peak over a few updates after a warm-up. The two
logical CPUs share one allocator, so the measured peak is compared with the plan summed over
both devices. Done when every row's planned / measured is within 0.8-1.2.

    TF_CPU_ALLOCATOR_USE_BFC=true python benchmarks/memory_plan.py [--steps 4]
        [--models mlp,cnn,transformer] [--batches 32,128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "src")


def build(kind: str) -> Any:
    """The row's model, compiled with Adam and a sparse cross-entropy on logits."""
    import keras

    layers = keras.layers
    if kind == "mlp":
        inputs = keras.Input((784,))
        h = layers.Dense(1024, activation="relu")(inputs)
        h = layers.Dense(1024, activation="relu")(h)
    elif kind == "cnn":
        inputs = keras.Input((32, 32, 3))
        h = layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
        h = layers.Conv2D(64, 3, padding="same", activation="relu")(h)
        h = layers.MaxPooling2D(2)(h)
        h = layers.Conv2D(64, 3, padding="same", activation="relu")(h)
        h = layers.GlobalAveragePooling2D()(h)
    elif kind == "transformer":
        inputs = keras.Input((64, 32))  # 64 tokens of 32 features, two encoder blocks
        h = layers.Dense(128)(inputs)
        for _ in range(2):
            attended = layers.MultiHeadAttention(4, 32)(h, h)
            h = layers.LayerNormalization()(h + attended)
            forward = layers.Dense(128)(layers.Dense(512, activation="gelu")(h))
            h = layers.LayerNormalization()(h + forward)
        h = layers.GlobalAveragePooling1D()(h)
    else:
        raise SystemExit(f"unknown model {kind!r}: mlp, cnn or transformer")
    model = keras.Model(inputs, layers.Dense(10)(h), name=kind)
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def row(kind: str, batch: int, steps: int) -> dict[str, Any]:
    """One row, in this process: plan, warm up, measure (bench's measurement)."""
    import numpy as np

    from tfscale.profiling.harness import MeasuredStep, Workload
    from tfscale.training.memory.report import measure_memory

    shape = tuple(int(d) for d in build(kind).inputs[0].shape[1:])
    rng = np.random.default_rng(0)
    # Two global batches of data: the input pipeline's own copy stays small beside the step.
    x = rng.standard_normal((4 * batch, *shape)).astype(np.float32)
    y = rng.integers(0, 10, 4 * batch).astype(np.int32)
    devices = ["/cpu:0", "/cpu:1"]
    with MeasuredStep(Workload(kind, lambda: build(kind), x, y), devices, batch) as step:
        memory = measure_memory(step, devices, steps=steps)
    (measured,) = memory["measured"]
    parts = memory["plan"]["devices"][0]
    return {
        "model": kind,
        "batch": batch,
        "planned": measured["planned_bytes"],
        "measured": measured["peak_bytes"],
        "start": measured["start_bytes"],
        "ratio": measured["planned_over_measured"],
        "parts": {
            k[:-6]: v for k, v in parts.items() if k.endswith("_bytes") and k != "peak_bytes"
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,cnn,transformer")
    parser.add_argument("--batches", default="32,128", help="per-replica batches")
    parser.add_argument("--steps", type=int, default=4, help="warm-up and measured updates")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # a child: KIND:BATCH
    args = parser.parse_args()
    if args.row:
        kind, batch = args.row.split(":")
        print("ROW " + json.dumps(row(kind, int(batch), args.steps)))
        return
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TFSCALE_VIRTUAL_DEVICES="2")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    mib = 2**20
    print(
        f"{'model':<12}{'batch/replica':>14}{'planned MiB':>13}{'measured MiB':>14}"
        f"{'held before MiB':>17}{'planned/measured':>18}"
    )
    worst = 0.0
    for kind in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            done = subprocess.run(
                [sys.executable, __file__, "--row", f"{kind}:{batch}", "--steps", str(args.steps)],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            lines = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
            if done.returncode or not lines:
                raise SystemExit(f"{kind} {batch} failed:\n{done.stderr[-3000:]}")
            r = json.loads(lines[-1][4:])
            worst = max(worst, abs(r["ratio"] - 1))
            print(
                f"{kind:<12}{batch:>14}{r['planned'] / mib:>13.1f}{r['measured'] / mib:>14.1f}"
                f"{r['start'] / mib:>17.1f}{r['ratio']:>18.2f}"
            )
    print(f"largest deviation: {100 * worst:.0f}% (target: within 20%)")


if __name__ == "__main__":
    main()
