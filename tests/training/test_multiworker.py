"""Two worker processes on 127.0.0.1 (MultiWorkerMirroredStrategy, one CPU each) train to the
weights of MirroredStrategy over 2 logical CPUs. One pair of child processes checks every
multi-worker claim: equivalence, one gradient collective per update with k=4, uneven
per-worker data finishing without a hang, and Keras's own fit failing there."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tfscale
from tfscale.testing import relative_difference

from .helpers import DATA, WORKER_PRELUDE, batches, run_workers, strategy_for, tiny_model

pytestmark = pytest.mark.tf

TESTS = Path(__file__).resolve().parents[1]

_WORKER = (
    WORKER_PRELUDE
    + """
from tfscale.training import Trainer
from tfscale.training.prepare import prepared
from training.test_multiworker import low_precision_model, summed_loss

# TensorFlow alone cannot create a bfloat16 (or int8) variable on 2 workers: its broadcast of
# the initial value takes no such dtype. Tried before tfscale touches the strategy.
try:
    with strategy.scope():
        tf.Variable(tf.zeros((2,), tf.bfloat16))
    report["bfloat16_alone"] = "created"
except Exception as error:
    report["bfloat16_alone"] = f"{type(error).__name__}: {str(error)[:200]}"

for name in ("sgd", "adam"):
    model = tiny_model(strategy, name)
    # verbose=1: only the chief may print a progress bar.
    tfscale.fit(model, batches(x, y, 32), steps_per_epoch=5, strategy=strategy, verbose=1)
    weights.update({f"{name}_{i}": w for i, w in enumerate(model.get_weights())})

# Bucketed and bf16-compressed all-reduces across the workers (collectives over gRPC).
variants = {
    "bucketed": {"bucket_bytes": 64},
    "bf16": {"gradient_compression": "bf16"},
    # Several steps per call: the step's collectives inside the call's while loop.
    "spe3": {"steps_per_execution": 3},
}
for name, options in variants.items():
    model = tiny_model(strategy, "adam")
    data = batches(x, y, 32)
    tfscale.fit(model, data, steps_per_epoch=5, strategy=strategy, verbose=0, **options)
    weights.update({f"{name}_{i}": w for i, w in enumerate(model.get_weights())})

# A loss summed over the batch: each worker's sum made its share of the batch's (a scalar
# collective of the example counts across the workers).
model = tiny_model(strategy, "sgd", lr=0.002)
with strategy.scope():
    model.compile(model.optimizer, loss=summed_loss())
tfscale.fit(model, batches(x, y, 32), steps_per_epoch=5, strategy=strategy, verbose=0)
weights.update({f"summed_{i}": w for i, w in enumerate(model.get_weights())})

# Seed 001's pattern: Keras's own model.fit under MultiWorkerMirroredStrategy, after one
# added line (tfscale.prepare).
model = tiny_model(strategy, "adam")
tfscale.prepare(model, strategy)
model.fit(batches(x, y, 32), steps_per_epoch=5, verbose=0)
weights.update({f"prepared_{i}": w for i, w in enumerate(model.get_weights())})

# k = 4: count the gradient collectives in the traced train function, and their runs.
model = tiny_model(strategy)
trainer = Trainer(model, strategy, accumulation_steps=4, sample_batch=(x[:4], y[:4]))
iterator = iter(strategy.experimental_distribute_dataset(batches(x, y, 8)))
trainer.train(iterator, 3)
function = trainer._function._multi.get_concrete_function(iterator, tf.constant(1))
graph = function.graph.as_graph_def()
nodes = list(graph.node)
for library_function in graph.library.function:
    nodes.extend(library_function.node_def)
collectives = [n for n in nodes if n.op.startswith("Collective")]
report["gradient_collectives"] = sum("tfscale_gradient_all_reduce" in n.name for n in collectives)
report["collectives"] = len(collectives)
report["all_reduce_runs"] = int(prepared(model).update.all_reduce_runs.numpy())
report["updates"] = int(model.optimizer.iterations.numpy())

# Uneven data: worker 0 has 5 batches, worker 1 has 3. It must finish, workers agreeing.
def uneven(context):
    n = 5 if context.input_pipeline_id == 0 else 3
    return batches(x[: n * 16], y[: n * 16], 16)

