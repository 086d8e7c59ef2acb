"""Prints the custom-loop figures the README and docs/training.md quote: each loop of
``loops.py`` and each loss convention over 2 logical CPUs, with and without the one
``tfscale.prepare_loop`` line, against the same loop on one device (the largest relative
difference of any one variable).

Run from the repository root (about a minute on 2 CPU cores)::

    PYTHONPATH=src python -m tests.training.loops_report
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfscale

tfscale.use_virtual_devices(4)  # as tests/conftest.py: before TensorFlow starts

import numpy as np  # noqa: E402

from tfscale.testing import relative_difference  # noqa: E402

from .helpers import DATA, strategy_for  # noqa: E402
from .loops import convention_loop, guide_loop, images, tutorial_loop, user_loop  # noqa: E402


def _worst(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    return max(relative_difference([g], [w]) for g, w in zip(got, want, strict=True))


def _compare(run: Callable[[Any, Any], list[np.ndarray]]) -> tuple[str, str]:
    one = run(strategy_for(0), None)
    out = []
    for prepare in (None, lambda m, o: tfscale.prepare_loop(m, o)):
        try:
            out.append(f"{_worst(run(strategy_for(2), prepare), one):.1e}")
        except tfscale.TrainingError:
            out.append("refused (TrainingError)")
    return out[0], out[1]


def main() -> None:
    """Trains every loop and convention and prints a Markdown table."""
    x, y = DATA
    ix, iy = images(64)
    x64, y64 = x[:64], y[:64]
    rows: list[tuple[str, Callable[[Any, Any], list[np.ndarray]]]] = [
        ("TF tutorial (Adam, compute_average_loss)", lambda s, p: tutorial_loop(s, p, ix, iy)),
        ("Keras guide (Adam, Loss object)", lambda s, p: guide_loop(s, p, x, y)),
        (
            "users' loop (SGD, per-example vector)",
            lambda s, p: user_loop(s, p, x[:96], y[:96], optimizer_name="sgd"),
        ),
        (
            "users' loop (Adam, per-example vector)",
            lambda s, p: user_loop(s, p, x[:96], y[:96], optimizer_name="adam"),
        ),
    ]
    rates = {"per_example_vector": 0.01}
    for convention in (
        "keras_object",
        "reduce_mean",
        "per_example_vector",
        "compute_average_loss",
        "compute_average_loss_global",
        "divided_by_global_batch",
        "reduce_mean_plus_model_losses",
    ):
        lr = rates.get(convention, 0.2)

        def run(s: Any, p: Any, c: str = convention, lr: float = lr) -> list[np.ndarray]:
            return convention_loop(s, p, x64, y64, c, lr=lr)[0]

        rows.append((f"SGD loss: {convention}", run))
    print("| loop | 2 replicas, unchanged | 2 replicas + prepare_loop |")
    print("| --- | --- | --- |")
    for name, run_loop in rows:
        native, prepared = _compare(run_loop)
        print(f"| {name} | {native} | {prepared} |", flush=True)


if __name__ == "__main__":
    main()
