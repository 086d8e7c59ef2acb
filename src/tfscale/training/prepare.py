"""``tfscale.prepare``: make a compiled Keras model's own ``fit`` correct on every replica.

One added line before an unchanged ``model.fit`` script::

    model = tfscale.prepare(model)            # or prepare(model, strategy, accumulation_steps=4)
    model.fit(dataset, epochs=10, callbacks=[...])

Keras keeps the loop (data adapters, epochs, callbacks, History, validation); ``prepare``
intercepts where Keras is wrong under a strategy, on this model instance only:

- its variables move into the strategy in place (``adopt.py``);
- every optimizer of the model does tfscale's distributed update (``optimizer.py``);
- ``make_train_function`` / ``make_test_function`` build tfscale's step functions
  (``function.py``), and the model's symbolic build takes one replica's batch, which is what
  breaks ``model.fit`` under MultiWorkerMirroredStrategy (keras-team/keras#20585);
- ``fit`` copies the batches of Python generators and ``keras.utils.PyDataset``s under
  several replicas, which TensorFlow otherwise writes into (``data.copied_batches``), and
  stops with ``NonFiniteLossError`` at an update it skipped as not finite, as
  ``tfscale.fit`` does (``callbacks.guarded``; ``TerminateOnNaN`` stops quietly).

``prepare`` is idempotent: a second call updates the options and keeps compiled functions
when they do not change.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, MutableMapping
from types import FrameType
from typing import Any, Protocol

import keras
import tensorflow as tf

from tfscale.errors import TfscaleError, TrainingError, explain
from tfscale.interop import internals, registry
from tfscale.interop.script_watch import call_by_name
from tfscale.training import conventions
from tfscale.training.adopt import adopt, has_call, keras_accumulation_steps, model_optimizers
from tfscale.training.batchwide import derives_from_gathered
from tfscale.training.callbacks import guarded, halt_released
from tfscale.training.checks import check_batched, check_load_balancing
from tfscale.training.data import COPIED_FIT_ARGUMENTS, FitInputs, copied_batches
from tfscale.training.function import StepFunction, example_count
from tfscale.training.loop import register_loop
from tfscale.training.modelclass import give_prepared_class, state_of
from tfscale.training.optimizer import DistributedUpdate, distributed_update
from tfscale.training.options import Decided, Entry, Options, decide, resolve_strategy
from tfscale.training.precision import Precision, apply_policy
from tfscale.training.shorthand import takes_options
from tfscale.training.turns import turn

__all__ = [
    "FitRequest",
    "Prepared",
    "prepare",
    "prepare_model",
    "prepared",
    "resolve_strategy",
]


class FitRequest(Protocol):
    """What ``tfscale.fit`` asks of the Keras-level fit it reaches (``fit.TfscaleFit``)."""

    def planned(
        self, model: Any, arguments: MutableMapping[str, Any]
    ) -> contextlib.AbstractContextManager[None]:
        """Checks and replaces Keras ``fit``'s arguments (by name) in place; the context is
        held while Keras's ``fit`` runs."""


def check_model(model: Any) -> None:
    """Refuses what tfscale cannot train, before anything is changed.

    Raises:
        TrainingError: Not a Keras model, not compiled, or an optimizer with Keras's own
            ``gradient_accumulation_steps``.
    """
    if not isinstance(model, keras.Model):
        raise TrainingError(
            explain(
                "tfscale trains Keras models.",
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
                fix="compile it first:\n"
                '        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")',
            )
        )
    for optimizer in model_optimizers(model):
        steps = keras_accumulation_steps(optimizer)
        if steps:
            raise TrainingError(
                explain(
                    "The optimizer has Keras's gradient_accumulation_steps set; under "
                    "MirroredStrategy it fails with a merge_call RuntimeError and it "
                    "all-reduces every micro-batch.",
                    received=f"gradient_accumulation_steps={steps}",
                    fix="remove it from the optimizer and pass "
                    f"tfscale.fit(..., accumulation_steps={steps}) "
                    f"(or tfscale.prepare(model, accumulation_steps={steps}))",
                )
            )


