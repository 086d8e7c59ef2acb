"""``Trainer``: builds and runs the distributed training and evaluation functions.

One call of the train function runs up to ``steps_per_execution`` optimizer updates inside
one ``tf.function``; each update reads ``accumulation_steps`` micro-batches with
``get_next_as_optional``. Under MultiWorkerMirroredStrategy that call agrees across workers
whether any worker still has data (an all-reduced flag inside ``tf.distribute``), and a
worker whose share is empty contributes zero examples, so workers whose datasets yield
different numbers of batches finish the epoch together instead of hanging.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from tfscale.errors import NonFiniteLossError, TrainingError, explain
from tfscale.training.precision import DynamicLossScale, Precision, apply_policy
from tfscale.training.step import ReplicaStep

__all__ = ["StepTiming", "Trainer", "build"]


@dataclass(frozen=True)
class StepTiming:
    """Wall time of one optimizer update, measured when ``record_timings`` is on.

    Attributes:
        fetch_seconds: Time blocked getting the update's micro-batches from the input.
        step_seconds: Time of the update itself, until its loss was on the host.
    """

    fetch_seconds: float
    step_seconds: float


def _check_model(model: Any) -> Any:
    if not isinstance(model, keras.Model):
        raise TrainingError(
            explain(
                "tfscale.fit trains Keras models.",
                received=type(model).__name__,
                allowed="a keras.Model",
            )
        )
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise TrainingError(
            explain(
                "The model is not compiled, so it has no optimizer and loss to train with.",
                received=f"model {model.name!r} (compiled={getattr(model, 'compiled', False)})",
                allowed="a model compiled with an optimizer and a loss",
                fix="compile it first, inside the strategy's scope:\n"
                "    with strategy.scope():\n"
                "        model = build_model()\n"
                '        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")',
            )
        )
    optimizer = model.optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise TrainingError(
            explain(
                "The optimizer has Keras's gradient_accumulation_steps set; under "
                "MirroredStrategy it fails with a merge_call RuntimeError and it all-reduces "
                "every micro-batch.",
                received=f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps}",
                fix="remove it from the optimizer and pass "
                f"tfscale.fit(..., accumulation_steps={optimizer.gradient_accumulation_steps})",
            )
        )
    return optimizer


def build(model: Any, strategy: tf.distribute.Strategy, sample_batch: Any) -> None:
    """Creates the model's, metrics' and optimizer's variables in the strategy's scope."""
    with strategy.scope():
        # Keras's own fit does this before its first step (trainer.py, _symbolic_build).
        model._symbolic_build(data_batch=sample_batch)
        optimizer = model.optimizer
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = optimizer.inner_optimizer
        if not optimizer.built:
            optimizer.build(model.trainable_variables)


class Trainer:
    """Step-level control over tfscale's training loop (``tfscale.fit`` drives one).

    Args:
        model: A compiled Keras model whose variables live in ``strategy``'s scope.
        strategy: The distribution strategy.
        precision: The decided precision (see ``training.precision``).
        accumulation_steps: Micro-batches accumulated per optimizer update.
        steps_per_execution: Optimizer updates per call of the compiled train function.
        clipnorm: Clip the all-reduced gradient to this global norm.
        remat: Recompute activations in the backward pass.
        jit_compile: Compile each replica's forward and backward pass with XLA.
        nominal_batch: Global examples of one update, where known (gradient scale only).
        sample_batch: One undistributed batch; when given, the model, its metrics and the
            optimizer are built from it in the strategy's scope (needed before the first
            step if the model or its metrics are not built yet).

    Attributes:
        timings: :class:`StepTiming` of each update while ``record_timings`` is True
            (profiling hook; updates then run one per call, batches fetched eagerly).
        record_timings: Set True to measure fetch vs step time per update.
    """

    def __init__(
        self,
        model: Any,
        strategy: tf.distribute.Strategy,
        *,
        precision: Precision | None = None,
        accumulation_steps: int = 1,
        steps_per_execution: int = 1,
        clipnorm: float | None = None,
        remat: bool = False,
        jit_compile: bool = False,
        nominal_batch: float | None = None,
        sample_batch: Any = None,
    ) -> None:
        self._validate_counts(accumulation_steps, steps_per_execution)
        if clipnorm is not None and not clipnorm > 0:
            raise TrainingError(
                explain("clipnorm must be positive.", received=clipnorm, allowed="a float > 0")
            )
        self.model = model
        self.optimizer = _check_model(model)
        self.strategy = strategy
        if sample_batch is not None:
            build(model, strategy, sample_batch)
        self.precision = precision or Precision("fp32", None, False)
        self.accumulation_steps = accumulation_steps
        self.steps_per_execution = steps_per_execution
        self.record_timings = False
        self.updates = 0  # optimizer updates run so far (fit sets it on resume)
        self.timings: list[StepTiming] = []
        apply_policy(model, self.precision)
        # Keras's TF optimizer keeps the strategy current when it was created and uses it
        # to place its slots; an optimizer made outside the scope would use the default one.
        if hasattr(self.optimizer, "_distribution_strategy"):
            self.optimizer._distribution_strategy = strategy
        nominal = float(nominal_batch or 1.0) * accumulation_steps
        with strategy.scope():
            self.loss_scale = DynamicLossScale() if self.precision.loss_scaling else None
            self.step_fn = ReplicaStep(
                model,
                self.optimizer,
                nominal_batch=nominal,
                accumulation_steps=accumulation_steps,
                clipnorm=clipnorm,
                loss_scale=None if self.loss_scale is None else self.loss_scale.scale,
                remat=remat,
                jit_compile=jit_compile,
            )
            self._loss_total = tf.Variable(0.0, trainable=False, name="epoch_loss_total")
            self._examples = tf.Variable(0.0, trainable=False, name="epoch_examples")
            on_read = {
                "trainable": False,
                "synchronization": tf.VariableSynchronization.ON_READ,
                "aggregation": tf.VariableAggregation.SUM,
            }
            self._eval_loss = tf.Variable(0.0, name="eval_loss", **on_read)
            self._eval_count = tf.Variable(0.0, name="eval_count", **on_read)
        self._train_fn: Any = None
        self._quiet_train_fn: Any = None  # the same function without per-call logs
        self._one_fns: dict[bool, Any] = {}  # one update per call, with / without logs
        # Several workers need end-of-data as a value, not an error (see below).
        self._single_worker = not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        self._batches_fn: Any = None
        self._eval_fn: Any = None
        self._epoch_logs_fn: Any = None
        self._limits: dict[int, tf.Tensor] = {}

    @staticmethod
    def _validate_counts(accumulation_steps: object, steps_per_execution: object) -> None:
        for name, value in (
            ("accumulation_steps", accumulation_steps),
            ("steps_per_execution", steps_per_execution),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TrainingError(
                    explain(
                        f"{name} must be a positive integer.",
                        received=f"{name}={value!r}",
                        allowed="an int >= 1",
                    )
                )

    # -- profiling hooks -------------------------------------------------------------------
    def _set_gradient_all_reduce(self, enabled: bool) -> None:
        """Private knob for profiling: run the same step with or without the all-reduce.

        Without it each replica applies its own local gradient (the replicas' weights then
        drift apart), so the difference in step time is the exposed communication.
        """
        self.step_fn.all_reduce = enabled
        self._train_fn = self._quiet_train_fn = self._batches_fn = None
        self._one_fns = {}

    @property
    def all_reduce_traces(self) -> int:
        """How many gradient all-reduces have been traced into the step functions."""
        return self.step_fn.all_reduce_traces

    # -- the update, in cross-replica context ------------------------------------------------
    def _update(self, batch: Any) -> tf.Tensor:
        """One optimizer update from ``batch`` (k == 1) or the accumulators; returns ok."""
        strategy = self.strategy
        if batch is None:
            result = strategy.run(self.step_fn.reduce_accumulated)
        else:
            result = strategy.run(self.step_fn.fused, args=(batch,))
        grads, loss, examples, finite_grads, finite_loss = result

        def first(value: Any) -> tf.Tensor:
            # All replicas hold the same value after the all-reduce.
            return strategy.experimental_local_results(value)[0]

        finite_grads, finite_loss = first(finite_grads), first(finite_loss)
        loss, examples = first(loss), first(examples)

        def apply() -> tf.Tensor:
            strategy.run(self.step_fn.apply, args=(grads,))
            return tf.constant(True)

        # The cond runs in cross-replica context: a cond in replica context whose branch
        # calls merge_call (Keras's optimizer does) is refused by MirroredStrategy.
        tf.cond(finite_grads, apply, lambda: tf.constant(False))
        if self.loss_scale is not None:
            self.loss_scale.update(finite_grads)
            ok = finite_loss
        else:
            ok = tf.logical_and(finite_loss, finite_grads)
        self._loss_total.assign_add(tf.where(finite_loss, loss * examples, 0.0))
        self._examples.assign_add(examples)
        return ok

    def _logs(self) -> dict[str, tf.Tensor]:
        """Per-execution logs: the exact global loss, the metrics of the first replica.

        Reading a metric's ON_READ variables in cross-replica context all-reduces each of
        them, several collectives per call; the progress bar does not need that. The loss is
        already global (it travels in the gradient all-reduce). Epoch logs use
        :meth:`epoch_logs`, which aggregates every replica, as Keras's own per-step logs do not.
        """
        local = self.strategy.run(self.model.get_metrics_result)
        logs = {k: self.strategy.experimental_local_results(v)[0] for k, v in local.items()}
        logs["loss"] = tf.math.divide_no_nan(self._loss_total, self._examples)
        return logs

    def _global_logs(self) -> dict[str, tf.Tensor]:
        logs = dict(self.model.get_metrics_result())
        logs["loss"] = tf.math.divide_no_nan(self._loss_total, self._examples)
        return logs

    def epoch_logs(self) -> dict[str, float]:
        """The epoch's loss and metrics over all replicas (and workers) so far."""
        if self._epoch_logs_fn is None:
            self._epoch_logs_fn = tf.function(self._global_logs)
        return {name: float(value) for name, value in self._epoch_logs_fn().items()}

    def _build_train_function(self, with_logs: bool = True) -> Any:
        k = self.accumulation_steps

        def train_function(iterator: Any, max_updates: tf.Tensor) -> Any:
            done = tf.constant(0, tf.int64)
            exhausted = tf.constant(False)
            ok = tf.constant(True)
            for _ in tf.range(max_updates):
                if k == 1:
                    optional = iterator.get_next_as_optional()
                    if not optional.has_value():
                        exhausted = tf.constant(True)
                        break
                    ok = self._update(optional.get_value())
                else:
                    micro = tf.constant(0)
                    for _ in tf.range(k):
                        optional = iterator.get_next_as_optional()
                        if not optional.has_value():
                            exhausted = tf.constant(True)
                            break
                        self.strategy.run(self.step_fn.accumulate, args=(optional.get_value(),))
                        micro += 1
                    if micro == 0:
                        break
                    ok = self._update(None)
                done += 1
                if not ok:
                    break
            # One int64 vector, so the host reads it with a single transfer.
            flags = tf.stack([done, tf.cast(exhausted, tf.int64), tf.cast(ok, tf.int64)])
            # Without logs the metric results (several reads and divisions per replica,
            # then copies to the host) are left out of every call; nobody reads them.
            return flags, self._logs() if with_logs else {}

        return tf.function(train_function)

    def _build_one_update_function(self, with_logs: bool) -> Any:
        """The train function for one update of one micro-batch per call, without a loop.

        Same results as :meth:`_build_train_function` with ``max_updates == 1``; the
        ``tf.range`` while loop around a single update costs ~0.3-0.5 ms of CPU per call
        (small CNN, 2 logical CPUs), about 4% of its step (``benchmarks/step_vs_keras.py``).

        On a single worker the batch is taken with a plain ``get_next``, as Keras's own
        step does, and the end of the data arrives as ``OutOfRangeError`` (see
        :meth:`train`): ``get_next_as_optional`` and the cond on its flag cost another
        ~0.5 ms of CPU per call there. Several workers keep the optional: a worker whose
        data ends must still join the others' collectives, or they wait for it forever.
        """
        if self._single_worker:

            def train_next(iterator: Any) -> Any:
                ok = self._update(iterator.get_next())
                one, zero = tf.constant(1, tf.int64), tf.constant(0, tf.int64)
                flags = tf.stack([one, zero, tf.cast(ok, tf.int64)])
                return flags, self._logs() if with_logs else {}

            return tf.function(train_next)

        def train_one(iterator: Any) -> Any:
            optional = iterator.get_next_as_optional()
            has_value = optional.has_value()
            ok = tf.cond(
                has_value, lambda: self._update(optional.get_value()), lambda: tf.constant(True)
            )
            flags = tf.stack(
                [
                    tf.cast(has_value, tf.int64),
                    tf.cast(tf.logical_not(has_value), tf.int64),
                    tf.cast(ok, tf.int64),
                ]
            )
            return flags, self._logs() if with_logs else {}

        return tf.function(train_one)

    def _build_batches_function(self) -> Any:
        def on_batches(batches: tuple[Any, ...]) -> Any:
            if self.accumulation_steps == 1:
                ok = self._update(batches[0])
            else:
                for batch in batches:
                    self.strategy.run(self.step_fn.accumulate, args=(batch,))
                ok = self._update(None)
            return ok, self._logs()

        return tf.function(on_batches)

    # -- public step-level API ---------------------------------------------------------------
    def reset(self) -> None:
        """Resets the epoch's metrics and loss average."""
        self.model.reset_metrics()
        self._loss_total.assign(0.0)
        self._examples.assign(0.0)

    def train(
        self, iterator: Any, max_updates: int, *, logs: bool = True
    ) -> tuple[int, bool, dict[str, Any]]:
        """Runs up to ``max_updates`` optimizer updates from a distributed iterator.

        Args:
            iterator: An iterator over the strategy's distributed dataset.
            max_updates: The most optimizer updates to run in this call.
            logs: Compute the loss and metrics of this call for the returned logs; False
                (when no callback reads batch logs) returns empty logs and saves their
                computation on every call. :meth:`epoch_logs` is exact either way.

        Returns:
            ``(updates_done, input_exhausted, logs)``.

        Raises:
            NonFiniteLossError: The loss (or, without loss scaling, a gradient) became NaN
                or infinite; that update was not applied.
        """
        results: dict[str, Any]
        if self.record_timings:
            done, exhausted, ok, results = self._train_timed(iterator, max_updates)
        elif max_updates == 1 and self.accumulation_steps == 1:
            function = self._one_fns.get(logs)
            if function is None:
                function = self._one_fns[logs] = self._build_one_update_function(logs)
            try:
                flags, results = function(iterator)
            except tf.errors.OutOfRangeError:
                # The single-worker function's end of data: nothing was applied (every
                # update op depends on the batch that could not be read).
                flags, results = tf.constant([0, 1, 1], tf.int64), {}
            done, exhausted_flag, ok_flag = (int(v) for v in flags.numpy())
            exhausted, ok = bool(exhausted_flag), bool(ok_flag)
        else:
            if logs:
                if self._train_fn is None:
                    self._train_fn = self._build_train_function(with_logs=True)
                function = self._train_fn
            else:
                if self._quiet_train_fn is None:
                    self._quiet_train_fn = self._build_train_function(with_logs=False)
                function = self._quiet_train_fn
            limit = self._limits.get(max_updates)
            if limit is None:
                limit = self._limits[max_updates] = tf.constant(max_updates, tf.int64)
            flags, results = function(iterator, limit)
            done, exhausted_flag, ok_flag = (int(v) for v in flags.numpy())
            exhausted, ok = bool(exhausted_flag), bool(ok_flag)
        self.updates += done
        if not ok:
            bad = self.updates
            self.updates -= 1  # that update was not applied
            mean = float(tf.math.divide_no_nan(self._loss_total, self._examples))
            raise NonFiniteLossError(
                explain(
                    f"The training loss became NaN or infinite at optimizer update {bad}; "
                    "that update was not applied and training stopped.",
                    received=f"loss={mean:.4g} (mean before the bad update)",
                    fix="lower the learning rate, pass clipnorm=1.0, use "
                    'mixed_precision="bf16" instead of "fp16", and check the data for NaN '
                    "or infinite values (tf.debugging.check_numerics).",
                )
            )
        return done, exhausted, results

    def _train_timed(
        self, iterator: Any, max_updates: int
    ) -> tuple[int, bool, bool, dict[str, Any]]:
        if self._batches_fn is None:
            self._batches_fn = self._build_batches_function()
        done, logs = 0, self._logs()
        for _ in range(max_updates):
            start = time.perf_counter()
            batches = []
            for _ in range(self.accumulation_steps):
                optional = iterator.get_next_as_optional()
                if not bool(optional.has_value()):
                    break
                batches.append(optional.get_value())
            fetched = time.perf_counter()
            if not batches:
                return done, True, True, logs
            ok_t, logs = self._batches_fn(tuple(batches))
            ok = bool(ok_t)  # waits for the update
            self.timings.append(StepTiming(fetched - start, time.perf_counter() - fetched))
            done += 1
            if not ok or len(batches) < self.accumulation_steps:
                return done, len(batches) < self.accumulation_steps, ok, logs
        return done, False, True, logs

    def evaluate(self, dataset: Any) -> dict[str, float]:
        """Loss and compiled metrics over a distributed dataset, computed on all replicas."""
        if self._eval_fn is None:
            self._eval_fn = tf.function(self._eval_function)
        self.model.reset_metrics()
        self._eval_loss.assign(0.0)
        self._eval_count.assign(0.0)
        iterator = iter(dataset)
        while True:
            exhausted, logs = self._eval_fn(iterator)
            if bool(exhausted):
                break
        return {name: float(value) for name, value in logs.items()}

    def _eval_step(self, batch: Any) -> None:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        y_pred = self.model(x, training=False)
        num_replicas = tf.distribute.get_strategy().num_replicas_in_sync
        loss = tf.cast(
            self.model.compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
            ),
            tf.float32,
        )
        count = tf.cast(tf.shape(tf.nest.flatten(x)[0])[0], tf.float32)
        self._eval_loss.assign_add(loss * float(num_replicas) * count)
        self._eval_count.assign_add(count)
        self.model.compute_metrics(x, y, y_pred, sample_weight)

    def _eval_function(self, iterator: Any) -> Any:
        exhausted = tf.constant(False)
        for _ in tf.range(100):
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                exhausted = tf.constant(True)
                break
            self.strategy.run(self._eval_step, args=(optional.get_value(),))
        logs = dict(self.model.get_metrics_result())
        logs["loss"] = tf.math.divide_no_nan(self._eval_loss, self._eval_count)
        return exhausted, logs
