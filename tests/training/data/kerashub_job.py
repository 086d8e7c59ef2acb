"""A ``tfscale launch -n 2`` job: KerasHub task models (``parity/kerashub_cases.py``) trained
under MultiWorkerMirroredStrategy by ``tfscale.fit`` or ``tfscale.prepare`` + ``model.fit``.

Usage: ``tfscale launch -n 2 kerashub_job.py OUT_DIR CASE:MODE,...`` (MODE ``fit`` or
``prepare``). Each worker writes ``OUT_DIR/<case>-<mode>-<worker>.npz`` (its weights, in
``model.weights`` order) and ``OUT_DIR/worker<i>.json`` (per run: History, update count, the
tokens ``generate`` gave where the case generates, or the error that stopped it). The
references are trained by the test process: the launcher stops a worker whose ``model.fit``
runs under no strategy.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

# The strategy first: collectives are configured before any other TensorFlow op.
strategy = tf.distribute.MultiWorkerMirroredStrategy()

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/

from training.parity.kerashub_cases import CASES, MOE_CASES, generated  # noqa: E402
from training.parity.registry import run_tfscale  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    cases = {case.name: case for case in [*CASES, *MOE_CASES]}
    report: dict[str, Any] = {}
    for run in sys.argv[2].split(","):
        name, mode = run.split(":")
        case = cases[name]
        try:
            got = run_tfscale(case, strategy, None, prepared=mode == "prepare")
        except Exception as error:  # reported by the test, which names the run
            report[run] = {"error": f"{type(error).__name__}: {error}"[:1000]}
            continue
        report[run] = {
            "iterations": got.iterations,
            "history": {k: [float(v) for v in vs] for k, vs in got.history.history.items()},
            "epoch": got.history.epoch,
        }
        if "generate" in name:
            report[run]["generated"] = generated(got.model).tolist()
        np.savez(out / f"{name}-{mode}-{index}.npz", *got.model.get_weights())
    (out / f"worker{index}.json").write_text(json.dumps(report))
    print(f"worker {index}: kerashub done", flush=True)


main()
