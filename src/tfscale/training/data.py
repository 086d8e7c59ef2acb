"""Inputs ``tfscale.fit`` hands to Keras beyond what ``model.fit`` reads itself.

- ``dataset_fn(input_context)`` becomes ``strategy.distribute_datasets_from_function``.
- A ``tf.data.Dataset`` under several workers is sharded by DATA unless the user chose a
  policy: AUTO tries FILE sharding first, and with fewer files than workers a worker gets no
  data and MultiWorkerMirroredStrategy waits for it forever (see DESIGN.md). DATA is always
  correct (each worker reads everything and keeps its share); set FILE yourself when there
  are many files.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["EpochOrder", "distributed_input", "is_dataset_fn", "num_workers"]


def num_workers(strategy: tf.distribute.Strategy) -> int:
    """Worker processes (chief included) the strategy's cluster spans; 1 without a cluster."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    spec = resolver.cluster_spec().as_dict()
    return max(1, len(spec.get("worker", [])) + len(spec.get("chief", [])))


def _sharded(dataset: tf.data.Dataset, strategy: tf.distribute.Strategy) -> tf.data.Dataset:
    policy = dataset.options().experimental_distribute.auto_shard_policy
    if num_workers(strategy) == 1 or policy != tf.data.experimental.AutoShardPolicy.AUTO:
        return dataset
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)


def is_dataset_fn(data: Any) -> bool:
    """Whether ``data`` is a ``dataset_fn(input_context)`` rather than data."""
    return callable(data) and not hasattr(data, "__getitem__") and not hasattr(data, "__next__")


def distributed_input(data: Any, strategy: tf.distribute.Strategy) -> Any:
    """``data`` as ``model.fit`` should receive it under ``strategy`` (see the module doc).

    Anything else (arrays, generators, PyDataset, distributed datasets) is returned as is.
    """
    if isinstance(data, tf.data.Dataset):
        return _sharded(data, strategy)
    if not is_dataset_fn(data):
        return data
    if num_workers(strategy) == 1:
        return strategy.distribute_datasets_from_function(data)

    def unknown_length(context: tf.distribute.InputContext) -> tf.data.Dataset:
        # Workers' datasets may hold different numbers of batches, and Keras would run as
        # many steps as the local one has: a worker that stops early leaves the others
        # waiting in a collective. With the length hidden, every epoch ends where all
        # workers agree the data has ended (get_next_as_optional).
        return data(context).filter(lambda *_: True)

    return strategy.distribute_datasets_from_function(unknown_length)


class EpochOrder:
    """Arrays as a dataset shuffled with a permutation fixed by (seed, epoch).

    Keras shuffles arrays with an unseeded ``tf.random.shuffle``, so a run resumed from a
    checkpoint sees other batches in its first epoch than the run it continues. With a
    checkpoint folder, ``fit`` gives Keras this dataset instead (the same batches as Keras's
    array adapter would make, last partial batch included); the checkpoint callback sets
    :attr:`epoch` before each epoch's iterator is created.

    Args:
        arrays: ``(x, y, sample_weight)``, any of them nested structures of arrays.
        batch_size: Global batch size (None: Keras's default, 32).
        seed: Seed of the permutations.
    """

    def __init__(self, arrays: tuple[Any, Any, Any], batch_size: int | None, seed: int = 0):
        import numpy as np

        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="data_epoch")
        x, y, sample_weight = arrays
        parts = tuple(p for p in (x, y, sample_weight) if p is not None)
        tensors = tf.nest.map_structure(lambda a: tf.convert_to_tensor(np.asarray(a)), parts)
        count = int(tf.shape(tf.nest.flatten(tensors)[0])[0])
        batch = 32 if batch_size is None else int(batch_size)
        epoch = self.epoch

        def permutation(_: tf.Tensor) -> tf.Tensor:
            seeds = tf.stack([tf.constant(seed, tf.int64), epoch.read_value()])
            return tf.random.experimental.stateless_shuffle(tf.range(count, dtype=tf.int64), seeds)

        def gather(indices: tf.Tensor, data: Any) -> Any:
            return tf.nest.map_structure(lambda t: tf.gather(t, indices), data)

        order = tf.data.Dataset.range(1).map(permutation)
        order = order.flat_map(lambda idx: tf.data.Dataset.from_tensor_slices(idx).batch(batch))
        dataset = tf.data.Dataset.zip((order, tf.data.Dataset.from_tensors(tensors).repeat()))
        dataset = dataset.map(gather, num_parallel_calls=tf.data.AUTOTUNE)
        # flat_map hides the length; Keras needs it to count each epoch's steps.
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(-(-count // batch)))
        options = tf.data.Options()
        # The permutation reads a variable (the epoch): state outside the dataset's graph.
        options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA
        )
        self.dataset = dataset.with_options(options).prefetch(tf.data.AUTOTUNE)
