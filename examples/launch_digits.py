"""Train a small digits classifier on every worker that ``tfscale launch`` starts.

    tfscale launch -n 2 examples/launch_digits.py --epochs 5 --checkpoint-dir /tmp/digits
    tfscale launch -n 2 --max-restarts 2 examples/launch_digits.py --checkpoint-dir /tmp/digits
    tfscale launch --ps 1 -n 2 examples/launch_digits.py --epochs 5

The same file runs alone (``python examples/launch_digits.py``) on this machine's devices.
"""

from __future__ import annotations

import argparse

import numpy as np

import tfscale
from tfscale.workloads import build_model, digits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args()

    choice = tfscale.choose_strategy()  # first: it reads TF_CONFIG before TF starts
    print(choice.explain(), flush=True)
    data = digits()
    with choice.strategy.scope():
        model = build_model("mlp")
    tfscale.fit(
        model,
        data.x_train,
        data.y_train,
        epochs=args.epochs,
        batch_size=args.batch_size,
        checkpoint_dir=args.checkpoint_dir,
        verbose=2,
    )
    if choice.cluster is None or choice.cluster.is_chief:
        # A plain forward pass reads this worker's copy of the weights. model.evaluate()
        # would run collectives, which wait forever for workers that have already exited.
        logits = np.asarray(model(data.x_test, training=False))
        accuracy = float(np.mean(np.argmax(logits, axis=1) == data.y_test))
        print(f"test accuracy: {accuracy:.3f}", flush=True)


if __name__ == "__main__":
    main()