def _drop_loop_locals(error: BaseException) -> None:
    """Clears the locals of the finished frames an error raised in ``fit`` keeps alive.

    Keras's ``fit`` frame holds the epoch iterator. Its traceback filter
    (``keras.src.utils.traceback_utils``) drops Keras's frames from the traceback, but the
    frames kept there still reach them through ``f_back``. While the error lives (caught and
    kept, or in a reference cycle with the frame that caught it), the iterator would outlive
    its release in the background and be destroyed later, wherever the garbage collector
    runs, on whatever thread that is. Destroying an old iterator can hold that thread up to
    60 s: it waits for tf.data's autotuning thread, which can miss the wake-up and sleep out
    its period (docs/training.md, "Releasing tf.data iterators off your thread"). Only
    tfscale's own errors are cleared: they say what went wrong without those locals; another
    exception keeps its frames for the user's debugger.
    """
    traceback = error.__traceback__
    while traceback is not None:
        frame: FrameType | None = traceback.tb_frame
        while frame is not None:
            try:
                frame.clear()
            except RuntimeError:  # still executing: so are the frames it returns to
                break
            # clear() empties the frame's own slots, not a dict of its locals that something
            # made by reading f_locals (CPython 3.11's frame_tp_clear): reading it again
            # syncs that dict with the cleared frame, which drops its references.
            frame.f_locals  # noqa: B018
            frame = frame.f_back
        traceback = traceback.tb_next


