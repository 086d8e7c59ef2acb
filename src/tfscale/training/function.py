"""The functions Keras's ``fit`` and ``evaluate`` call on a prepared model.

Keras composes its train function as one step on data -> several steps on an iterator ->
a Python function over the iterator (``keras/src/backend/tensorflow/trainer.py``,
``make_train_function``); this is the same composition with three changes::

    StepFunction(iterator)                     Python: skip on resume, timing hook, end of data
      multi_step(iterator)   tf.function       up to steps_per_execution steps; single worker:
                                               get_next; several: get_next_as_optional, whose
                                               emptiness every worker agrees on. Several steps
                                               are one while loop; a step that returns the
                                               metrics (Keras's own) is traced once in it, one
                                               whose outputs leave the loop twice (the first
                                               step's outputs give the loop's structure)
        one_step(data)                         cross-replica: strategy.run(replica_step)
          replica_step(data)                   the model's own train_step / test_step, with
                                               its example count for the optimizer
                                               (optimizer.step_context), losses unscaled by
                                               the replica count, layer calls recomputed
                                               (layercalls); with jit_compile the whole step
                                               but the optimizer's update is one XLA cluster
                                               (xla.py)
      logs                                     the model's metrics read over ALL replicas when
                                               the step returns them (as one device gives),
                                               else the step's outputs reduced as Keras does

The per-replica step is the model's (user overrides included), so everything the step does
is honoured; the distributed update itself is the optimizer's (``optimizer.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import keras
import numpy as np
import tensorflow as tf

from tfscale.errors import TrainingError, explain
from tfscale.interop import internals
from tfscale.strategy.current import num_workers
from tfscale.training.batchwide import load_balancing_over_the_batch
from tfscale.training.layercalls import layer_calls
from tfscale.training.memory.oom import is_out_of_memory, out_of_memory_error
from tfscale.training.optimizer import step_context
from tfscale.training.xla import (
    check_compilable,
    compiled_step,
    in_compiled_step,
    is_xla_failure,
    xla_error,
)

__all__ = ["StepFunction", "StepTiming", "example_count"]

Kind = Literal["train", "test"]


@dataclass(frozen=True)
class StepTiming:
    """Wall time of one call of the train function, measured when timings are asked for.

    Attributes:
        fetch_seconds: Time blocked getting the call's batches from the input.
        step_seconds: Time of the steps themselves, until their logs were on the host.
    """

    fetch_seconds: float
    step_seconds: float


def _leading(value: Any) -> tf.Tensor:
    if isinstance(value, tf.SparseTensor):
        return value.dense_shape[0]
    if isinstance(value, tf.RaggedTensor):
        return value.nrows()
    return tf.shape(value)[0]


def _as_tensor(value: Any) -> Any:
    """A step's log value as a tensor: Keras takes Python and NumPy numbers in a step's logs
    (its trainer_test's ``CustomTrainTestStepModel`` adds ``logs["my_custom_metric"] = 10.0``),
    and several steps per call carry the logs through a loop, which takes tensors only."""
    if isinstance(value, (bool, int, float, complex, np.generic, np.ndarray)):
        return tf.convert_to_tensor(value)
    return value


def example_count(data: Any) -> tf.Tensor:
    """Examples in one replica's batch: the leading dimension of its first input."""
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    first = next((t for t in tf.nest.flatten(x) if t is not None), None)
    if first is None:
        return tf.constant(0.0)
    return tf.cast(_leading(first), tf.float32)


def _replicas_sum(value: tf.Tensor) -> tf.Tensor:
    """The sum of a scalar over the step's replicas: one scalar all-reduce."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return value
    (total,) = internals.all_reduce_without_gradient(context, "sum", [value])
    return total


def _may_sum_over_the_batch(model: Any) -> bool:
    """Whether the step's loss may have a gradient that sums over the batch: a compiled
    ``Loss`` with ``reduction="sum"`` or None (unreduced), or a ``compute_loss`` override,
    whose sums are known only once it is traced (``conventions.sums_over_examples``)."""
    return not internals.uses_default_step(model, "compute_loss") or any(
        isinstance(loss, keras.losses.Loss) and loss.reduction in ("sum", None)
        for loss in tf.nest.flatten(getattr(model, "loss", None))
    )


class _BatchTotals:
    """What one replica's step knows of the whole batch (``internals.BatchTotals``), for the
    losses that are not per-replica means (``internals.replica_count_scaling_off``). Each
    total is an all-reduce made where the loss needing it is traced, in the replica's step;
    with ``precompute`` (XLA, where no all-reduce can run inside the compiled step) the
    examples' ratio is made before the step when the loss may sum, a ratio asked for
    inside the compiled step is refused, and a total there is None (the mean stays the
    replica's own)."""

    def __init__(self, data: Any, model: Any, *, precompute: bool) -> None:
        self.data, self.model = data, model
        self.ratio = self._ratio() if precompute and _may_sum_over_the_batch(model) else None

    def _ratio(self) -> tf.Tensor:
        count = example_count(self.data)
        return tf.math.divide_no_nan(_replicas_sum(count), count)

    def examples_ratio(self) -> tf.Tensor:
        if self.ratio is not None:
            return self.ratio
        self._refuse_in_compiled_step()
        return self._ratio()

    def known_examples_ratio(self) -> tf.Tensor | None:
        if self.ratio is not None:
            return self.ratio
        return None if in_compiled_step() else self._ratio()

    def total(self, value: tf.Tensor) -> tf.Tensor | None:
        return None if in_compiled_step() else _replicas_sum(value)

    def _refuse_in_compiled_step(self) -> None:
        if in_compiled_step():
            raise TrainingError(
                explain(
                    "A loss summed over the batch's examples (a Loss with "
                    'reduction="sum" or None, a layer\'s add_loss of per-example values) is '
                    "computed inside the train_step tfscale compiles with XLA; making it one "
                    "device's sum needs an all-reduce of the replicas' example counts, which "
                    "cannot run inside the compiled step.",
                    received=f"{type(self.model).__name__}.train_step with jit_compile=True "
                    "computing such a loss (not one model.compile was given with "
                    'reduction="sum" or None, nor one a compute_loss override returns)',
                    fix="give a summed loss to model.compile(loss=...) or return it from a "
                    "compute_loss override (the examples' ratio is then made before the "
                    "compiled step), use a mean (the default reduction, sum_over_batch_size; "
                    "keras.ops.mean in add_loss), or train with jit_compile=False.",
                )
            )


def _first_replica_spec(spec: Any) -> Any:
    components = internals.per_replica_component_specs(spec)
    return components[0] if components else spec


def _replica_batch(iterator: Any) -> int | None:
    """One replica's batch from the iterator's element spec, where its size is static."""
    spec = getattr(iterator, "element_spec", None)
    if spec is None:
        return None
    first = tf.nest.flatten(tf.nest.map_structure(_first_replica_spec, spec))
    shape = getattr(first[0], "shape", None) if first else None
    if shape is None or shape.rank is None or shape.rank == 0:
        return None
    return None if shape[0] is None else int(shape[0])


@contextlib.contextmanager
def _unprepared_optimizers_refused() -> Iterator[None]:
    """Makes an optimizer that tfscale did not prepare fail loudly inside a traced step.

    Losses in the step are per-replica means (unscaled by the replica count), so an
    optimizer doing Keras's own all-reduce would sum them: N times the gradient.
    Prepared optimizers have the all-reduce replaced on the instance, which wins over this.
    """

    def refuse(self: Any, grads_and_vars: Any) -> Any:
        raise TrainingError(
            explain(
                f"The train_step applies gradients with optimizer {self.name!r}, which "
                "tfscale did not prepare, so its update would not be averaged over replicas.",
                received=f"{type(self).__name__} {self.name!r} used inside train_step",
                allowed="the model's optimizer, or optimizers held as attributes of the model",
                fix="keep every optimizer the train_step uses as an attribute of the model "
                "(self.d_optimizer = ...) before tfscale.fit / tfscale.prepare.",
            )
        )

    with internals.builtin_all_reduce_replaced(refuse):
        yield


class StepFunction:
    """The callable Keras stores as ``model.train_function`` (or ``test_function``).

    Args:
        model: The prepared model.
        kind: ``"train"`` or ``"test"``.
        options: The model's decided tfscale options (``options.Decided``).
        all_reduce: False runs the same step without the gradient all-reduce (profiling).
        steps_per_execution: Steps per call; None takes the model's (compile()'s).
    """

    def __init__(
        self,
        model: Any,
        kind: Kind,
        options: Any,
        *,
        all_reduce: bool = True,
        steps_per_execution: int | None = None,
    ) -> None:
        self.model = model
        self.kind = kind
        self.options = options
        self.all_reduce = all_reduce
        self.strategy = model.distribute_strategy
        self.steps_per_execution = int(steps_per_execution or model.steps_per_execution)
        self.single_worker = num_workers(self.strategy) == 1
        self.record_timings = False
        self.timings: list[StepTiming] = []
        self.skip = 0  # batches to drop before the next step (a resumed epoch)
        # Steps the next call may run at most (set from the epoch's remaining steps by
        # ExactSteps: Keras's own function runs whole executions past steps_per_epoch).
        self.limit: int | None = None
        self._metric_keys: set[str] | None = None
        self._xla_checked = False
        # Steps run one after the other on given batches (_steps_on_batches) call one
        # function, traced once. Inside a cond or a while loop a step is traced inline: a
        # function holding collective all-reduces (MultiWorkerMirrored, and Mirrored's
        # default on CPUs) fails when called there ("You must feed a value for placeholder tensor
        # 'cond/.../Placeholder'", the failure of Keras's own steps_per_execution > 1 there).
        self._step = tf.function(self._one_step, autograph=False, reduce_retracing=True)
        self._multi = tf.function(self._multi_step, autograph=False, reduce_retracing=True)
        self._on_batches = tf.function(
            self._steps_on_batches, autograph=False, reduce_retracing=True
        )

    # -- per replica ---------------------------------------------------------------------
    def _replica_step(self, data: Any) -> Any:
        # Entered here, in the replica's own thread (MirroredStrategy traces each replica in
        # one): these switches are per thread, so a fit tracing in another thread at the
        # same time (a TaskPool's) keeps its own (#21.4).
        model = self.model
        jit = bool(self.options.jit_compile)
        totals = _BatchTotals(data, model, precompute=jit)
        with internals.replica_count_scaling_off(totals), internals.losses_per_replica():
            if self.kind == "test":
                if jit:
                    return compiled_step(model.test_step, data, name=type(model).__name__)
                return model.test_step(data)
            with (
                _unprepared_optimizers_refused(),
                step_context(
                    example_count(data), all_reduce=self.all_reduce, options=self.options
                ) as context,
                load_balancing_over_the_batch(model)
                if self.options.global_load_balancing
                else contextlib.nullcontext(),
            ):
                if jit:
                    # Forward and backward in one XLA cluster, the update after it (xla.py).
                    outputs = compiled_step(model.train_step, data, name=type(model).__name__)
                else:
                    outputs = model.train_step(data)
        if context.applied == 0 and self.options.accumulation_steps > 1:
            raise TrainingError(
                explain(
                    "accumulation_steps > 1 needs the train_step to apply its gradients "
                    "with the model's optimizer (optimizer.apply_gradients), which this "
                    "train_step never calls.",
                    received=f"{type(model).__name__}.train_step, "
                    f"accumulation_steps={self.options.accumulation_steps}",
                    fix="apply gradients with self.optimizer.apply_gradients(...) in "
                    "train_step, or train with accumulation_steps=1.",
                )
            )
        return outputs

    # -- cross-replica -------------------------------------------------------------------
    def _one_step(self, data: Any) -> Any:
        remat = bool(self.options.remat) and self.kind == "train"
        # What tf.custom_gradient registered while the step is traced (remat's, a pipeline's
        # stages', the model's own) would keep the step alive for the process's life
        # (tensorflow/tensorflow#97697): released once traced, backward pass included.
        traced_into: dict[int, Any] = {}
        with (
            internals.gradient_functions_released(traced_into),
            layer_calls(self.model, remat=remat, traced_into=traced_into),
        ):
            outputs = self.strategy.run(self._replica_step, args=(data,))
        # Keras's own step returns the metrics by construction: known without tracing
        # get_metrics_result in a throwaway graph for its keys (about 15 ms a fit).
        if self._step_returns_metrics() or self._returns_metrics(outputs):
            return {}  # the logs are the metrics, read once at the end of the call
        return tf.nest.map_structure(
            _as_tensor, internals.reduce_per_replica(outputs, self.strategy)
        )

    def _returns_metrics(self, outputs: Any) -> bool:
        if self._metric_keys is None:
            # The keys only: traced in a throwaway graph, nothing runs.
            spec = tf.function(self.model.get_metrics_result).get_concrete_function()
            self._metric_keys = set(spec.structured_outputs)
        return isinstance(outputs, dict) and set(outputs) == self._metric_keys

    def _logs(self, outputs: Any) -> Any:
        if isinstance(outputs, dict) and not outputs:
            return self.model.get_metrics_result()  # cross-replica: every replica's state
        return outputs

    def _multi_step(self, iterator: Any, limit: tf.Tensor) -> tuple[tf.Tensor, Any]:
        if self.steps_per_execution == 1 and self.single_worker:
            # The end of the data is an OutOfRangeError, as in Keras's own function. The
            # step is traced inline, not as a nested function (Keras's one_step_on_data):
            # TensorFlow instantiates one multi-device function fewer, 0.04 CPU-s of a
            # small fit on 2 replicas (benchmarks/fit_cost.py).
            return tf.constant(1), self._logs(self._one_step(iterator.get_next()))
        if self.steps_per_execution > 1 and self._step_returns_metrics():
            return self._loop_of_steps(iterator, limit)
        first = iterator.get_next_as_optional()
        shapes: list[Any] = []

        def run_first() -> tuple[tf.Tensor, Any]:
            outputs = self._one_step(first.get_value())
            shapes.append(tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), outputs))
            return tf.constant(1), outputs

        def none() -> tuple[tf.Tensor, Any]:
            return tf.constant(0), tf.nest.map_structure(
                lambda spec: tf.zeros([d or 0 for d in spec.shape], spec.dtype), shapes[0]
            )

        done, outputs = tf.cond(first.has_value(), run_first, none)
        if self.steps_per_execution > 1:

            def more(count: tf.Tensor, going: tf.Tensor, _: Any) -> tf.Tensor:
                return tf.logical_and(going, count < limit)

            def body(count: tf.Tensor, going: tf.Tensor, last: Any) -> Any:
                optional = iterator.get_next_as_optional()
                return tf.cond(
                    optional.has_value(),
                    lambda: (count + 1, tf.constant(True), self._one_step(optional.get_value())),
                    lambda: (count, tf.constant(False), last),
                )

            done, _, outputs = tf.while_loop(
                more,
                body,
                (done, done > 0, outputs),
                shape_invariants=(
                    tf.TensorShape([]),
                    tf.TensorShape([]),
                    tf.nest.map_structure(lambda _: tf.TensorShape(None), outputs),
                ),
            )
        return done, self._logs(outputs)

    def _step_returns_metrics(self) -> bool:
        """Whether the step's outputs are known, before tracing it, to be the model's metrics:
        Keras's own ``train_step`` / ``test_step``, ``compute_metrics`` and
        ``get_metrics_result`` (a step returns ``compute_metrics``'s result, which is
        ``get_metrics_result``'s)."""
        step = "train_step" if self.kind == "train" else "test_step"
        return all(
            internals.uses_default_step(self.model, name)
            for name in (step, "compute_metrics", "get_metrics_result")
        )

    def _loop_of_steps(self, iterator: Any, limit: tf.Tensor) -> tuple[tf.Tensor, Any]:
        """Up to ``limit`` steps in one while loop whose only state is the step count: the
        step is traced once (its logs, the metrics, are read after the loop). A step whose
        outputs must leave the loop is traced twice by ``_multi_step`` instead: once for the
        first step, whose outputs give the loop's structure, and once in the loop."""

        def more(count: tf.Tensor, going: tf.Tensor) -> tf.Tensor:
            return tf.logical_and(going, count < limit)

        def body(count: tf.Tensor, going: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            optional = iterator.get_next_as_optional()

            def step() -> tuple[tf.Tensor, tf.Tensor]:
                outputs = self._one_step(optional.get_value())
                if tf.nest.flatten(outputs):  # the metrics are returned as {}: not carried
                    raise AssertionError(
                        "Keras's own step returned more than the model's metrics, which "
                        f"StepFunction._step_returns_metrics assumes it does not: {outputs}"
                    )
                return count + 1, tf.constant(True)

            return tf.cond(optional.has_value(), step, lambda: (count, tf.constant(False)))

        done, _ = tf.while_loop(more, body, (tf.constant(0), tf.constant(True)))
        return done, self._logs({})

    def _steps_on_batches(self, batches: tuple[Any, ...]) -> Any:
        outputs = None
        for data in batches:
            outputs = self._step(data)
        return self._logs(outputs)

    # -- Python --------------------------------------------------------------------------
    def __call__(self, iterator: Any) -> Any:
        try:
            return self._checked_call(iterator)
        except tf.errors.ResourceExhaustedError as error:
            if not is_out_of_memory(error):
                raise  # another resource (threads, a quota): not memory
            # Explained with the memory plan of this step and the changes that would fit.
            raise out_of_memory_error(
                self.model, error, self._replica_batch(iterator), self.options
            ) from error

    def _replica_batch(self, iterator: Any) -> int | None:
        """One replica's batch: static in the iterator's spec, else that of the batch after
        the failed step's (read from the input here: the fit is ending with the error)."""
        batch = _replica_batch(iterator)
        if batch is not None or not isinstance(iterator, tf.distribute.DistributedIterator):
            return batch
        if not self.single_worker:
            return None  # the workers' agreement on the next batch is a collective: no peek
        try:
            data = self.fetch(iterator)
        except (StopIteration, tf.errors.OpError):
            return None
        first = tf.nest.flatten(self.strategy.experimental_local_results(data)[0])
        return int(_leading(first[0])) if first else None

    def _checked_call(self, iterator: Any) -> Any:
        if not self.options.jit_compile:
            return self._call(iterator)
        if not self._xla_checked:
            spec = getattr(iterator, "element_spec", None)
            if spec is not None and self.kind == "train":
                check_compilable(self.model, tf.nest.map_structure(_first_replica_spec, spec))
            self._xla_checked = True  # refused: checked again on the next call
        try:
            return self._call(iterator)
        except (tf.errors.UnimplementedError, tf.errors.InvalidArgumentError) as error:
            # What the trial compile cannot see (the loss, metrics, a train_step override).
            if is_xla_failure(error):
                raise xla_error(self.model, error) from None
            raise

    def _call(self, iterator: Any) -> Any:
        if not isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            # train_on_batch / test_on_batch: a generator of undistributed batches.
            logs = None
            for data in itertools.islice(iterator, self.steps_per_execution):
                logs = self._on_batches((data,))
            return logs
        while self.skip > 0:
            self.skip -= 1
            self.fetch(iterator)
        if self.record_timings:
            return self._timed(iterator)
        limit = self.steps_per_execution if self.limit is None else self.limit
        done, logs = self._multi(iterator, tf.constant(limit))
        if not (self.steps_per_execution == 1 and self.single_worker) and not int(done):
            raise StopIteration
        return logs

    def fetch(self, iterator: Any) -> Any:
        """One batch, eagerly: the end of the data raises StopIteration or OutOfRangeError."""
        if self.single_worker:
            return iterator.get_next()
        optional = iterator.get_next_as_optional()
        if not bool(optional.has_value()):
            raise StopIteration
        return optional.get_value()

    def _timed(self, iterator: Any) -> Any:
        start = time.perf_counter()
        batches = []
        try:
            for _ in range(self.steps_per_execution if self.limit is None else self.limit):
                batches.append(self.fetch(iterator))
        except (StopIteration, tf.errors.OutOfRangeError):
            if not batches:
                raise StopIteration from None
        fetched = time.perf_counter()
        logs = self._on_batches(tuple(batches))
        logs = tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, logs)
        self.timings.append(StepTiming(fetched - start, time.perf_counter() - fetched))
        return logs