model = tiny_model(strategy)
ckpt = os.path.join(os.path.dirname(out), "ckpt")
tfscale.fit(model, uneven, batch_size=32, strategy=strategy, verbose=0, checkpoint_dir=ckpt)
report["uneven_updates"] = int(model.optimizer.iterations.numpy())
weights.update({f"uneven_{i}": w for i, w in enumerate(model.get_weights())})
# A restarted worker resumes from the chief's checkpoint: epoch 2 only.
model = tiny_model(strategy)
history = tfscale.fit(
    model, uneven, batch_size=32, epochs=2, strategy=strategy, verbose=0, checkpoint_dir=ckpt
)
report["resumed_epochs"] = history.epoch
report["resumed_updates"] = int(model.optimizer.iterations.numpy())

# Keras's own fit on the same strategy and dataset.
try:
    with strategy.scope():
        keras_model = tiny_model(strategy)
    keras_model.fit(batches(x, y, 32), steps_per_epoch=2, verbose=0)
    report["keras_fit"] = "ok"
except Exception as error:
    report["keras_fit"] = f"{type(error).__name__}: {str(error)[:300]}"
# A bfloat16 model and an int8-quantized one with LoRA (QLoRA), built outside the scope:
# tfscale.fit moves them into the strategy, their initial values carried exactly; and the
# bfloat16 model with its momentum sharded (gathered across the workers).
for kind in ("bfloat16", "qlora", "bfloat16_sharded"):
    model = low_precision_model(kind)
    tfscale.fit(model, x[:96], y[:96], batch_size=32, epochs=2, shuffle=False, strategy=strategy,
                verbose=0, shard_optimizer_state=kind.endswith("sharded"))
    weights.update({f"{kind}_{i}": w.astype("float32") for i, w in enumerate(model.get_weights())})
np.savez(out + ".npz", **weights)
with open(out + ".json", "w") as handle:
    json.dump(report, handle)
"""
)


def summed_loss() -> object:
    """The tiny model's loss summed over the batch (``reduction="sum"``)."""
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")


def low_precision_model(kind: str) -> object:
    """A small classifier, seeded: in ``"bfloat16"`` (its variables too; with momentum for
    ``"bfloat16_sharded"``), or quantized to int8 with LoRA on both layers (``"qlora"``,
    KerasHub's QLoRA recipe's calls)."""
    import keras

    keras.utils.set_random_seed(7)
    dtype = "bfloat16" if kind.startswith("bfloat16") else None
    model = keras.Sequential(
        [
            keras.Input((DATA[0].shape[1],)),
            keras.layers.Dense(16, activation="relu", dtype=dtype),
            keras.layers.Dense(int(DATA[1].max()) + 1, dtype=dtype),
        ]
    )
    if kind == "qlora":
        model.quantize("int8")
        for layer in model.layers:
            layer.enable_lora(2)
    # Momentum's slot is the state sharded; Adam does not train in bfloat16 variables (its
    # bias correction, 1 - 0.999 ** t, rounds to 0 there: the weights never move).
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9 if kind.endswith("sharded") else 0.0)
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _run_workers(tmp_path: Path, timeout: float = 240.0) -> list[dict[str, object]]:
    outputs = run_workers(_WORKER, [str(tmp_path / "w"), str(TESTS)], timeout=timeout)
    reports = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(2)]
    for report, out in zip(reports, outputs, strict=True):
        report["stdout"] = out
    return reports