class Prepared:
    """The tfscale state of one prepared model (``model.__dict__["_tfscale"]``).

    Attributes:
        model: The model.
        strategy: The strategy it trains under.
        options: Its :class:`~tfscale.training.options.Decided` options.
    """

    def __init__(self, model: Any, strategy: tf.distribute.Strategy, options: Decided) -> None:
        self.model = model
        self.strategy = strategy
        self.options = options
        self.record_timings = False
        self.epoch_iterator: weakref.ref[Any] | None = None
        # The running fit's epoch iterators and the iterators they make, held so that they
        # are destroyed off the caller's thread (data.FitInputs); None outside fit.
        self._fit_input: FitInputs | None = None
        # What tfscale.fit asks of the next Keras-level fit of this model (the model's own
        # fit runs in between: KerasHub's preprocesses there); taken by that fit.
        self.request: FitRequest | None = None
        give_prepared_class(model, self)

    # -- state ---------------------------------------------------------------------------
    def updates(self) -> list[DistributedUpdate]:
        """The distributed update of every optimizer of the model (installed if missing)."""
        out = []
        for optimizer in model_optimizers(self.model):
            update = distributed_update(optimizer, self.strategy)
            update.accumulation_steps = self.options.accumulation_steps
            update.options = self.options
            if self.options.shard_optimizer_state:
                update.shard_state()
            out.append(update)
        return out

    def ready(self) -> None:
        """Moves anything created since (a recompile's metrics and optimizer) into the
        strategy and gives every optimizer its update and accumulators."""
        adopt(self.model, self.strategy)
        for update in self.updates():
            if self.options.accumulation_steps > 1 and update.optimizer.built:
                update.build_accumulators(internals.optimizer_trainable_variables(update.optimizer))

    def time_steps(self, enabled: bool) -> None:
        """Times each call of the train function, fetch apart from steps (profiling)."""
        self.record_timings = enabled
        if isinstance(self.model.train_function, StepFunction):
            self.model.train_function.record_timings = enabled

    @property
    def update(self) -> DistributedUpdate:
        """The distributed update of ``model.optimizer``."""
        return distributed_update(self.model.optimizer, self.strategy)

    # -- what Keras calls ----------------------------------------------------------------
    def keras_fit(
        self, own: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Keras's ``fit`` (``own``), as the model's own ``fit`` calls it, with tfscale's input
        handling: ``tfscale.fit``'s request, if one is pending (checks, per-epoch order,
        sharding, steps per call: ``fit.FitRequest``), the training and validation batches of
        generators and PyDatasets copied (see :func:`tfscale.training.data.copied_batches`),
        and a non-finite update stopping it with ``NonFiniteLossError`` as under
        ``tfscale.fit`` (``callbacks.guarded``; Keras's ``TerminateOnNaN`` among the
        callbacks stops quietly instead)."""
        request, self.request = self.request, None

        def change(arguments: dict[str, Any]) -> None:
            check_batched(
                self.model, x=arguments.get("x"), validation_data=arguments.get("validation_data")
            )
            if request is not None and arguments:
                around.enter_context(request.planned(self.model, arguments))
            for name in COPIED_FIT_ARGUMENTS:
                if name in arguments:
                    arguments[name] = copied_batches(arguments[name], self.strategy)
            if arguments:
                arguments["callbacks"] = guarded(arguments.get("callbacks"), self.model, update)

        update = self.update
        with turn(self.strategy):  # one fit at a time per strategy's devices (turns.py)
            self.epoch_iterator = None  # the first symbolic build of this fit sets it
            outer, self._fit_input = self._fit_input, FitInputs()
            try:
                with halt_released(update), contextlib.ExitStack() as around:
                    return call_by_name(own, self.model, args, kwargs, change)
            except TfscaleError as error:
                _drop_loop_locals(error)
                raise
            finally:
                held, self._fit_input = self._fit_input, outer
                if held is not None:
                    held.release()

    def compute_loss(
        self, own: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The model's own ``compute_loss`` (``own``), 0 on a replica with no examples.

        A short last batch leaves replicas without examples (2 examples on 4 replicas: 1, 1,
        0, 0). A loss that averages by itself (``tf.reduce_mean`` in a custom loss) is NaN
        there (0 / 0), and Keras's loss tracker, which weighs each replica's loss by its
        examples, turns NaN * 0 into a NaN loss for the epoch: Keras's ``model.fit`` reports
        it, and tfscale's non-finite guard would stop training over an update that was
        right (that replica's gradient weighs 0: ``optimizer._weighted``).
        """
        loss = own(*args, **kwargs)
        x, y, sample_weight = _loss_data(args, kwargs)
        if loss is None or x is None:
            return loss
        if getattr(loss, "shape", None) is not None and loss.shape.rank:
            # Unreduced (a compiled Loss with reduction=None): its gradient is the sum over
            # the replica's examples, one device's the batch's sum (as reduction="sum").
            # Keras's loss tracker averages its elements: their values stay as they are.
            scaled = _share_made_the_batchs(loss, loss, x)
            if scaled is not loss:  # in tfscale's step (a custom loop reads the vector itself)
                loss = tf.stop_gradient(loss) + (scaled - tf.stop_gradient(scaled))
        else:
            loss = _sums_made_the_batchs(loss, (x, y, sample_weight), x)
        guarded = tf.where(example_count((x,)) > 0, loss, tf.zeros_like(loss))
        # A custom loop over the prepared model reads its loss's kind through this (loop.py).
        conventions.record_scaled(guarded, loss)
        return guarded

    def get_metrics_result(self, own: Callable[[], Any]) -> Any:
        """The model's own ``get_metrics_result`` (``own``), each value a tensor.

        A metric whose ``result()`` is one of its own variables (keras-io's ``TruePositives``
        returns ``self.count``) gives Keras's epoch-end logs that variable; under a strategy
        it is per replica, and Keras 3.10 cannot turn it into a number (``float()`` of a
        ``SyncOnReadVariable``), so History kept the variable. Read here, in cross-replica
        context, it is the sum over replicas, as one device's count.
        """
        results = own()
        return tf.nest.map_structure(tf.convert_to_tensor, results)

    def make_function(self, kind: str, force: bool) -> Any:
        """Keras's ``make_train_function`` / ``make_test_function``: tfscale's
        :class:`StepFunction` for ``kind`` ("train", "test"), made anew where stale."""
        name = f"{kind}_function"
        current = getattr(self.model, name, None)
        stale = (
            not isinstance(current, StepFunction)
            or current.steps_per_execution != int(self.model.steps_per_execution)
            or current.options != self.options
        )
        if current is None or force or stale:
            self.ready()
            current = StepFunction(self.model, kind, self.options)  # type: ignore[arg-type]
            current.record_timings = self.record_timings and kind == "train"
            registry.replace("compiled-functions", self.model, name, current)
        return current

    def symbolic_build(self, iterator: Any = None, data_batch: Any = None) -> None:
        """Keras's ``_maybe_symbolic_build``, from the input's element spec (see the module
        doc): no batch is read, so a Python generator loses none (Keras's own build reads
        one from it, and its fit under a strategy then trains without that batch)."""
        model = self.model
        if self.epoch_iterator is None and iterator is not None:
            # The fit's training epoch iterator (built before any evaluate's), for the
            # checkpoint's resumed epoch (checkpoint.py).
            self.epoch_iterator = weakref.ref(iterator)
        if self._fit_input is not None and iterator is not None:
            # Training's and validation's (Keras's evaluate builds with it every epoch).
            self._fit_input.watch(iterator)
        unbuilt = (
            not all(layer.built for layer in internals.flatten_layers(model))
            or (model.optimizer is not None and not model.optimizer.built)
            or any(not getattr(m, "built", True) for m in model.metrics)
        )
        if unbuilt and not has_call(model):
            # keras-io's GAN and VAE: a model that only overrides train_step has no call to
            # build it from. Keras's own fit under a strategy fails here ("Unable to
            # automatically build the model"); on one device it builds nothing ahead and the
            # first step creates what it needs. So does this one: its optimizers are built
            # at their first apply (optimizer.py), its sub-models must be built already.
            unbuilt_layers = [
                layer.name
                for layer in internals.flatten_layers(model, include_self=False)
                if not layer.built
            ]
            if unbuilt_layers:
                raise TrainingError(
                    explain(
                        f"Model {model.name!r} has no call() (its train_step drives its "
                        "sub-models), so tfscale cannot build it from the data, and these "
                        "layers are not built yet.",
                        received=unbuilt_layers[:5],
                        fix="build its sub-models before fit: give each an Input "
                        "(keras.Sequential([keras.Input(shape), ...])) or call "
                        "sub_model.build(input_shape).",
                    )
                )
            self.ready()
            return
        if unbuilt:
            if data_batch is None and iterator is not None:
                data_batch = self._spec_of(iterator)
            with self.strategy.scope():
                internals.symbolic_build(model, data_batch)
        self.ready()

    def _spec_of(self, iterator: Any) -> Any:
        """One replica's batch structure (``tf.TensorSpec``s) of Keras's epoch iterator."""
        spec = internals.epoch_iterator_dataset(iterator).element_spec
        # TypeSpecs (PerReplicaSpec included) are leaves of tf.nest without expand_composites.
        return tf.nest.map_structure(self._first_replica_spec, spec)

    @staticmethod
    def _first_replica_spec(spec: Any) -> Any:
        # A distributed dataset's spec is a PerReplicaSpec (its components, one per local
        # replica); a plain dataset's a TensorSpec.
        components = internals.per_replica_component_specs(spec)
        return components[0] if components else spec


