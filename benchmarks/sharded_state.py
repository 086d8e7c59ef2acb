"""Sharded optimizer state (ZeRO stage 1) against the unsharded update, measured in one run:
Adam's slot bytes on each device (read from the variables' devices) and the time of an epoch.

One process, 2 logical CPUs (``MirroredStrategy``, ``ReductionToOneDevice``), an MLP of
``--width`` wide dense layers trained with Adam by ``model.fit`` after ``tfscale.prepare``,
sharded and unsharded from the same initial weights; the epochs of the two alternate so that
both see the same machine load, and the ratio of each pair is reported (median and range).
On logical CPUs the devices share the host's memory and cores: the bytes are what a device
would hold, the time ratio is the cost of the extra work (the shard cut, one all-gather per
dtype, the weights written back) on CPU, not a GPU's.

    python benchmarks/sharded_state.py [--width 1024] [--batch 64] [--epochs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
os.environ.setdefault("TFSCALE_VIRTUAL_DEVICES", "2")

FEATURES, CLASSES, EXAMPLES = 256, 10, 2048


def _model(strategy: Any, width: int) -> Any:
    import keras

    from tfscale.workloads import build_model

    with strategy.scope():
        return build_model(
            "mlp",
            input_shape=(FEATURES,),
            classes=CLASSES,
            width=width // 4,  # its hidden layers are 4 * width wide
            optimizer=keras.optimizers.Adam(1e-3),
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="global")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    import numpy as np

    import tfscale
    from tfscale.testing import mirrored_on_cpus, paired_ratios, relative_difference
    from tfscale.training.sharding import slot_bytes_per_device

    strategy = mirrored_on_cpus(2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((EXAMPLES, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, EXAMPLES).astype(np.int32)
    models = {}
    for shard in (False, True):
        model = _model(strategy, args.width)
        tfscale.prepare(model, strategy, shard_optimizer_state=shard)
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0)  # warm-up
        models[shard] = model
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.epochs):
        for shard, model in models.items():
            start = time.perf_counter()
            model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0)
            seconds[shard].append(time.perf_counter() - start)
    parameters = sum(int(np.prod(v.shape)) for v in models[False].trainable_variables)
    difference = relative_difference(models[True].get_weights(), models[False].get_weights())
    print(f"MLP {FEATURES}-{args.width}-{args.width}-{CLASSES}: {parameters:,} parameters, Adam")
    print(f"{'':12}{'slot MiB per device':>22}{'epoch s (median)':>20}")
    for shard, name in ((False, "unsharded"), (True, "sharded")):
        per_device = slot_bytes_per_device(models[shard].optimizer, strategy)
        mib = ", ".join(f"{b / 2**20:.2f}" for _, b in sorted(per_device.items()))
        print(f"{name:12}{mib:>22}{statistics.median(seconds[shard]):>20.3f}")
    print(
        f"sharded / unsharded epoch time: {paired_ratios(seconds[True], seconds[False])}; "
        f"weights' relative difference after {args.epochs + 1} epochs: {difference:.1e}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