@pytest.mark.multiprocess
@pytest.mark.slow
# make test trains tfscale.fit across 2 worker processes in the parity suite's 2-worker group
# (sharded arrays, validation, a dataset of unknown length, gathered sparse gradients) and
# Keras's model.fit, prepared, across 2 launched workers; this pair adds the other claims.
@pytest.mark.full(
    "tests/training/test_parity_examples.py::"
    "test_cases_across_two_worker_processes_match_one_device[paths_across_workers]",
    "tests/launch/test_jobs.py::test_keras_model_fit_under_multi_worker_trains_with_one_added_line",
)
def test_two_workers_equal_mirrored_over_two_cpus(tmp_path: Path) -> None:
    reports = _run_workers(tmp_path)
    weights = [np.load(tmp_path / f"w{i}.npz") for i in range(2)]
    x, y = DATA
    strategy = strategy_for(2)
    for name in ("sgd", "adam"):
        model = tiny_model(strategy, name)
        tfscale.fit(model, batches(x, y, 32), steps_per_epoch=5, strategy=strategy, verbose=0)
        mirrored = model.get_weights()
        for worker in weights:
            got = [worker[f"{name}_{i}"] for i in range(len(mirrored))]
            assert relative_difference(got, mirrored) <= 1e-5, name
            if name == "adam":
                by_model_fit = [worker[f"prepared_{i}"] for i in range(len(mirrored))]
                assert relative_difference(by_model_fit, mirrored) <= 1e-5, "model.fit"
                bucketed = [worker[f"bucketed_{i}"] for i in range(len(mirrored))]
                assert relative_difference(bucketed, mirrored) <= 1e-5, "bucketed"
                several = [worker[f"spe3_{i}"] for i in range(len(mirrored))]
                assert relative_difference(several, mirrored) <= 1e-5, "steps_per_execution"
                compressed = [worker[f"bf16_{i}"] for i in range(len(mirrored))]
                assert 0.0 < relative_difference(compressed, mirrored) <= 2e-2, "bf16"
    # The summed loss across the workers: the 2 logical CPUs' weights (which are one
    # device's, tests/training/test_equivalence.py).
    model = tiny_model(strategy, "sgd", lr=0.002)
    with strategy.scope():
        model.compile(model.optimizer, loss=summed_loss())
    tfscale.fit(model, batches(x, y, 32), steps_per_epoch=5, strategy=strategy, verbose=0)
    for worker in weights:
        got = [worker[f"summed_{i}"] for i in range(len(model.get_weights()))]
        assert relative_difference(got, model.get_weights()) <= 1e-5, "summed loss"
    # bfloat16 and int8 variables on 2 workers (TensorFlow alone cannot create them, nor
    # gather bfloat16 shards): the 2 logical CPUs' weights.
    for kind in ("bfloat16", "qlora", "bfloat16_sharded"):
        model = low_precision_model(kind)
        tfscale.fit(model, x[:96], y[:96], batch_size=32, epochs=2, shuffle=False,
                    strategy=strategy, verbose=0,
                    shard_optimizer_state=kind.endswith("sharded"))  # fmt: skip
        mirrored = [w.astype("float32") for w in model.get_weights()]
        for worker in weights:
            got = [worker[f"{kind}_{i}"] for i in range(len(mirrored))]
            assert relative_difference(got, mirrored) <= 1e-5, kind
        # ... which are one device's for the int8 weights' LoRA (float32); in bfloat16 each
        # replica's share of the batch rounds on its own, as under Keras's own fit on the same
        # strategy, whose weights they are (both about 3 bfloat16 steps from one device's).
        if kind == "qlora":
            one = low_precision_model(kind)
            one.fit(x[:96], y[:96], batch_size=32, epochs=2, shuffle=False, verbose=0)
            expected = [w.astype("float32") for w in one.get_weights()]
        else:
            with strategy.scope():
                keras_fit = low_precision_model(kind)
            keras_fit.fit(x[:96], y[:96], batch_size=32, epochs=2, shuffle=False, verbose=0)
            expected = [w.astype("float32") for w in keras_fit.get_weights()]
        assert relative_difference(mirrored, expected) <= 1e-5, kind
        initial = [w.astype("float32") for w in low_precision_model(kind).get_weights()]
        assert relative_difference(mirrored, initial) > 1e-2, f"{kind}: nothing trained"
    # The progress bar: printed by the chief (worker 0) only.
    assert "5/5" in str(reports[0]["stdout"]) and "5/5" not in str(reports[1]["stdout"])
    for report in reports:
        assert report["replicas"] == 2
        assert "bfloat16 is not in the list of allowed values" in str(report["bfloat16_alone"])
        # k = 4, 3 updates: one packed gradient collective in the graph, run 3 times.
        assert report["gradient_collectives"] == 1
        assert (report["all_reduce_runs"], report["updates"]) == (3, 3)
        # Uneven data (5 and 3 batches) finished without a hang; the short worker sent
        # empty batches for the last 2 updates, and both workers agree ...
        assert report["uneven_updates"] == 5  # the longer worker sets the pace
        # ... and Keras's own fit fails on this strategy with a dataset (TF 2.21, Keras 3.15).
        assert "PerReplica" in str(report["keras_fit"]), report["keras_fit"]
        # Checkpoints: the chief wrote them, the other worker's scratch folder is gone, and
        # a restarted run resumed after epoch 1.
        assert (report["resumed_epochs"], report["resumed_updates"]) == ([1], 10)
    assert (tmp_path / "ckpt" / "checkpoint").exists()
    assert not [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".worker")]
    uneven = [[w[k] for k in sorted(w.files) if k.startswith("uneven_")] for w in weights]
    assert relative_difference(uneven[1], uneven[0]) == 0.0
