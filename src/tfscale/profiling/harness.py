"""The measured step: ``tfscale.fit``'s update on N devices, with or without the all-reduce.

This is the instrument the scaling sweep and ``--verify`` measure with: the step a user of
``tfscale.fit`` runs (their optimizer, ``accumulation_steps``, ``jit_compile``), on the strategy
``choose_strategy`` builds for the devices, timed by the Trainer's profiling hooks. Without
the all-reduce, each replica applies its own local gradient to its own copy of the variables:
no byte crosses between devices, and everything else (compute, update, input) is the same.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tfscale.errors import ProfileError, explain

__all__ = [
    "MeasuredStep",
    "Workload",
    "check_one_batch",
    "in_cluster",
    "resolve_workload",
    "strategy_for",
]

DatasetFn = Callable[[Any], Any]


@dataclass(frozen=True, eq=False)
class Workload:
    """A model to measure and the in-memory data it trains on.

    Attributes:
        name: Shown in reports (``"mlp"``, ``"module:function"``).
        build: Builds the Keras model; called inside ``strategy.scope()``.
        x: Example inputs (the first axis indexes examples).
        y: Integer class labels.
        dataset_fn: Optional transformation of the batched ``tf.data.Dataset`` (e.g. a
            user's preprocessing, or an injected delay), applied before prefetching.
    """

    name: str
    build: Callable[[], Any]
    x: np.ndarray
    y: np.ndarray
    dataset_fn: DatasetFn | None = None


def resolve_workload(
    spec: str | Callable[[], Any], dataset_fn: DatasetFn | None = None, examples: int = 1024
) -> Workload:
    """Turns ``"mlp"``, ``"cnn"``, ``"module:function"`` or a model builder into a workload.

    The embedded ``mlp`` and ``cnn`` train on scikit-learn's digits; any other model gets
    seeded random inputs of its input shape and labels over its output classes.

    Raises:
        ProfileError: The spec names no importable function, or the model is not a
            single-input classifier.
    """
    if isinstance(spec, str) and spec in ("mlp", "cnn"):
        from tfscale import workloads

        data = workloads.digits()
        kind = spec
        return Workload(
            spec, lambda: workloads.build_model(kind), data.x_train, data.y_train, dataset_fn
        )
    if isinstance(spec, str):
        build = _import_builder(spec)
        name = spec
    else:
        build, name = spec, getattr(spec, "__name__", "model")
    probe = build()
    try:
        input_shape = tuple(int(d) for d in probe.inputs[0].shape[1:])
        classes = int(probe.outputs[0].shape[-1])
    except (AttributeError, IndexError, TypeError) as error:
        raise ProfileError(
            explain(
                "The model to measure must be a built Keras classifier with one input.",
                received=f"{name} -> {type(probe).__name__}",
                allowed="a function returning keras.Model with known input shape and logits",
                fix="build it with keras.Input(shape=...) as its first layer.",
            )
        ) from error
    rng = np.random.default_rng(0)
    x = rng.standard_normal((examples, *input_shape)).astype(np.float32)
    y = rng.integers(0, max(classes, 1), size=examples).astype(np.int32)
    check_one_batch(probe, name, x[:2], y[:2])
    return Workload(name, build, x, y, dataset_fn)


def compile_if_needed(model: Any) -> None:
    """What the benchmark trains an uncompiled model with: Adam and a sparse cross-entropy
    on logits (the labels are integer classes)."""
    import keras

    if not getattr(model, "compiled", False):
        model.compile(
            optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )


def check_one_batch(model: Any, name: str, x: np.ndarray, y: np.ndarray) -> None:
    """Runs the model's forward pass and loss on two examples of the benchmark's data
    (inputs of its input shape, integer class labels), before any device is measured.

    Raises:
        ProfileError: Its loss cannot take integer labels (a one-hot
            ``categorical_crossentropy``), with the error Keras gave.
    """
    compile_if_needed(model)
    try:
        loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=False))
        float(np.asarray(loss))
    except Exception as error:  # any failure here is the workload's
        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        raise ProfileError(
            explain(
                "The model's loss cannot take the benchmark's data: inputs of the model's "
                f"input shape and integer class labels (shape {tuple(y.shape)}).",
                received=f"{name}: {type(error).__name__}: {first}",
                allowed="a classifier whose loss takes integer labels, e.g. "
                "keras.losses.SparseCategoricalCrossentropy(from_logits=True)",
                fix="compile with a sparse loss (not one-hot categorical_crossentropy), or "
                "measure your own data with tfscale.ProfileCallback in model.fit.",
            )
        ) from None


def _import_builder(spec: str) -> Callable[[], Any]:
    module_name, _, function_name = spec.partition(":")
    try:
        builder = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ProfileError(
            explain(
                "The model to measure could not be imported.",
                received=spec,
                allowed="mlp, cnn, or module:function where function() returns a keras.Model",
                fix="check that the module is importable from the current directory "
                "(PYTHONPATH) and that the function exists.",
            )
        ) from error
    if not callable(builder):
        raise ProfileError(explain("The model builder is not callable.", received=spec))
    return builder  # type: ignore[no-any-return]


_CLUSTER_STRATEGY: list[Any] = []


def in_cluster() -> bool:
    """Whether this process is a worker of a cluster (``TF_CONFIG`` names one)."""
    from tfscale.cluster import cluster_from_env

    return cluster_from_env() is not None


def strategy_for(devices: Sequence[str]) -> Any:
    """The strategy ``tfscale.fit`` would use over ``devices`` (``choose_strategy``).

    In a cluster every measurement uses the whole cluster's MultiWorkerMirroredStrategy,
    built once per process (``devices`` is ignored): a second collective-based strategy in
    one process would reuse the first one's collective keys (tensorflow/tensorflow#62790).
    """
    from tfscale.strategy import choose_strategy

    if not in_cluster():
        return choose_strategy(list(devices), memory_growth=False).strategy
    if not _CLUSTER_STRATEGY:
        _CLUSTER_STRATEGY.append(choose_strategy(strict=True, memory_growth=False).strategy)
    return _CLUSTER_STRATEGY[0]


TimedStep = Callable[[], tuple[float, float]]


class MeasuredStep:
    """``tfscale.fit``'s training step for one workload on a set of devices, ready to time.

    Two :class:`tfscale.training.trainer.Trainer` share the model and optimizer: one runs the
    real update, the other the same update with the gradient all-reduce switched off
    (``all_reduce=False``: each replica applies its own gradient).
    Both record, per optimizer update, the seconds blocked fetching its micro-batches and the
    seconds of the update itself.

    Use it as a context manager (or call :meth:`close`): its input iterators repeat forever
    and keep prefetching until they are destroyed. Left to the garbage collector (the step
    closures make a reference cycle), they were destroyed at some later, arbitrary point,
    which waited for their prefetch threads to finish running the input's functions: with a
    slow ``dataset_fn`` (the test's 0.25 s ``py_function``) that stalled whatever ran next in
    the process for seconds to minutes (measured: 8.9 s for one ``gc.collect()``, and two
    later tests of the suite took 79-142 s instead of 0.1-0.3 s).

    Attributes:
        strategy: The strategy over ``devices`` (as ``choose_strategy`` builds it).
        examples_per_step: Global batch x accumulation: examples one update consumes.
        with_reduce: Runs one update and returns ``(fetch_s, step_s)``.
        without_reduce: The same without the all-reduce (None for one replica).
    """

    def __init__(
        self,
        workload: Workload,
        devices: Sequence[str],
        batch_per_replica: int,
        *,
        accumulation: int = 1,
        jit_compile: bool = False,
        bucket_bytes: int | None = None,
        gradient_compression: str | None = None,
    ) -> None:
        import tensorflow as tf

        from tfscale.training.trainer import Trainer

        if batch_per_replica < 1 or accumulation < 1:
            raise ProfileError(
                explain(
                    "The per-replica batch and the accumulation count must be at least 1.",
                    received=f"batch_per_replica={batch_per_replica}, accumulation={accumulation}",
                    allowed="integers >= 1",
                )
            )
        self.strategy = strategy_for(devices)
        self.replicas = int(self.strategy.num_replicas_in_sync)
        self.batch_per_replica = batch_per_replica
        self.accumulation = accumulation
        global_batch = batch_per_replica * self.replicas
        self.examples_per_step = global_batch * accumulation
        with self.strategy.scope():
            model = workload.build()
            compile_if_needed(model)
        self.model = model
        self.gradient_sizes = [int(np.prod(v.shape)) * 4 for v in model.trainable_variables]
        dataset = tf.data.Dataset.from_tensor_slices((workload.x, workload.y))
        dataset = dataset.repeat().batch(global_batch, drop_remainder=True)
        if workload.dataset_fn is not None:
            dataset = workload.dataset_fn(dataset)
        dataset = dataset.prefetch(tf.data.AUTOTUNE)
        self.iterator = iter(self.strategy.experimental_distribute_dataset(dataset))
        # One batch, cached: fetching from it costs only the fetch itself (see fetch_floor).
        ready = tf.data.Dataset.from_tensor_slices((workload.x, workload.y))
        ready = ready.batch(global_batch, drop_remainder=True).take(1).cache().repeat()
        self._ready = iter(self.strategy.experimental_distribute_dataset(ready))

        sample = (workload.x[:batch_per_replica], workload.y[:batch_per_replica])

        def timed(reduce: bool) -> TimedStep:
            trainer = Trainer(
                model,
                self.strategy,
                accumulation_steps=accumulation,
                jit_compile=jit_compile,
                all_reduce=reduce,
                sample_batch=sample,
                bucket_bytes=bucket_bytes if reduce else None,
                gradient_compression=gradient_compression if reduce else None,
            )
            trainer.record_timings = True
            self._fetch = trainer.fetch

            def step() -> tuple[float, float]:
                trainer.train(self.iterator, 1)
                timing = trainer.timings.pop()
                return timing.fetch_seconds, timing.step_seconds

            return step

        self.with_reduce = timed(True)
        self.without_reduce = timed(False) if self.replicas > 1 else None

    def __enter__(self) -> MeasuredStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Destroys the input iterators now (idempotent); the step cannot run afterwards."""
        held = [self.__dict__.pop(name, None) for name in ("iterator", "_ready")]
        held.clear()

    def fetch_floor(self, calls: int = 10) -> float:
        """Median seconds to fetch one update's micro-batches when they are already there.

        The Trainer's timed path fetches eagerly (``Trainer.fetch``, per micro-batch, outside
        the compiled step); on a distributed iterator that costs a fixed amount of
        host time even when the pipeline has the batch ready. This measures it on a cached
        one-batch dataset with the same structure, so that only waiting beyond it counts as
        input and the fixed part counts with the step's other host overhead.
        """
        import time

        durations = []
        for index in range(calls + 2):
            start = time.perf_counter()
            for _ in range(self.accumulation):
                self._fetch(self._ready)
            if index >= 2:
                durations.append(time.perf_counter() - start)
        return float(np.median(durations))
