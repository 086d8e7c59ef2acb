"""The distributed update: what a prepared Keras optimizer does when a replica applies gradients.

Horovod's ``DistributedOptimizer`` is the model: the optimizer the user compiled keeps doing
the update (every Keras optimizer, schedule, weight decay, EMA and ``LossScaleOptimizer``
works), and tfscale changes only what happens before it, on every replica, per call of
``optimizer.apply_gradients`` (Keras's ``train_step``, a user's ``train_step`` override, or a
custom loop under ``strategy.run``)::

    replica r, micro-batch i      w = c_r,i * g_r,i  (c: its examples)   -> += accumulators
    every k-th micro-batch        [w..., c] -- ONE all-reduce(SUM): dense packed, sparse gathered
                                  g = sum(w) / sum(c)   (the mean over every example;
                                                 a sparse g's duplicate rows summed)
                                  clip by the global norm (tfscale.fit(global_clipnorm=...))
                                  all finite? -> the user's optimizer.apply(g)   (its own
                                                 all-reduce switched off: already reduced)
                                  else        -> skipped on every replica, counted (and,
                                                 while ``halt_on_nonfinite`` is set, every
                                                 later update too: tfscale.fit then stops)

The example count ``c`` comes from the step tfscale traced (``step_context``), where losses
are plain per-replica means (``internals.replica_count_scaling_off``); in a custom loop
(``tfscale.prepare_loop``, or a model prepared by ``tfscale.prepare``) the weight and the
count come from the loss the replica differentiated (``loop.py``, ``conventions.py``), so
the update is still one device's however the loss was written (a loss tfscale cannot tell
is refused there). Because the finiteness test runs on the reduced gradients, an overflow
on one replica makes every replica skip the same update, and ``LossScaleOptimizer`` (which reads
one replica's flag, keras/src/optimizers/loss_scale_optimizer.py ``_tf_apply``) now judges
the sum. Under a ``LossScaleOptimizer`` each replica's scaled loss is also divided by N
(``DistributedUpdate.scale_loss``, weighed back in float32 with the example count), so the
float16 backward pass carries one device's magnitudes and the dynamic scale overflows where
one device's does. Clipping and Keras's own ``clipnorm`` / ``global_clipnorm`` run after the
reduction, so they clip the global gradient as on one device.

Branching on the k-th micro-batch or on finiteness and then calling the optimizer inside the
branch is refused by MirroredStrategy in replica context ("merge_call called while defining a
new graph", the failure of Keras's own ``gradient_accumulation_steps``); the branch is taken
in cross-replica context through ``merge_call``, as Keras's ``LossScaleOptimizer`` does.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from tfscale.errors import TrainingError, explain
from tfscale.interop import internals, registry
from tfscale.training import xla
from tfscale.training.adopt import wrapped_optimizers
from tfscale.training.allreduce import all_reduce_packed
from tfscale.training.conventions import record_scaled
from tfscale.training.sharding import ShardedState, install

__all__ = [
    "DistributedUpdate",
    "StepContext",
    "current_update_weight",
    "distributed_update",
    "step_context",
    "step_in_progress",
]


@dataclass
class StepContext:
    """What one replica's traced step tells the optimizer (trace time only).

    Attributes:
        count: This replica's examples in the (micro-)batch, as a float32 tensor.
        all_reduce: False to apply local gradients (profiling: the same step without
            communication).
        applied: Calls of ``apply`` traced so far in this step.
        loss_share: The scaled loss this replica's backward pass ran on was divided by this
            (``LossScaleOptimizer.scale_loss`` under N replicas: N); ``apply`` weighs its
            gradients by ``count * loss_share``, the example total staying ``count``.
        options: The tracing step function's ``options.Decided``: its ``bucket_bytes``,
            ``gradient_compression`` and ``global_clipnorm`` are the update's in this step (two
            functions of one model, e.g. profiling's with and without the all-reduce, each
            keep theirs); None uses the update's ``options``.
        weight: What the gradient is multiplied by before the all-reduce, where it is not
            ``count`` (a custom loop's loss convention, ``conventions.weighting``); None:
            ``count * loss_share``.
        scaled: Whether the step's loss passed through the optimizer's ``scale_loss``.
        gathered: Whether a tensor was gathered over the replicas with a gradient
            (``batchwide.py``) in the step.
    """

    count: tf.Tensor | None
    all_reduce: bool = True
    applied: int = 0
    loss_share: int = 1
    options: Any = None
    weight: tf.Tensor | None = None
    scaled: bool = False
    gathered: bool = False

    def update_weight(self, count: tf.Tensor) -> tf.Tensor:
        """What this replica's gradient is multiplied by before the all-reduce (``count``:
        its examples): ``weight`` where set, else ``count * loss_share``. Read where the
        gradient is (``apply``, the whole-batch gather's backward pass: ``batchwide.py``),
        after ``scale_loss`` may have set it."""
        if self.weight is not None:
            return tf.cast(self.weight, tf.float32)
        return count * float(self.loss_share)


_LOCAL = threading.local()


@contextlib.contextmanager
def step_context(
    count: tf.Tensor | None, *, all_reduce: bool = True, options: Any = None
) -> Iterator[StepContext]:
    """Marks the code traced inside as one replica's step over ``count`` examples.

    MirroredStrategy traces each replica in its own thread, so the context is thread-local.
    """
    previous = getattr(_LOCAL, "step", None)
    context = StepContext(count, all_reduce, options=options)
    _LOCAL.step = context
    try:
        yield context
    finally:
        _LOCAL.step = previous


def _current() -> StepContext | None:
    return getattr(_LOCAL, "step", None)


def gathered_in_step() -> None:
    """Notes that the step this thread is tracing gathers a tensor over the replicas with a
    gradient (``batchwide.py``): ``apply`` refuses it for a float8 model."""
    step = _current()
    if step is not None:
        step.gathered = True


def current_update_weight() -> tf.Tensor | None:
    """This replica's weight in the update (:meth:`StepContext.update_weight`) in the step
    this thread is tracing (one of tfscale's own replica steps), or None."""
    step = _current()
    if step is None or step.count is None:
        return None
    return step.update_weight(tf.cast(step.count, tf.float32))


def step_in_progress() -> bool:
    """Whether this thread is tracing one of tfscale's own replica steps (``function.py``)."""
    return _current() is not None


def _weighted(gradient: Any, count: tf.Tensor) -> Any:
    """``count * gradient``, and exactly zero for an empty batch (whose mean may be NaN)."""

    def scale(values: tf.Tensor) -> tf.Tensor:
        # One pass over the gradient: 0 where count is 0 even for NaN values, which
        # tf.where(count > 0, values * count, zeros) needed three for (10.5 ms vs 3.4 ms
        # for a 2048x2048 kernel on one CPU core).
        return tf.math.multiply_no_nan(values, tf.cast(count, values.dtype))

    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(scale(gradient.values), gradient.indices, gradient.dense_shape)
    return scale(tf.convert_to_tensor(gradient))


def _divided(gradient: Any, total: tf.Tensor) -> Any:
    if isinstance(gradient, tf.IndexedSlices):
        inverse = tf.cast(1.0 / total, gradient.values.dtype)
        return tf.IndexedSlices(gradient.values * inverse, gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(1.0 / total, gradient.dtype)


def _rows_summed(gradient: Any) -> Any:
    """A ``tf.IndexedSlices`` with one entry per row, its duplicates summed; anything else as is.

    The dense gradient's rows, still sparse. Keras's sparse updates square (Adam, AdamW, Nadam,
    RMSprop, Adagrad) or clip each entry on its own and sum duplicates only afterwards, so
    without this a row that two replicas touched (every row of a positional embedding) gets
    ``r0**2 + r1**2`` where one device gets ``(r0 + r1)**2``. Summed here, after the
    all-reduce's gather, the update is the dense gradient's on any number of replicas
    (docs/training.md, "Sparse gradients"); the bytes all-reduced stay the rows touched.
    """
    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    rows, entry_row = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(gradient.values, entry_row, tf.shape(rows)[0])
    return tf.IndexedSlices(values, rows, gradient.dense_shape)


def _all_finite(gradients: Sequence[Any]) -> tf.Tensor:
    flags = [
        tf.reduce_all(tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g))
        for g in gradients
        if g is not None
    ]
    return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


class DistributedUpdate:
    """tfscale's update installed on one Keras optimizer (see the module docstring).

    Create it with :func:`distributed_update` inside the strategy's scope; it replaces the
    optimizer instance's ``apply`` (and so ``apply_gradients``) and switches off its built-in
    all-reduce. Options may be changed between traces (``prepare`` does).

    Attributes:
        optimizer: The model's optimizer (possibly a ``LossScaleOptimizer``).
        accumulation_steps: Micro-batches per update.
        options: The last ``options.Decided`` given (its ``global_clipnorm``,
            ``bucket_bytes`` and ``gradient_compression``), for an ``apply`` outside
            tfscale's step functions; inside one, the step's own options win
            (:class:`StepContext`). None: no clipping, one packed float32 all-reduce.
        all_reduce_traces: Gradient all-reduces traced so far (tests and profiling).
        all_reduce_runs: Gradient all-reduces run (replica 0's count).
        skipped: Updates skipped because a reduced gradient was not finite.
        halt_on_nonfinite: While 1, a non-finite update also halts every later update
            (``halted``), so a stop noticed a few steps late (``tfscale.fit``'s guard runs
            off the training thread) leaves the model as it was before the bad update.
    """

    def __init__(self, optimizer: Any, strategy: tf.distribute.Strategy) -> None:
        _refuse_ema_overwrite(optimizer, strategy)
        self.optimizer = optimizer
        self.strategy = strategy
        self.accumulation_steps = 1
        self.options: Any = None
        self.all_reduce_traces = 0
        # Set by tfscale.prepare_loop: (update, variables) -> the StepContext of a custom
        # loop's replica step (training/loop.py).
        self.loop_step: Callable[[DistributedUpdate, list[Any]], StepContext] | None = None
        self._original_apply: Callable[..., Any] = type(optimizer).apply.__get__(optimizer)
        self._accumulators: dict[int, tf.Variable] = {}
        self.sharded: ShardedState | None = None
        with strategy.scope():
            self.all_reduce_runs = self._local_counter("all_reduce_runs", tf.int64)
            self.skipped, self.halted, self.halt_on_nonfinite = (
                tf.Variable(
                    0,
                    dtype=tf.int64,
                    trainable=False,
                    name=name,
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                )
                for name in ("skipped_updates", "halted", "halt_on_nonfinite")
            )
            self._micro_batches = self._local_counter("micro_batches", tf.int64)
            self._count = self._sum_variable(tf.zeros((), tf.float32), "count_accum")
        registry.replace("optimizer-apply", optimizer, "apply", self.apply)
        self._original_scale_loss = type(optimizer).scale_loss.__get__(optimizer)
        registry.replace("optimizer-apply", optimizer, "scale_loss", self.scale_loss)
        self._own_all_reduce_off()

    def shard_state(self) -> None:
        """Keeps the optimizer's slots sharded over the replicas (``training/sharding.py``).

        Raises:
            TrainingError: The optimizer's update is not elementwise, or it is built already.
        """
        self.sharded = install(self.optimizer, self.strategy)

    # -- variables -----------------------------------------------------------------------
    def _build_lazily(self, variables: Sequence[Any]) -> None:
        """Builds the optimizer (and its accumulators) now, outside the traced step.

        Keras builds an optimizer on its first ``apply``. Inside ``strategy.run`` in a
        ``tf.function`` that creates its slot variables (Adam's moments) in the replica
        step, and with TensorFlow's collective all-reduce the first step then fails: "You
        must feed a value for placeholder tensor 'cond/else/_1/cond/Placeholder_1'"
        (``fn_with_cond``, the function TensorFlow makes to initialize variables created in
        a function's first call). Here the variables are created eagerly
        (``tf.init_scope``) in the strategy's scope, from cross-replica context, the way
        ``optimizer.build(model.trainable_variables)`` in the scope would have.
        """
        variables = list(variables)

        def build(_: tf.distribute.Strategy) -> None:
            with tf.init_scope(), self.strategy.scope():
                if not self.optimizer.built:
                    self.optimizer.build(variables)
                if self.accumulation_steps > 1:
                    self.build_accumulators(variables)

        tf.distribute.get_replica_context().merge_call(build)

    @staticmethod
    def _local_counter(name: str, dtype: tf.DType) -> tf.Variable:
        return tf.Variable(
            tf.zeros((), dtype),
            trainable=False,
            name=name,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )

    @staticmethod
    def _sum_variable(initial: tf.Tensor, name: str) -> tf.Variable:
        return tf.Variable(
            initial,
            trainable=False,
            name=name,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )

    def build_accumulators(self, variables: Sequence[Any]) -> None:
        """Creates one local (per-replica) accumulator per variable, for ``k > 1``."""
        missing = [v for v in variables if id(v) not in self._accumulators]
        if not missing:
            return
        with self.strategy.scope(), tf.init_scope():
            for variable in missing:
                dtype = tf.as_dtype(variable.dtype)
                self._accumulators[id(variable)] = self._sum_variable(
                    tf.zeros(variable.shape, dtype), "grad_accum"
                )

    def checkpointed(self) -> tf.train.Checkpoint:
        """The state a checkpoint must hold: gradients accumulated so far and their count."""
        return tf.train.Checkpoint(
            micro_batches=self._micro_batches,
            count=self._count,
            accumulators=self.accumulators,
        )

    def pending_micro_batches(self) -> int:
        """Micro-batches accumulated towards the next update (0 between updates)."""
        return int(self._micro_batches.numpy()) % self.accumulation_steps

    @property
    def accumulators(self) -> list[tf.Variable]:
        """The gradient accumulators created so far (empty for ``k == 1``)."""
        return list(self._accumulators.values())

    # -- apply ---------------------------------------------------------------------------
    def scale_loss(self, loss: Any) -> Any:
        """The optimizer's ``scale_loss`` (Keras's ``train_step`` calls it on every loss; a
        ``LossScaleOptimizer`` scales there) in a tfscale step over N replicas: for a loss
        scale, the scaled per-replica mean divided by N; for a float8 model, divided by the
        batch's examples over the replica's (exact on uneven splits too).

        Each replica's loss is the mean over its own B/N examples (tfscale weighs replicas by
        example count after the backward pass), so its backward pass would carry N times the
        values one device's does over B examples: in float16 it would overflow the dynamic
        scale where one device does not, and a float8 layer would quantize other gradients
        than one device's (their amax history N times one device's, the values below
        float8's range different). Divided so, it carries one device's magnitudes;
        ``apply`` weighs the gradients back (``StepContext.update_weight``).
        """
        scaled = self._original_scale_loss(loss)
        step = _current()
        context = tf.distribute.get_replica_context()
        if step is None and self.loop_step is not None and scaled is not loss:
            record_scaled(scaled, loss)  # a custom loop: its convention is the loss's
        if step is None or step.count is None or context is None:
            return scaled
        step.scaled = True
        if not self._magnitudes_matter():
            return scaled
        replicas = context.num_replicas_in_sync
        if replicas == 1:
            return scaled
        ratio = None
        if not isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            # float8: divided by the batch's examples over the replica's, one device's
            # magnitudes on an uneven split too (the amax is a maximum: an N-th is not).
            ratio = internals.batch_examples_ratio()
        if ratio is None:
            step.loss_share = replicas
            return scaled / tf.cast(replicas, scaled.dtype)
        step.weight = step.count * tf.cast(ratio, tf.float32)
        return scaled * tf.math.divide_no_nan(
            tf.ones((), scaled.dtype), tf.cast(ratio, scaled.dtype)
        )

    def _magnitudes_matter(self) -> bool:
        """Whether the backward pass must carry one device's magnitudes: under a loss scale,
        or where a layer quantizes its gradients to float8 (its variables Keras overwrites)."""
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            return True
        if not self.optimizer.built:
            return False
        return _quantizes(internals.optimizer_trainable_variables(self.optimizer))

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> Any:
        """The optimizer's ``apply`` (see the module docstring)."""
        if xla.defer(self, grads, trainable_variables):
            return None  # traced inside a step compiled with XLA: applied after it (xla.py)
        context = tf.distribute.get_replica_context()
        if context is None:
            if self.sharded is not None:
                raise TrainingError(
                    explain(
                        "An optimizer with sharded state updates inside the replicas' step; "
                        "it was called outside strategy.run.",
                        received="optimizer.apply_gradients(...) in cross-replica context",
                        fix="call it inside strategy.run(step, ...), or prepare without "
                        "shard_optimizer_state",
                    )
                )
            # Cross-replica context (an eager call outside strategy.run): Keras's own path.
            return self._original_apply([_rows_summed(g) for g in grads], trainable_variables)
        running = tf.distribute.get_strategy()
        if tf.distribute.has_strategy() and running is not self.strategy:
            raise TrainingError(
                explain(
                    "This optimizer was prepared for another strategy than the one running "
                    "the step (its update would mix the two: TensorFlow fails with a bare "
                    "AssertionError or 'Mixing different tf.distribute.Strategy objects').",
                    received=f"prepared for {type(self.strategy).__name__} "
                    f"{id(self.strategy):#x}, run by {type(running).__name__} {id(running):#x}",
                    fix="pass the strategy whose run() calls the step: "
                    "tfscale.prepare_loop(model, optimizer, strategy) (without it, a model "
                    "made outside any scope gets tfscale.choose_strategy()'s own), or call it "
                    "inside `with strategy.scope():`.",
                )
            )
        if context.num_replicas_in_sync > 1:
            _refuse_clipped_per_replica(grads)
        if trainable_variables is None:
            variables = internals.optimizer_trainable_variables(self.optimizer)
        else:
            variables = list(trainable_variables)
        grads = list(grads)
        if not self.optimizer.built:
            self._build_lazily(variables)
        step = _current()
        if step is not None and step.count is not None and context.num_replicas_in_sync > 1:
            # tfscale's own step (a fit's): a custom loop's loss carries its own convention.
            _refuse_unscaled_float8(step, variables)
        if step is None and self.loop_step is not None:
            # A custom loop prepared by tfscale.prepare_loop: the weighting its loss calls for.
            step = self.loop_step(self, variables)
        if step is not None:
            step.applied += 1
        replicas = context.num_replicas_in_sync
        if step is not None and step.count is not None:
            count = tf.cast(step.count, tf.float32)
        else:
            count = tf.constant(1.0 / replicas)  # Keras's losses are already divided by N
        # Each gradient is weighted by its examples; where scale_loss divided this replica's
        # loss by N, by N times as many (the example total stays the count).
        weight = step.update_weight(count) if step is not None else count
        reduce = replicas > 1 and (step is None or step.all_reduce)
        kept = [i for i, v in enumerate(variables) if _overwritten(v)]
        if self.accumulation_steps == 1:
            if not reduce and (step is None or step.count is None):
                return self._finish(grads, variables)
            weighted = [_weighted_or_kept(g, weight, i in kept) for i, g in enumerate(grads)]
            return self._reduce_and_finish(weighted, count, variables, reduce, kept)
        return self._accumulate(grads, count, weight, variables, reduce, kept)

    def _reduce_and_finish(
        self,
        weighted: list[Any],
        count: tf.Tensor,
        variables: list[Any],
        reduce: bool,
        kept: Sequence[int],
    ) -> None:
        values = [None if i in kept else g for i, g in enumerate(weighted)]
        values.append(count)
        if reduce:
            self.all_reduce_traces += 1
            options = self._step_options()
            values = all_reduce_packed(
                values,
                tf.distribute.get_replica_context(),
                bucket_bytes=None if options is None else options.bucket_bytes,
                compression=None if options is None else options.gradient_compression,
                keep=[len(values) - 1],  # the example count stays float32
            )
            self.all_reduce_runs.assign_add(1)
        *reduced, total = values
        grads = [
            _replicas_max(weighted[i], reduce)
            if i in kept
            else (None if g is None else _divided(g, total))
            for i, g in enumerate(reduced)
        ]
        self._finish(grads, variables)

    def _accumulate(
        self,
        grads: list[Any],
        count: tf.Tensor,
        weight: tf.Tensor,
        variables: list[Any],
        reduce: bool,
        kept: Sequence[int],
    ) -> None:
        if kept:
            raise TrainingError(
                explain(
                    "accumulation_steps > 1 cannot accumulate variables that Keras overwrites "
                    "with their gradient (overwrite_with_gradient, float8 training).",
                    received=[variables[i].path for i in kept],
                    fix="train with accumulation_steps=1.",
                )
            )
        touched = [(g, v) for g, v in zip(grads, variables, strict=True) if g is not None]
        missing = [v for _, v in touched if id(v) not in self._accumulators]
        if missing:
            raise TrainingError(
                explain(
                    "The optimizer was asked to update variables it has no gradient "
                    "accumulator for.",
                    received=[v.path for v in missing][:5],
                    fix="call tfscale.prepare(model, accumulation_steps=k) after the model and "
                    "its optimizer are built, or let tfscale.fit build them.",
                )
            )
        for gradient, variable in touched:
            self._accumulators[id(variable)].assign_add(
                tf.convert_to_tensor(_weighted(gradient, weight))
            )
        self._count.assign_add(count)
        self._micro_batches.assign_add(1)
        due = tf.equal(self._micro_batches.read_value() % self.accumulation_steps, 0)

        def update() -> None:
            values = [tf.identity(self._accumulators[id(v)].read_value()) for _, v in touched]
            total = tf.identity(self._count.read_value())
            with tf.control_dependencies([*values, total]):
                for _, variable in touched:
                    accumulator = self._accumulators[id(variable)]
                    accumulator.assign(tf.zeros_like(accumulator))
                self._count.assign(tf.zeros_like(total))
            self._reduce_and_finish(values, total, [v for _, v in touched], reduce, ())

        self._branch(due, update, lambda: None)

    def _step_options(self) -> Any:
        """The tracing step function's options (see :class:`StepContext`), else the last
        ``prepare``'s (None: defaults)."""
        step = _current()
        return self.options if step is None or step.options is None else step.options

    def _own_all_reduce_off(self) -> None:
        """The gradient reaching the user's optimizer is reduced: every optimizer it wraps
        (``adopt.wrapped_optimizers``) applies it as given, on this update's strategy.

        Run again at each update's trace: a ``MultiOptimizer`` whose map is a function makes
        its optimizers when it is built, and each would sum the reduced gradient over the
        replicas once more (N times one device's update, silently).
        """
        for each in wrapped_optimizers(self.optimizer):
            internals.disable_builtin_all_reduce(each)
            internals.set_optimizer_strategy(each, self.strategy)

    def _finish(self, grads: list[Any], variables: list[Any]) -> None:
        """Clips the reduced gradient, then applies it if finite (identical on every replica).

        Every update reaches the optimizer here (``tfscale.fit``, ``prepare``, custom loops,
        workers, XLA's deferred apply), with each sparse gradient's duplicate rows summed.
        """
        self._own_all_reduce_off()
        grads = [_rows_summed(g) for g in grads]
        options = self._step_options()
        clipnorm = None if options is None else options.global_clipnorm
        if clipnorm is not None:
            threshold = tf.constant(clipnorm, tf.float32)
            if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
                # Still scaled by the loss scale here: clip at the scaled norm.
                threshold = threshold * tf.cast(self.optimizer.dynamic_scale, tf.float32)
            # A value Keras writes into its variable (float8's scales and amax histories) is
            # no gradient: left out of the norm and unclipped, as Keras's own apply does.
            dense = [
                i for i, g in enumerate(grads) if g is not None and not _overwritten(variables[i])
            ]
            clipped, _ = tf.clip_by_global_norm([grads[i] for i in dense], threshold)
            for i, g in zip(dense, clipped, strict=True):
                grads[i] = g
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            # It tests finiteness (now of the sum), skips and rescales itself.
            self._original_apply(grads, variables)
            return
        present = [i for i, g in enumerate(grads) if g is not None]

        def apply(*given: Any) -> None:
            full: list[Any] = [None] * len(grads)
            for i, g in zip(present, given, strict=True):
                full[i] = g
            if self.sharded is not None:
                self.sharded.apply(full, variables)  # each replica updates its shard
            else:
                self._original_apply(full, variables)

        def skip() -> None:
            self.skipped.assign_add(1)
            self.halted.assign(self.halt_on_nonfinite)

        go = tf.logical_and(_all_finite(grads), tf.equal(self.halted, 0))
        self._branch(go, apply, skip, [grads[i] for i in present])

    def _branch(
        self,
        predicate: tf.Tensor,
        yes: Callable[..., None],
        no: Callable[[], None],
        args: Sequence[Any] = (),
    ) -> None:
        """``tf.cond(predicate, lambda: yes(*args), no)`` for replica code whose branches call
        the optimizer.

        ``predicate`` must be the same on every replica (computed from reduced values or from
        counters every replica advances alike). ``args`` are this replica's tensors; ``yes``
        must take its per-replica values from them, not from its closure, because under
        MirroredStrategy the branch is built once, in cross-replica context, for all replicas.
        """
        if internals.strategy_supports_no_merge_call():
            tf.cond(predicate, _no_outputs(lambda: yes(*args)), _no_outputs(no))
            return

        def merged(distribution: tf.distribute.Strategy, flag: Any, *values: Any) -> None:
            first = distribution.experimental_local_results(flag)[0]

            def each() -> None:
                distribution.extended.call_for_each_replica(yes, args=tuple(values))

            tf.cond(first, _no_outputs(each), _no_outputs(no))

        tf.distribute.get_replica_context().merge_call(merged, args=(predicate, *args))


# The name scopes tf.clip_by_global_norm, tf.clip_by_norm and tf.clip_by_value (keras.ops.clip's)
# give the ops they create; TensorFlow uniquifies a repeated one with "_1", "_2", ...
_CLIP_SCOPE = re.compile(r"clip_by_(global_norm|norm|value)(_\d+)?")


def _refuse_clipped_per_replica(grads: Sequence[Any]) -> None:
    """Refuses gradients the replica's own code clipped before handing them to the optimizer.

    Each replica's gradient is its share of the batch's; clipping shares and then summing
    them is not clipping the sum, which is what one device does (the loop's update differs,
    silently: 0.77 relative difference on a small regression). The gradients come from a
    traced step, so each one's op says whether a clipping function made it; a gradient
    straight from ``tape.gradient`` is named under ``gradient_tape/`` (whatever clipping its
    forward pass did), and eager steps (no op names) and XLA's compiled steps are not checked.
    """
    for gradient in grads:
        try:
            name = str(getattr(gradient, "values", gradient).op.name)
        except (AttributeError, ValueError):
            continue  # None, an eager tensor, a Python number
        parts = name.split("/")
        clip = next((p for p in parts if _CLIP_SCOPE.fullmatch(p)), None)
        if "gradient_tape" in parts or clip is None:
            continue
        function = "tf." + clip.rstrip("_0123456789")
        raise TrainingError(
            explain(
                f"The step clips each replica's gradient ({function}) before the optimizer "
                "sums them over the replicas; one device clips the whole batch's gradient, so "
                "the update would differ from it, silently.",
                received=f"a gradient made by {name!r}",
                allowed="gradients as tape.gradient returns them (scaled, cast or summed: "
                "fine), with the clipping left to the optimizer or to tfscale, which clip "
                "the summed gradient",
                fix="remove the clip and set it on the optimizer, e.g. "
                "keras.optimizers.Adam(..., global_clipnorm=1.0), or pass "
                "global_clipnorm=1.0 to tfscale.prepare_loop / tfscale.fit",
            )
        )


def _refuse_ema_overwrite(optimizer: Any, strategy: tf.distribute.Strategy) -> None:
    """Refuses ``use_ema=True`` with ``ema_overwrite_frequency`` where Keras cannot run it.

    Keras overwrites the weights with their average inside a ``cond`` of each replica's
    ``apply``, through ``strategy.extended.update``: under MirroredStrategy (its replica
    threads need ``merge_call``) the first step fails with "`merge_call` called while
    defining a new graph", in Keras's own ``model.fit`` too. The average itself works: ``fit``
    writes it into the weights at its end (``finalize_variable_values``).
    """
    if not isinstance(strategy, tf.distribute.MirroredStrategy):
        return  # OneDevice runs it; MultiWorkerMirrored needs no merge_call (untested)
    for each in wrapped_optimizers(optimizer):
        every = getattr(each, "ema_overwrite_frequency", None)
        if getattr(each, "use_ema", False) and every:
            raise TrainingError(
                explain(
                    f"{type(each).__name__}(use_ema=True, ema_overwrite_frequency={every}) "
                    f"cannot run under {type(strategy).__name__}: Keras overwrites the "
                    "weights with their moving average inside each replica's update, where "
                    "this strategy cannot synchronize, and the first step fails (Keras's own "
                    "model.fit too).",
                    received=f"ema_overwrite_frequency={every}",
                    allowed="use_ema=True without ema_overwrite_frequency: the average is "
                    "kept during training and written into the weights when fit ends "
                    "(keras.callbacks.SwapEMAWeights evaluates with it on the way)",
                    fix=f"{type(each).__name__}(..., use_ema=True)  # no ema_overwrite_frequency",
                )
            )


def _no_outputs(function: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        function()

    return run


def _overwritten(variable: Any) -> bool:
    return bool(getattr(variable, "overwrite_with_gradient", False))


def _quantizes(variables: Sequence[Any]) -> bool:
    """Whether a layer owning some of ``variables`` quantizes to float8: Keras overwrites
    its scales and amax histories with their "gradient"."""
    return any(_overwritten(v) for v in variables)


def _refuse_unscaled_float8(step: StepContext, variables: Sequence[Any]) -> None:
    """A float8 model's step over N replicas whose backward pass cannot carry one device's
    magnitudes: refused as it is traced, before its first update.

    A float8 layer quantizes the gradient its backward pass receives with the scale of its
    amax history, so each replica's gradients must have one device's magnitudes, which
    ``scale_loss`` gives them (the loss divided by the batch's examples over the replica's).
    A ``train_step`` that takes the gradient of a loss it never passed through
    ``scale_loss`` (Keras's float8 on one device does not need it: a no-op there) quantizes
    N times one device's values, and a loss over rows gathered from every replica
    (``tfscale.gather_batch``, ``global_load_balancing``) sends back gradients of other
    magnitudes still: measured on 2 replicas, weights 0.06 and 0.7-1.8 from one device's,
    the scales and histories up to 2x.
    """
    if not _quantizes(variables):
        return
    if step.gathered:
        raise TrainingError(
            explain(
                "This model quantizes to float8 and its loss gathers rows over the replicas "
                "(tfscale.gather_batch or global_load_balancing): the gradients its float8 "
                "layers quantize would not have one device's magnitudes, so its weights, "
                "scales and amax histories would differ from one device's.",
                received="a float8 layer (overwrite_with_gradient variables) and a gather "
                "with a gradient in the same train step",
                fix="train the float8 model without the gather (each replica's own loss), "
                "or train this loss without float8 quantization (model.quantize).",
            )
        )
    if not step.scaled:
        raise TrainingError(
            explain(
                "This model quantizes to float8 and its train_step takes the gradient of a "
                "loss it never passed through self.optimizer.scale_loss: over several "
                "replicas tfscale divides each replica's loss there so that the float8 "
                "layers quantize one device's gradients; without it they quantize N times "
                "those values and the weights differ from one device's.",
                received="a float8 layer (overwrite_with_gradient variables) and a "
                "train_step without optimizer.scale_loss",
                fix="in train_step, take the gradient of self.optimizer.scale_loss(loss) "
                "(as Keras's own train_step does; a no-op on one device).",
            )
        )


def _replicas_max(value: Any, reduce: bool) -> Any:
    """The elementwise maximum of ``value`` over the replicas (``value`` where nothing is
    reduced): what a variable Keras overwrites with its "gradient" gets.

    Keras's float8 layers write their scales and amax histories this way
    (``overwrite_with_gradient``); each replica's amax is its share's, and one device's is
    the maximum over the whole batch, the maximum of the replicas'. Keras combines such
    values over accumulated micro-batches with ``ops.maximum`` too
    (``_overwrite_variables_directly_with_gradients``). Without it each replica kept its own
    history in its copy of the variable (a float8 model's kernels ended 2e-2 from one
    device's, a bias 0.2). tf.distribute has no maximum all-reduce: a gather.
    """
    context = tf.distribute.get_replica_context()
    if value is None or not reduce or context is None or context.num_replicas_in_sync == 1:
        return value
    value = tf.convert_to_tensor(value)
    gathered = internals.all_gather_without_gradient(context, tf.expand_dims(value, 0), 0)
    return tf.reduce_max(gathered, axis=0)


def _weighted_or_kept(gradient: Any, count: tf.Tensor, kept: bool) -> Any:
    if gradient is None or kept:
        return gradient
    return _weighted(gradient, count)


def distributed_update(optimizer: Any, strategy: tf.distribute.Strategy) -> DistributedUpdate:
    """The :class:`DistributedUpdate` of ``optimizer``, installed on first use.

    Raises:
        TrainingError: The optimizer was prepared for another strategy.
    """
    existing = optimizer.__dict__.get("_tfscale_update")
    if isinstance(existing, DistributedUpdate):
        if existing.strategy is not strategy:
            existing = None  # moved to another strategy: install afresh
        else:
            return existing
    update = DistributedUpdate(optimizer, strategy)
    registry.replace("model-state", optimizer, "_tfscale_update", update)
    return update
