"""A ``tfscale launch -n 2`` job: the custom loops of ``tests/training/loops.py`` under
MultiWorkerMirroredStrategy, each with its one ``tfscale.prepare_loop`` line.

Usage: ``tfscale launch -n 2 custom_loops_job.py OUT_DIR LOOPS``, ``LOOPS`` the names of
the loops to run, comma-separated (``main``'s ``loops``); each worker writes
``OUT_DIR/<loop>-<worker>.npz`` (its weights) and ``OUT_DIR/worker<i>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tensorflow as tf

# The strategy first: collectives are configured before any other TensorFlow op.
strategy = tf.distribute.MultiWorkerMirroredStrategy()

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/

import tfscale  # noqa: E402
from tfscale.training.loop import loop_state  # noqa: E402
from tfscale.workloads import synthetic_classification  # noqa: E402
from training.loops import (  # noqa: E402
    convention_loop,
    guide_loop,
    images,
    multi_worker_loop,
    tutorial_loop,
    user_loop,
)

# training.helpers.DATA, made here: importing helpers would build its OneDeviceStrategy, and
# the launcher stops a worker that builds a strategy over its own devices only.
DATA = synthetic_classification(256, 12, 4, seed=7)


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2].split(",")
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    report: dict[str, int] = {"replicas": strategy.num_replicas_in_sync}

    def prepare(model: object, optimizer: object) -> object:
        return tfscale.prepare_loop(model, optimizer)

    def accumulated() -> list[np.ndarray]:
        def accumulate(model: object, optimizer: object) -> object:
            return tfscale.prepare_loop(model, optimizer, accumulation_steps=2)

        # tf.reduce_mean, 2 batches of 16 per update: one device's update on batches of 32.
        weights, optimizer = convention_loop(strategy, accumulate, x[:64], y[:64], "reduce_mean")
        state = loop_state(optimizer)
        assert state is not None
        report["accumulated_updates"] = int(optimizer.iterations.numpy())
        report["accumulated_all_reduces"] = int(state.update.all_reduce_runs.numpy())
        return weights  # type: ignore[no-any-return]

    def user(name: str) -> Callable[[], list[np.ndarray]]:
        # AdamW and the LossScaleOptimizer are built lazily inside strategy.run as well,
        # under the collective all-reduce (#20.4).
        return lambda: user_loop(strategy, prepare, x[:96], y[:96], optimizer_name=name)

    x, y = DATA
    ix, iy = images(64)
    loops: dict[str, Callable[[], list[np.ndarray]]] = {
        "tutorial": lambda: tutorial_loop(strategy, prepare, ix, iy),
        "multi_worker": lambda: multi_worker_loop(strategy, prepare, ix, iy),
        "guide": lambda: guide_loop(strategy, prepare, x, y),
        **{f"user_{name}": user(name) for name in ("sgd", "adam", "adamw", "lso")},
        "accumulated": accumulated,
    }
    unknown = sorted(set(names) - set(loops))
    if unknown:
        raise SystemExit(f"unknown loops {unknown}: choose from {', '.join(loops)}")
    for name in names:
        np.savez(out / f"{name}-{index}.npz", *loops[name]())
    (out / f"worker{index}.json").write_text(json.dumps(report))
    print(f"worker {index}: custom loops done", flush=True)


if __name__ == "__main__":
    main()
