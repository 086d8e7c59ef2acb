"""Inputs ``tfscale.fit`` hands to Keras beyond what ``model.fit`` reads itself.

- One iterator per fit where the data allows (:func:`plan_inputs`, :class:`EpochOrder`).
- ``dataset_fn(input_context)`` becomes ``strategy.distribute_datasets_from_function``.
- A ``tf.data.Dataset`` under several workers is sharded by DATA unless the user chose a
  policy: AUTO tries FILE sharding first, and with fewer files than workers a worker gets no
  data and MultiWorkerMirroredStrategy waits for it forever (see DESIGN.md). DATA is always
  correct (each worker reads everything and keeps its share); set FILE yourself when there
  are many files.
- Batches of Python generators and ``keras.utils.PyDataset`` are copied before TensorFlow
  sees them when there are several replicas (:func:`copied_batches`, applied by a prepared
  model's ``fit``, so ``tfscale.fit`` and ``prepare`` + ``model.fit`` both get it):
  TensorFlow otherwise writes into the user's arrays.
- The fit's iterators are destroyed off the caller's thread (:class:`FitInputs`,
  :func:`released_in_background`): destroying one waits for its prefetch and autotuning
  threads. That covers the iterators Keras makes and drops during the fit (each validation
  epoch's), not only the training input.
"""

from __future__ import annotations

import sys
import threading
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfscale.interop import internals
from tfscale.strategy.current import num_workers

__all__ = [
    "COPIED_FIT_ARGUMENTS",
    "EpochOrder",
    "FitInputs",
    "KerasInputs",
    "agreed_seed",
    "copied_batches",
    "distributed_input",
    "finite_length",
    "generator_kind",
    "is_copied",
    "is_dataset_fn",
    "plan_inputs",
    "released_in_background",
    "replica_lengths",
]


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
    """``dataset_fn`` as ``model.fit`` should receive it under ``strategy``: a distributed
    dataset (see the module doc). Anything else is returned as is."""
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


RELEASE_THREAD = "tfscale-input-release"


def released_in_background(held: list[Any]) -> None:
    """Drops the references in ``held`` (the last ones: the caller keeps no other) in a
    short-lived thread, so that destroying them does not hold up the caller.

    Destroying a distributed iterator joins its prefetch threads (MultiDeviceIterator's
    buffer and each device's prefetch): almost no CPU, but a wait for those threads to be
    scheduled, from a few ms to seconds on a busy machine. Keras's ``fit`` destroys its
    epoch iterator as it returns, after the callbacks' ``on_train_end``, so every call ended
    that much late (#26). The thread is not a daemon: the interpreter waits for it at exit.
    It does not hold the strategy's turn (``turns.turn``), which the fit holds: the next fit
    would wait for it at its start instead.
    """
    if held:
        threading.Thread(target=held.clear, name=RELEASE_THREAD).start()


class FitInputs:
    """What one fit iterates, held so that none of it is destroyed on the caller's thread.

    A prepared model's ``fit`` holds Keras's epoch iterators (:meth:`watch`: training's,
    validation's, an ``evaluate``'s run by a callback) and every iterator they make (Keras's
    ``evaluate`` makes a new one every validation epoch, and a spare as that one runs out).
    Whatever Keras has dropped is handed to :func:`released_in_background` when the next one
    comes, and the rest when the fit ends (:meth:`release`). Destroying an iterator can leave
    the caller idle for up to 60 s: its autotuning thread can miss the wake-up and sleep out
    its period, which grows with the iterator's age (docs/training.md, "Releasing tf.data
    iterators off your thread"), so each validation epoch could start that much late.
    """

    # The references to an object that only this one holds, as hold counts them: the
    # list's entry and getrefcount's argument.
    _ONLY_OURS = 2

    def __init__(self) -> None:
        self._held: list[Any] = []

    def watch(self, epoch_iterator: Any) -> None:
        """Holds ``epoch_iterator`` and every iterator it makes from now on."""
        if any(held is epoch_iterator for held in self._held):
            return
        self.hold(epoch_iterator)
        inputs = weakref.ref(self)  # the epoch iterator must not keep this object alive

        def made(iterator: Any) -> None:
            held = inputs()
            if held is not None:
                held.hold(iterator)

        internals.watch_epoch_iterators(epoch_iterator, made)

    def hold(self, item: Any) -> None:
        """Holds ``item``, first releasing what only this object still holds."""
        kept: list[Any] = []
        dropped: list[Any] = []
        while self._held:
            (kept if sys.getrefcount(self._held[-1]) > self._ONLY_OURS else dropped).append(
                self._held.pop()
            )
        self._held = [*kept[::-1], item]
        released_in_background(dropped)

    def release(self) -> None:
        """Releases everything held, off the caller's thread."""
        held, self._held = self._held, []
        released_in_background(held)


