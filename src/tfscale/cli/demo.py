"""``tfscale demo``: train a small CNN on the embedded digits over every device, with proof.

Uses every GPU, or splits the CPU into 2 logical devices where there is none (before
TensorFlow starts), prints a short doctor summary, the strategy chosen and why, a progress
bar, the final test accuracy (it must reach 0.9, else the exit status is 1) and examples/s.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

__all__ = ["register", "run"]

_TARGET_ACCURACY = 0.9


def register(subparsers: Any) -> None:
    """Adds the ``demo`` subcommand."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "demo", help="train a small CNN on handwritten digits with tfscale.fit over every device"
    )
    parser.add_argument("--epochs", type=int, default=8, help="epochs to train (default 8)")
    parser.add_argument(
        "--batch-size", type=int, default=64, help="global batch per step (default 64)"
    )
    parser.add_argument(
        "--model", choices=("cnn", "mlp"), default="cnn", help="reference model (default cnn)"
    )
    parser.set_defaults(handler=run)


def _configure_devices() -> None:
    """Two logical CPUs when there is no GPU, so that the demo shows a real all-reduce."""
    import tensorflow as tf

    from tfscale.devices.discovery import use_virtual_devices

    if os.environ.get("TFSCALE_VIRTUAL_DEVICES") or tf.config.list_physical_devices("GPU"):
        return
    use_virtual_devices(2)
    print("No GPU found: the CPU is split into 2 logical devices to train on 2 replicas.")


def _doctor_summary() -> None:
    try:
        from tfscale.doctor.checks import run_checks
        from tfscale.doctor.snapshot import take_snapshot
    except ImportError:
        return
    results = run_checks(take_snapshot())
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "warn", "fail")}
    print(f"doctor: {counts['ok']} ok, {counts['warn']} warning(s), {counts['fail']} failed")
    for result in results:
        if result.status != "ok":
            print(f"  [{result.status}] {result.name}: {result.message}")


def run(args: argparse.Namespace) -> int:
    """Runs the demo; returns 0 when the test accuracy reaches 0.9."""
    _configure_devices()
    _doctor_summary()
    from tfscale.strategy import choose_strategy
    from tfscale.training.fit import fit
    from tfscale.workloads import build_model, digits

    choice = choose_strategy()
    print(f"strategy: {choice.explain()}")
    data = digits()
    with choice.strategy.scope():
        model = build_model(args.model, learning_rate=3e-3)
    batch = args.batch_size - args.batch_size % choice.num_replicas or choice.num_replicas
    from tfscale.profiling.callback import EpochClock

    clock = EpochClock()
    history = fit(
        model,
        data.x_train,
        data.y_train,
        batch_size=batch,
        epochs=args.epochs,
        validation_data=(data.x_test, data.y_test),
        callbacks=[clock],
        strategy=choice.strategy,
    )
    accuracy = history.history["val_accuracy"][-1]
    steady = clock.times[1:] or clock.times
    rate = len(data.x_train) * len(steady) / sum(steady)
    print(
        f"test accuracy {accuracy:.3f} on {len(data.x_test)} held-out digits "
        f"(target >= {_TARGET_ACCURACY}); {rate:,.0f} examples/s over "
        f"{choice.num_replicas} replica(s), global batch {batch}"
    )
    if accuracy < _TARGET_ACCURACY:
        print(f"FAILED: accuracy {accuracy:.3f} is below {_TARGET_ACCURACY}")
        return 1
    return 0
