"""The custom loops of ``loops.py`` under ``tfscale launch -n 2`` (MultiWorkerMirroredStrategy
over 2 worker processes, collective all-reduce over gRPC), each with its one
``tfscale.prepare_loop`` line, give one device's weights: the tutorial's loop (a model
without ``Input`` and Adam, both built by the first replica step, which fails unprepared
under the collective all-reduce), the Keras guide's and the users' loop (SGD, and Adam,
AdamW and a LossScaleOptimizer built lazily inside ``strategy.run``), and accumulation
over 2 batches (one all-reduce per update), and the multi-worker custom-loop tutorial's
(``distribute_datasets_from_function`` sharded by the input context). And the tutorial's loop under
``tf.distribute.MirroredStrategy()``'s default (collective) all-reduce over 2 logical CPUs,
in a child process: unchanged it fails on its first step, with the line it trains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tfscale.testing import relative_difference

from .helpers import DATA, launch, strategy_for
from .loops import (
    convention_loop,
    guide_loop,
    images,
    multi_worker_loop,
    tutorial_loop,
    user_loop,
)

pytestmark = [pytest.mark.tf, pytest.mark.multiprocess, pytest.mark.slow]

_JOB = Path(__file__).parent / "data" / "custom_loops_job.py"


def _weights(path: Path) -> list[np.ndarray]:
    with np.load(path) as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]


def _one_device_batches_of_32(one: Any, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    weights: list[np.ndarray] = convention_loop(one, None, x, y, "reduce_mean", batch=32)[0]
    return weights


# `make test` launches the TensorFlow tutorial's loop (a model without ``Input`` and Adam
# built by the first replica step), the multi-worker tutorial's (a dataset from a function,
# sharded by the input context), the users' loop with Adam built lazily inside
# ``strategy.run``, and accumulation; the Keras guide's loop and the users' loop with SGD,
# AdamW and a LossScaleOptimizer (the same prepared update, other optimizers' own steps) in
# `make test-full`, in a second job (#41).
_IN_MAKE_TEST = "tutorial,multi_worker,user_adam,accumulated"
_OTHERS = "guide,user_sgd,user_adamw,user_lso"


@pytest.mark.parametrize(
    "loops",
    [
        pytest.param(_IN_MAKE_TEST, id="tutorials_adam_accumulated"),
        pytest.param(
            _OTHERS,
            id="guide_and_other_optimizers",
            marks=pytest.mark.full(
                "tests/training/test_custom_loops_launch.py::"
                "test_custom_loops_under_tfscale_launch_give_one_device_weights"
                "[tutorials_adam_accumulated]"
            ),
        ),
    ],
)
def test_custom_loops_under_tfscale_launch_give_one_device_weights(
    tmp_path: Path, loops: str
) -> None:
    """Each launched loop's weights on both workers are one device's."""
    done = launch(_JOB, [str(tmp_path), loops], timeout=240)
    assert "[worker 1] worker 1: custom loops done" in done.stdout
    x, y = DATA
    ix, iy = images(64)
    one = strategy_for(0)
    references = {
        "tutorial": lambda: tutorial_loop(one, None, ix, iy),
        # its last array is the optimizer's iterations: 8 on every worker
        "multi_worker": lambda: multi_worker_loop(one, None, ix, iy),
        "guide": lambda: guide_loop(one, None, x, y),
        **{
            f"user_{name}": lambda name=name: user_loop(
                one, None, x[:96], y[:96], optimizer_name=name
            )
            for name in ("sgd", "adam", "adamw", "lso")
        },
        # accumulation_steps=2 over batches of 16 == one device on batches of 32
        "accumulated": lambda: _one_device_batches_of_32(one, x[:64], y[:64]),
    }
    for name in loops.split(","):
        reference = references[name]()
        for worker in range(2):
            got = _weights(tmp_path / f"{name}-{worker}.npz")
            worst = max(relative_difference([g], [w]) for g, w in zip(got, reference, strict=True))
            assert worst <= 1e-5, (name, worker, worst)
    for worker in range(2):
        report = json.loads((tmp_path / f"worker{worker}.json").read_text())
        assert report["replicas"] == 2
        if "accumulated" in loops:
            # 4 batches x 2 epochs, 2 per update: 4 updates, each one all-reduce.
            assert (report["accumulated_updates"], report["accumulated_all_reduces"]) == (4, 4)


_MIRRORED_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import tfscale  # first: it splits the CPU into TFSCALE_VIRTUAL_DEVICES before TF starts
import tensorflow as tf
strategy = tf.distribute.MirroredStrategy()  # the default: collective all-reduce on CPUs
from training.loops import images, tutorial_loop
prepare = (lambda m, o: tfscale.prepare_loop(m, o)) if sys.argv[2] == "prepared" else None
x, y = images(64)
try:
    weights = tutorial_loop(strategy, prepare, x, y)
except Exception as error:
    text = str(error)
    start = max(0, text.find("You must feed"))
    print("FAILED", type(error).__name__, text[start : start + 200].replace(chr(10), " "))
else:
    np.savez(sys.argv[3], *weights)
    print("TRAINED", strategy.num_replicas_in_sync)
"""


# make test trains the same tutorial loop, prepared, under the collective all-reduce across
# 2 launched workers (the test above); this child pair adds Mirrored's default on logical CPUs
# and the unchanged loop's failure there (TensorFlow's behaviour, which the docs quote).
@pytest.mark.full(
    "tests/training/test_custom_loops_launch.py::"
    "test_custom_loops_under_tfscale_launch_give_one_device_weights[tutorials_adam_accumulated]",
)
def test_the_tutorial_under_mirroreds_default_all_reduce_fails_unchanged_and_trains_prepared(
    tmp_path: Path,
) -> None:
    from tfscale.testing import run_python

    tests = str(Path(__file__).resolve().parents[1])
    outcomes = {}
    for mode in ("unchanged", "prepared"):
        done = run_python(
            _MIRRORED_CHILD,
            virtual_devices=2,
            args=[tests, mode, str(tmp_path / f"{mode}.npz")],
            timeout=180,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        outcomes[mode] = done.stdout
    # The tutorial's Sequential without Input and its Adam are built by the first replica
    # step, which fails under the collective all-reduce ...
    assert "FAILED InvalidArgumentError" in outcomes["unchanged"], outcomes["unchanged"]
    assert "You must feed a value for placeholder tensor" in outcomes["unchanged"]
    # ... and with the one line trains to one device's weights.
    assert "TRAINED 2" in outcomes["prepared"], outcomes["prepared"]
    x, y = images(64)
    reference = tutorial_loop(strategy_for(0), None, x, y)
    got = _weights(tmp_path / "prepared.npz")
    worst = max(relative_difference([g], [w]) for g, w in zip(got, reference, strict=True))
    assert worst <= 1e-5, worst