# The arguments of Model.fit whose generators and PyDatasets :func:`copied_batches` copies
# (a prepared model's fit) and the doctor checks (doctor/instrument.py): one list for both.
COPIED_FIT_ARGUMENTS = ("x", "validation_data")


def _copy_arrays(batch: Any) -> Any:
    return tf.nest.map_structure(
        lambda leaf: np.array(leaf, copy=True) if isinstance(leaf, np.ndarray) else leaf, batch
    )


class _CopiedPyDataset(keras.utils.PyDataset):  # type: ignore[misc]
    """The user's PyDataset with each batch's arrays copied; Keras's adapter still runs it
    (its workers, queue, epoch hooks and length are the user's)."""

    def __init__(self, source: Any) -> None:
        super().__init__(
            workers=source.workers,
            use_multiprocessing=source.use_multiprocessing,
            max_queue_size=source.max_queue_size,
        )
        self.source = source

    def __getitem__(self, index: int) -> Any:
        return _copy_arrays(self.source[index])

    def __len__(self) -> int:
        return len(self.source)

    @property
    def num_batches(self) -> int | None:
        return self.source.num_batches  # type: ignore[no-any-return]

    def on_epoch_begin(self) -> None:
        self.source.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self.source.on_epoch_end()


def _copied_generator(source: Iterator[Any]) -> Iterator[Any]:
    for batch in source:
        yield _copy_arrays(batch)


def generator_kind(data: Any) -> str | None:
    """``"generator"`` or ``"PyDataset"`` for the inputs Keras reads through
    ``from_generator`` (see :func:`copied_batches`); None for anything else."""
    if isinstance(data, keras.utils.PyDataset):
        return "PyDataset"
    if isinstance(data, types.GeneratorType):
        return "generator"
    return None


def is_copied(data: Any) -> bool:
    """Whether ``data`` is one of :func:`copied_batches`'s copying wrappers."""
    if isinstance(data, _CopiedPyDataset):
        return True
    return isinstance(data, types.GeneratorType) and data.gi_code is _copied_generator.__code__


def copied_batches(data: Any, strategy: tf.distribute.Strategy) -> Any:
    """A Python generator or ``keras.utils.PyDataset`` whose batches' numpy arrays are
    copied, when ``strategy`` has several replicas; anything else as it is.

    Keras feeds both through ``tf.data.Dataset.from_generator``, whose tensors may alias
    the arrays the generator returns (zero-copy when their memory is 64-byte aligned).
    Under MirroredStrategy, with the iterator read inside the train function as Keras
    reads it, the first replica's share of such a batch reaches the step as a buffer
    TensorFlow believes it owns, and an elementwise op (the loss's ``y_true - y_pred``)
    writes its result into it: the USER's array changes, silently, and the next epoch
    trains on the result. Whether it happens depends on where the allocator put the
    array. Reproduced with TensorFlow alone (``tests/training/test_inputs.py``); Keras's
    own ``model.fit`` under the same strategy does it. A copy per batch costs one memcpy.
    """
    kind = generator_kind(data)
    if strategy.num_replicas_in_sync < 2 or kind is None or is_copied(data):
        return data
    return _CopiedPyDataset(data) if kind == "PyDataset" else _copied_generator(data)