def prepared(model: Any) -> Prepared | None:
    """The model's :class:`Prepared` state, or None if it was never prepared."""
    state = state_of(model)
    return state if isinstance(state, Prepared) else None


@takes_options(Entry.PREPARE)
def prepare(
    model: Any,
    strategy: tf.distribute.Strategy | None = None,
    *,
    options: Options,
) -> Any:
    """Makes a compiled model's ``fit`` / ``evaluate`` correct and complete on every replica.

    Args:
        model: A compiled Keras model, built inside or outside the strategy's scope.
        strategy: The strategy; None takes the current scope's, the model's own, or
            ``tfscale.choose_strategy()``.

    Returns:
        The same model object.

    Raises:
        TrainingError: The model cannot be trained this way (the message says why and how);
            also a ``ValueError``, as Keras's argument errors.
    """
    state = prepare_model(model, strategy, options)
    for update in state.updates():
        register_loop(model, update)  # the same update in a custom loop (training/loop.py)
    return model


def prepare_model(
    model: Any, strategy: tf.distribute.Strategy | None, options: Options
) -> Prepared:
    """:func:`prepare` without the custom-loop side: ``tfscale.fit`` trains through Keras's
    ``fit`` only, so it holds no watch on the user's tapes (``training/loop.py``).

    Args:
        model: The compiled model.
        strategy: The strategy, or None (:func:`resolve_strategy`).
        options: The checked options of an entry that honours all of them.
    """
    check_model(model)
    strategy = resolve_strategy(model, strategy)
    own_check = getattr(model, "check_strategy", None)  # a model placed over devices by hand
    if callable(own_check):
        own_check(strategy)
    decided = decide(options, compiled_jit=bool(model.jit_compile))
    check_load_balancing(decided.global_load_balancing, decided.jit_compile)
    state = prepared(model)
    if state is None or state.strategy is not strategy:
        state = Prepared(model, strategy, decided)
        for name in ("train_function", "test_function", "predict_function"):
            registry.replace("compiled-functions", model, name, None)
    elif state.options != decided:
        state.options = decided
    adopt(model, strategy)
    _apply_precision(model, strategy, decided.precision)
    if decided.sync_batchnorm:
        for layer in internals.flatten_layers(model):
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.synchronized = True
    state.ready()
    return state


