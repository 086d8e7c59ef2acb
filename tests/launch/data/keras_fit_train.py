"""Seed 001's script under `tfscale launch -n 2`: Keras's own model.fit under
MultiWorkerMirroredStrategy, with one added line (tfscale.prepare) that makes it train.

Usage: keras_fit_train.py --out WEIGHTS.npz [--epochs E]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import tensorflow as tf

import tfscale

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mwms_train import BATCH, build_model, make_data


def dataset() -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(make_data()).batch(BATCH)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_model()
    model = tfscale.prepare(model)  # the one added line
    model.fit(dataset(), epochs=args.epochs, verbose=0)
    print(f"model.fit over {strategy.num_replicas_in_sync} replicas: done", flush=True)
    if strategy.cluster_resolver.task_id == 0:
        np.savez(args.out, *model.get_weights())


if __name__ == "__main__":
    main()