def _plain_arrays(*parts: Any) -> bool:
    """Numeric numpy arrays or dense tensors (nested), the inputs :class:`EpochOrder` takes;
    anything else (DataFrames, sparse tensors, text) stays with Keras's own adapter."""
    leaves = [leaf for part in parts if part is not None for leaf in tf.nest.flatten(part)]
    if not leaves:
        return False
    for leaf in leaves:
        if isinstance(leaf, np.ndarray):
            if leaf.dtype.kind not in "biuf" or leaf.ndim == 0:
                return False
        elif not (isinstance(leaf, tf.Tensor) and leaf.dtype != tf.string and leaf.shape.rank):
            return False
    return True


def agreed_seed(seed: int, strategy: tf.distribute.Strategy) -> int:
    """Replica 0's ``seed`` on every worker (the arrays' order must be the same on all of
    them: each keeps its DATA shard of it); ``seed`` itself on one worker."""
    if num_workers(strategy) == 1:
        return seed
    values = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(seed if context.replica_id_in_sync_group == 0 else 0, tf.int64)
    )
    return int(strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None))


def replica_lengths(count: int, batch: int, replicas: int) -> np.ndarray:
    """Examples of each replica's share of each batch of one epoch of ``count`` examples, in
    order (batch 0's replicas, then batch 1's...): how tf.distribute splits a global batch
    of ``n`` (``experimental_distribute_dataset``'s rebatch when the batch size is not
    static): ``ceil(n / replicas)`` each, the last ones shorter or empty."""
    sizes = [batch] * (count // batch) + ([count % batch] if count % batch else [])
    lengths = []
    for n in sizes:
        share = -(-n // replicas)
        lengths += [max(0, min(share, n - r * share)) for r in range(replicas)]
    return np.asarray(lengths, dtype=np.int64)


class EpochOrder:
    """Arrays as ONE dataset for every epoch of a fit, each epoch in its own fixed order.

    Keras makes (and tears down) a distributed iterator per epoch, plus a spare one at each
    epoch's end: ~90 ms each on 2 logical CPUs, more than a short epoch's training. Here
    the epochs ``range(first, epochs)`` follow each other in one dataset, so Keras keeps one
    iterator for the whole fit (``steps_per_epoch`` set: its iterator continues). Epoch ``e``
    is batched in the order of a permutation fixed by ``(seed, e)`` (or in the given order
    with ``shuffle=False``), the same batches Keras's array adapter makes, last partial batch
    included, so a run resumed at epoch ``e`` sees what the run it continues would have.

    No Python runs per batch: each epoch's permutation is a tensor made in the pipeline,
    cut into batches (or, with ``replicas`` > 1, into each replica's share of each batch,
    as tf.distribute would split it: :func:`replica_lengths`) and gathered from the arrays.
    Building it traces two small functions, with no AutoGraph: a fit's set-up time (#26).

    Args:
        arrays: ``(x, y, sample_weight)``, any of them nested structures of arrays.
        batch_size: Global batch size (None: Keras's default, 32).
        epochs: The epochs this fit runs (``range(initial_epoch, epochs)``).
        shuffle: Permute each epoch.
        seed: Seed of the permutations (kept in checkpoints: ``training/checkpoint.py``).
        replicas: 1: the dataset yields global batches (for tf.distribute to split); N: it
            yields the N replicas' shares of each global batch in turn, as
            ``distribute_datasets_from_function`` on one worker hands them out.
        endless: Repeat the epochs' batches forever, for a distributed dataset on one
            worker. Keras runs ``steps_per_epoch`` steps per epoch either way (it reads a
            length unknown or infinite alike), and tf.distribute reads an infinite dataset
            without its partial-batch handling, a ``cond`` around each replica's read traced
            into every train function (0.05 CPU-s of a small fit on 2 replicas,
            benchmarks/fit_cost.py): every replica gets its share of every batch, empty
            ones included, so there is no partial batch to handle. Not for a fit that
            checkpoints: a resumed run's first epoch, its trained batches skipped, ends
            where the data ends.

    Attributes:
        dataset: The dataset to give Keras (with ``steps_per_epoch``).
        steps_per_epoch: Batches in one epoch.
    """

    def __init__(
        self,
        arrays: tuple[Any, Any, Any],
        batch_size: int | None,
        *,
        epochs: range,
        shuffle: bool,
        seed: int,
        replicas: int = 1,
        endless: bool = False,
    ) -> None:
        x, y, sample_weight = arrays
        # Lists become tuples, as Keras's array adapter makes them: tf.data would stack a
        # list of arrays into one tensor.
        parts = internals.lists_to_tuples(tuple(p for p in (x, y, sample_weight) if p is not None))
        if y is None and sample_weight is None and not isinstance(x, (tuple, list)):
            # x alone is given to train_step as x, not (x,): Keras's pack_x_y_sample_weight.
            parts = parts[0]
        tensors = tf.nest.map_structure(tf.convert_to_tensor, parts)
        count = int(tf.shape(tf.nest.flatten(tensors)[0])[0])
        batch = 32 if batch_size is None else int(batch_size)
        self.seed = int(seed)
        self.steps_per_epoch = -(-count // batch)
        lengths = tf.constant(replica_lengths(count, batch, replicas))
        seed_tensor = tf.constant(self.seed, tf.int64)

        @tf.autograph.experimental.do_not_convert
        def epoch_batches(epoch: tf.Tensor) -> tf.data.Dataset:
            indices = tf.range(count, dtype=tf.int64)
            if shuffle:
                seeds = tf.stack([seed_tensor, epoch])
                indices = tf.random.experimental.stateless_shuffle(indices, seeds)
            pieces = tf.RaggedTensor.from_row_lengths(indices, lengths, validate=False)
            return tf.data.Dataset.from_tensor_slices(pieces)

        @tf.autograph.experimental.do_not_convert
        def gather(indices: tf.Tensor, data: Any) -> Any:
            return tf.nest.map_structure(lambda t: tf.gather(t, indices), data)

        order = tf.data.Dataset.from_tensor_slices(tf.constant(list(epochs), tf.int64))
        order = order.flat_map(epoch_batches)
        dataset = tf.data.Dataset.zip((order, tf.data.Dataset.from_tensors(tensors).repeat()))
        dataset = dataset.map(gather, num_parallel_calls=tf.data.AUTOTUNE)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA
        )
        # (flat_map leaves its length unknown, as Keras's loop over all epochs needs:
        # see _length_hidden; repeat() makes it infinite, which Keras reads alike.)
        if endless:
            dataset = dataset.repeat()
        self.dataset = dataset.with_options(options).prefetch(tf.data.AUTOTUNE)


def _length_hidden(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """The dataset with an unknown length, for Keras's loop over all epochs.

    With ``steps_per_epoch`` set, Keras counts the steps it has run in whole executions and
    stops an epoch early once that count passes the dataset's length (with
    ``steps_per_execution`` not dividing the epoch, the last epoch loses steps), then makes a
    spare iterator; with the length unknown it runs ``steps_per_epoch`` steps every epoch.
    """
    if int(dataset.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY):
        return dataset
    return dataset.filter(lambda *_: True)


@dataclass
class KerasInputs:
    """What ``tfscale.fit`` hands to ``model.fit`` once its input decisions are made.

    Attributes:
        fit: Keyword arguments for ``model.fit``'s data (``x, y, sample_weight, batch_size,
            shuffle, steps_per_epoch, validation_split, validation_data, validation_steps,
            validation_batch_size``).
        order: The arrays' :class:`EpochOrder`, when ``fit`` batches them itself.
        unknown_length: A multi-worker ``dataset_fn`` whose length is hidden (its epochs
            end when every worker agrees the data has ended).
    """

    fit: dict[str, Any]
    order: EpochOrder | None = None
    unknown_length: bool = False


def finite_length(dataset: Any) -> int | None:
    """Batches of a ``tf.data.Dataset`` of known, finite length; None otherwise."""
    if not isinstance(dataset, tf.data.Dataset):
        return None
    count = int(dataset.cardinality())
    return count if count > 0 else None


def plan_inputs(
    *,
    x: Any,
    y: Any,
    sample_weight: Any,
    batch_size: int | None,
    shuffle: bool | str,
    steps_per_epoch: int | None,
    validation_split: float,
    validation_data: Any,
    validation_steps: int | None,
    validation_batch_size: int | None,
    epochs: range,
    seed: int,
    strategy: tf.distribute.Strategy,
    resumable: bool = False,
    class_weight: Any = None,
) -> KerasInputs:
    """Turns ``fit``'s data arguments into ``model.fit``'s, with one iterator per fit where
    the data allows it (see :class:`EpochOrder`).

    - Numeric arrays with ``shuffle`` True or False: :class:`EpochOrder` (after Keras's own
      ``validation_split``; on one worker already split per replica and distributed, unless
      ``class_weight`` is given) over several epochs, and over one when the fit is ``resumable``
      (it checkpoints): a run resumed in its last epoch must batch that epoch as the run it
      continues did, not in Keras's own shuffle. Other arrays (DataFrames, sparse, text) go
      to Keras's adapter.
    - A finite ``tf.data.Dataset`` of known length: repeated for the fit's epochs, with
      ``steps_per_epoch`` its length, so Keras's iterator continues across epochs; each
      repetition re-runs the dataset's own shuffle. Under several workers it is sharded
      by DATA (see the module doc).
    Validation data stays as given: Keras's ``evaluate`` resets its iterator every time.
    - ``dataset_fn``: a distributed dataset (its length hidden across workers).
    Anything with ``steps_per_epoch`` set by the user stays as it is: Keras's meaning.
    """
    fit: dict[str, Any] = {
        "x": x,
        "y": y,
        "sample_weight": sample_weight,
        "batch_size": batch_size,
        "shuffle": shuffle,
        "steps_per_epoch": steps_per_epoch,
        "validation_split": validation_split,
        "validation_data": validation_data,
        "validation_steps": validation_steps,
        "validation_batch_size": validation_batch_size,
    }
    order = None
    several = len(epochs) > 1 and steps_per_epoch is None
    ordered = (several or (resumable and len(epochs) == 1)) and steps_per_epoch is None
    if ordered and shuffle in (True, False) and _plain_arrays(x, y, sample_weight):
        if validation_split and validation_data is None:
            (x, y, sample_weight), fit["validation_data"] = internals.train_validation_split(
                (x, y, sample_weight), validation_split
            )
        # One worker: the dataset yields each replica's share, so tf.distribute has nothing
        # to split (its rebatch costs a traced function per fit); several: global batches,
        # of which each worker keeps its DATA share. Keras maps class weights over a
        # dataset, which a distributed one cannot.
        one_worker = num_workers(strategy) == 1 and class_weight is None
        replicas = strategy.num_replicas_in_sync if one_worker else 1
        order = EpochOrder(
            (x, y, sample_weight), batch_size, epochs=epochs, shuffle=bool(shuffle), seed=seed,
            replicas=replicas, endless=one_worker and not resumable,
        )  # fmt: skip
        dataset = order.dataset
        if one_worker:
            dataset = strategy.distribute_datasets_from_function(lambda _: order.dataset)
        fit.update(
            x=dataset, y=None, sample_weight=None, batch_size=None, shuffle=False,
            steps_per_epoch=order.steps_per_epoch, validation_split=0.0,
            # Keras batches validation arrays with batch_size when this is None.
            validation_batch_size=validation_batch_size or batch_size,
        )  # fmt: skip
    elif isinstance(x, tf.data.Dataset):
        fit["shuffle"] = False  # Keras ignores it for datasets, and warns on every call
        length = finite_length(x)
        if several and length is not None:
            fit.update(x=_length_hidden(x.repeat(len(epochs))), steps_per_epoch=length)
        fit["x"] = _sharded(fit["x"], strategy)
    unknown_length = is_dataset_fn(x) and num_workers(strategy) > 1
    if is_dataset_fn(x):
        fit["x"] = distributed_input(x, strategy)
    if fit["validation_data"] is not None and is_dataset_fn(fit["validation_data"]):
        fit["validation_data"] = distributed_input(fit["validation_data"], strategy)
    return KerasInputs(fit, order, unknown_length)
