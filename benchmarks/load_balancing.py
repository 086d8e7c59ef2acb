"""``global_load_balancing=True`` against each replica's own load balancing, measured in one
run: the epoch time of a small KerasHub Mixtral on 2 replicas, and how far each ends from one
device's weights.

One process, 2 logical CPUs (``MirroredStrategy``, ``ReductionToOneDevice``), a
``MixtralCausalLM`` of ``--layers`` decoder layers (``--experts`` experts, 2 per token, the
load-balancing loss at KerasHub's weight 0.02) trained with SGD by ``model.fit`` after
``tfscale.prepare``, with and without the option, from the same initial weights; the epochs
of the two alternate so that both see the same machine load, and the ratio of each pair is
reported (median and range). One device's ``model.fit`` of the same model and data gives the
reference weights. On logical CPUs the gather is a copy in the host's memory: the time ratio
is the cost of the extra work on CPU (one all-gather of ``tokens x experts`` router logits and
of the mask per layer and step, the loss over the gathered tokens, one all-reduce in the
backward pass), not a GPU interconnect's.

    python benchmarks/load_balancing.py [--layers 2] [--experts 8] [--epochs 5]
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

VOCAB, LENGTH, HIDDEN, EXAMPLES, BATCH = 512, 32, 64, 256, 16
WARM_UP = 2  # epochs before the timed ones: the first traces the step, the second settles


def _model(layers: int, experts: int) -> Any:
    import keras
    import keras_hub

    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=VOCAB, num_layers=layers, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=HIDDEN, intermediate_dim=2 * HIDDEN, num_experts=experts, top_k=2,
        router_aux_loss_coef=0.02,
    )  # fmt: skip
    model = keras_hub.models.MixtralCausalLM(backbone, preprocessor=None)
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
    )
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    import numpy as np
    import tensorflow as tf

    import tfscale
    from tfscale.testing import mirrored_on_cpus, paired_ratios, relative_difference

    strategy = mirrored_on_cpus(2)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, size=(EXAMPLES, LENGTH + 1)).astype("int32")
    lengths = rng.integers(LENGTH // 2, LENGTH + 2, size=EXAMPLES)
    mask = np.arange(LENGTH + 1)[None, :] < lengths[:, None]
    ids[~mask] = 0
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    y, weights = ids[:, 1:], mask[:, 1:].astype("float32")
    fit = {"batch_size": BATCH, "epochs": 1, "shuffle": False, "verbose": 0}

    reference = _model(args.layers, args.experts)
    initial = reference.get_weights()
    with tf.device("/device:CPU:0"):
        for _ in range(args.epochs + WARM_UP):
            reference.fit(x, y, sample_weight=weights, **fit)
    models = {}
    for balanced in (False, True):
        model = _model(args.layers, args.experts)
        model.set_weights(initial)
        tfscale.prepare(model, strategy, global_load_balancing=balanced)
        for _ in range(WARM_UP):
            model.fit(x, y, sample_weight=weights, **fit)
        models[balanced] = model
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.epochs):
        for balanced, model in models.items():
            start = time.perf_counter()
            model.fit(x, y, sample_weight=weights, **fit)
            seconds[balanced].append(time.perf_counter() - start)
    parameters = sum(int(np.prod(v.shape)) for v in models[False].trainable_variables)
    print(
        f"MixtralCausalLM: {args.layers} layers of {args.experts} experts (2 per token), "
        f"{parameters:,} parameters, {EXAMPLES} sequences of {LENGTH} tokens, batch {BATCH}"
    )
    print(f"{'':24}{'epoch s (median)':>18}{'vs one device':>16}")
    for balanced, name in ((False, "each replica's share"), (True, "global_load_balancing")):
        difference = relative_difference(models[balanced].get_weights(), reference.get_weights())
        median = statistics.median(seconds[balanced])
        print(f"{name:24}{median:>18.3f}{difference:>16.1e}")
    print(
        f"global / per-replica epoch time: {paired_ratios(seconds[True], seconds[False])}; "
        f"weights after {args.epochs + WARM_UP} epochs"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