def _apply_precision(model: Any, strategy: tf.distribute.Strategy, precision: Precision) -> None:
    apply_policy(model, precision)
    if precision.loss_scaling and not isinstance(
        model.optimizer, keras.optimizers.LossScaleOptimizer
    ):
        # What compile() does under a mixed_float16 policy (auto_scale_loss).
        with strategy.scope():
            scaled = keras.optimizers.LossScaleOptimizer(model.optimizer)
            if model.optimizer.built:
                scaled.build(internals.optimizer_trainable_variables(model.optimizer))
        model.optimizer = scaled


def _loss_data(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``compute_loss``'s ``x``, ``y`` and ``sample_weight``, as Keras passes them (by name in
    Keras's own steps, by position in some overrides)."""
    names = ("x", "y", "y_pred", "sample_weight")
    given = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    return given.get("x"), given.get("y"), given.get("sample_weight")


def _sums_made_the_batchs(loss: Any, data: Any, x: Any) -> Any:
    """``loss``, the scalar ``compute_loss`` returned, with each of its terms that sums over
    the replica's examples (``conventions.sums_over_examples``: a ``compute_loss`` override's
    ``keras.ops.sum``, Keras's own sum of an ``add_loss`` of per-example values) made the
    batch's sum as tfscale weighs it (``internals.as_batch_sum``): the gradient and the
    reported loss are one device's, as for a compiled ``Loss`` with ``reduction="sum"``.
    Other terms stay per-replica means."""
    for found, factor in conventions.sums_over_examples(loss, data):
        summed = tf.cast(found, loss.dtype)
        scaled = _share_made_the_batchs(summed, found.op.inputs[0], x)  # found: a Sum
        if scaled is summed:
            return loss  # outside tfscale's step (a custom loop reads the loss itself)
        loss = loss + tf.cast(factor, loss.dtype) * (scaled - summed)
    return loss


def _share_made_the_batchs(value: Any, rows: Any, x: Any) -> Any:
    """``internals.as_batch_sum(value)``: ``value``, a sum over ``rows`` (a tensor holding
    values per example), made the batch's as tfscale weighs it; ``value`` itself outside
    tfscale's step.

    Rows computed from rows gathered over the replicas (``tfscale.gather_batch``) may be
    the whole batch's, every replica's alike, whose sum is one device's already: those are
    left as they are where they are not as many as the replica's examples (a loss over
    the gathered batch), and made the batch's where they are (a replica's own examples
    compared with the gathered ones, CLIP's local loss)."""
    scaled = internals.as_batch_sum(value)
    if scaled is value or not derives_from_gathered(rows):
        return scaled
    share = tf.equal(tf.cast(tf.shape(rows)[0], tf.float32), example_count((x,)))
    return tf.where(share, scaled, value)
