"""Sharded optimizer state (ZeRO stage 1) on TensorFlow's own collectives.

Under data parallelism every replica holds the whole optimizer state: Adam in float32 keeps
8 bytes of moments per parameter on every device. With ``shard_optimizer_state=True`` each
optimizer slot lives once, cut into one flat shard per replica (``[g*s, (g+1)*s)`` of the
flattened slot, ``s = ceil(n / R)``, the last shard padded with zeros), each shard a plain
``tf.Variable`` on its replica's device. Per update, in each replica (the gradient already
all-reduced, clipped and found finite by :class:`~tfscale.training.optimizer.DistributedUpdate`)::

    g_shard = flat(g)[g*s:(g+1)*s]             the reduce-scatter, as all-reduce + slice
    w_shard = flat(w)[g*s:(g+1)*s]             from the replica's own copy of the weight
    weight decay, then optimizer.update_step(g_shard, w_shard, lr)   on the shard's slots
    w = all_gather(w_shards)[:n]               ReplicaContext.all_gather: one per dtype
    optimizer.iterations += 1                  the schedule and bias corrections as unsharded

Why all-reduce + slice: tf.distribute has no reduce-scatter (TensorFlow 2.21:
``ReplicaContext`` offers ``all_reduce``, ``all_gather`` and ``merge_call``; ``CrossDeviceOps``
``reduce``, ``batch_reduce`` and ``broadcast``; ``Strategy`` ``reduce`` and ``gather``). The
raw op ``tf.raw_ops.CollectiveReduceScatterV2`` exists, but no strategy calls it (nothing in
``tensorflow/python/distribute`` does) and it needs the strategy's private group and instance
keys, which tfscale does not write collectives with. Stage 1 promises less optimizer *state*, which
this keeps; the gradient's communication stays one all-reduce, and the clip and the
finiteness test need the whole reduced gradient anyway. The weights are gathered back with a
real all-gather (one per dtype, every variable's shard packed); under MirroredStrategy with
``NcclAllReduce`` or ``HierarchicalCopyAllReduce`` TensorFlow 2.21 runs that all-gather as a
gather on one device and a broadcast, with a warning
(``AllReduceCrossDeviceOps._gather_implementation``), not yet measured on GPUs here.

The update rule is the user's optimizer class's own ``update_step``: each local replica has
an *inner* optimizer of the same class and config (``from_config(get_config())``), built on
that replica's shard variables outside every strategy (so its slots are plain variables on
the replica's device with the shard's shape). Whatever the optimizer does besides
``update_step`` is done here once, from the user's optimizer: its clipping
(``clipnorm`` / ``clipvalue`` / ``global_clipnorm``, on the whole gradient), the learning
rate (schedule at the shared ``iterations``), weight decay (excluded variables as Keras
decides them), constraints and the iteration count. Only optimizers whose ``update_step`` is
elementwise give the same update on a shard as on the whole variable; others are refused by
name (:func:`check_shardable`).

Checkpoints hold the *full* slots under the keys Keras's optimizer has
(``optimizer/_variables/<i>``): the optimizer's checkpoint children are replaced, not its
``variables``, so ``model.optimizer`` and a checkpoint's ``optimizer`` stay one object. Each
slot is gathered on save and cut into the restoring run's shards on restore, so a checkpoint
restores on any replica count, sharded or not.
"""

from __future__ import annotations

import math
import re
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfscale.errors import TrainingError, explain
from tfscale.interop import internals, registry

__all__ = [
    "ShardedState",
    "check_shardable",
    "shard_size",
    "sharded_state",
    "slot_bytes_per_device",
]

#: Optimizers whose ``update_step`` is elementwise (each element of the new weight and slots
#: depends only on the same element of the weight, slots and gradient), checked by
#: tests/training/test_sharded_state.py. Exact classes: a subclass may change ``update_step``.
ELEMENTWISE: tuple[type, ...] = (
    keras.optimizers.SGD,
    keras.optimizers.Adam,
    keras.optimizers.AdamW,
    keras.optimizers.Adamax,
    keras.optimizers.Adagrad,
    keras.optimizers.RMSprop,
    keras.optimizers.Nadam,
    keras.optimizers.Lion,
    keras.optimizers.Adadelta,
    keras.optimizers.Ftrl,
)

#: Why the optimizers known not to be elementwise are not.
NOT_ELEMENTWISE = {
    "Adafactor": "its second moment is factored over the rows and columns of each weight "
    "(a shard of a flattened weight has neither)",
    "Muon": "it orthogonalizes each weight's whole update matrix (Newton-Schulz iterations)",
    "Lamb": "it scales each weight's update by a trust ratio of whole-weight norms",
    "LossScaleOptimizer": "its loss-scale state and skip logic wrap another optimizer's "
    "apply (not supported with sharded state yet)",
    "MultiOptimizer": "it hands each variable to another optimizer (not supported with "
    "sharded state yet)",
}

_SHARD_NAME = re.compile(r"zero_shard_(\d+)_")


def shard_size(size: int, replicas: int) -> int:
    """The elements per shard of a variable of ``size`` elements over ``replicas``."""
    return max(1, math.ceil(size / replicas))


def check_shardable(optimizer: Any) -> None:
    """Refuses an optimizer whose update cannot run on shards of the state.

    Raises:
        TrainingError: Not one of :data:`ELEMENTWISE`, or set to do something that needs
            whole variables (EMA, Keras's own gradient accumulation), or already built.
    """
    name = type(optimizer).__name__
    fix = (
        "shard_optimizer_state=False, or one of "
        + ", ".join(c.__name__ for c in ELEMENTWISE)
        + " (elementwise updates)"
    )
    if type(optimizer) not in ELEMENTWISE:
        why = NOT_ELEMENTWISE.get(name, "its update_step is not known to be elementwise")
        raise TrainingError(
            explain(
                f"shard_optimizer_state cannot shard {name}'s state: {why}, so a shard's "
                "update would differ from the whole variable's.",
                received=f"{type(optimizer).__module__}.{name}",
                allowed=", ".join(c.__name__ for c in ELEMENTWISE),
                fix=fix,
            )
        )
    for setting, value in (
        ("use_ema", optimizer.use_ema),
        ("gradient_accumulation_steps", optimizer.gradient_accumulation_steps),
    ):
        if value:
            raise TrainingError(
                explain(
                    f"shard_optimizer_state does not support {name}({setting}=...): it keeps "
                    "or accumulates whole-variable state outside update_step.",
                    received=f"{setting}={value!r}",
                    fix=f"{name}(...) without {setting} (tfscale's accumulation_steps= "
                    "accumulates gradients)",
                )
            )
    if optimizer.built:
        raise TrainingError(
            explain(
                f"shard_optimizer_state must be set before {name} is built: its slots "
                "already exist whole on every replica.",
                received=f"{name} built on {len(optimizer.variables)} variables",
                fix="prepare (or fit) the compiled model before its optimizer is built "
                "or trained, or compile it again with a new optimizer",
            )
        )


@dataclass
class _Replica:
    """One local replica's shards: its weight shards and the inner optimizer's slots."""

    index: int  # the global replica id (its shard)
    device: str
    weights: list[tf.Variable]
    optimizer: Any


class ShardedState:
    """The sharded state of one Keras optimizer under one strategy (see the module docstring).

    Installed on the optimizer by :func:`install` before it is built: its ``build``
    then builds only Keras's base state (iterations, learning rate, the table of variables)
    and this object's shards, one set per local replica.
    """

    def __init__(self, optimizer: Any, strategy: tf.distribute.Strategy) -> None:
        check_shardable(optimizer)
        self.optimizer = optimizer
        self.strategy = strategy
        self.replicas = int(strategy.num_replicas_in_sync)
        self.variables: list[Any] = []
        self.local: list[_Replica] = []
        self.view = _CheckpointView(self)
        registry.replace("sharded-optimizer", optimizer, "build", self.build)
        internals.replace_checkpoint_children(optimizer, {"_variables": self.view.saved})
        registry.replace(
            "sharded-optimizer", optimizer, "save_own_variables", self.save_own_variables
        )
        registry.replace(
            "sharded-optimizer", optimizer, "load_own_variables", self.load_own_variables
        )

    # -- building -------------------------------------------------------------------------
    def build(self, variables: Sequence[Any]) -> None:
        """The optimizer's ``build``: Keras's base build, then one shard set per replica."""
        if self.optimizer.built:
            return
        keras.optimizers.Optimizer.build(self.optimizer, list(variables))
        self.variables = list(variables)
        ids = self.strategy.experimental_local_results(
            self.strategy.experimental_distribute_values_from_function(
                lambda context: context.replica_id_in_sync_group
            )
        )
        devices = self.strategy.extended.worker_devices
        made: list[_Replica] = []
        failed: list[BaseException] = []

        def make() -> None:
            # A thread of its own is outside every strategy scope (TensorFlow keeps the
            # scope stack per thread): the shards and the inner optimizers' slots are plain
            # variables on the device named, not mirrored on every replica.
            try:
                for index, device in zip(ids, devices, strict=True):
                    made.append(self._replica(int(index), device))
            except BaseException as error:  # re-raised in the caller's thread
                failed.append(error)

        thread = threading.Thread(target=make, name="tfscale-shards")
        thread.start()
        thread.join()
        if failed:
            raise failed[0]
        self.local = made
        self.view.track_slots()

    def _replica(self, index: int, device: str) -> _Replica:
        with tf.init_scope(), tf.device(device):
            weights = [
                tf.Variable(
                    tf.zeros([shard_size(_size(v), self.replicas)], tf.as_dtype(v.dtype)),
                    trainable=False,
                    name=f"zero_shard_{i}",
                )
                for i, v in enumerate(self.variables)
            ]
            inner = type(self.optimizer).from_config(self.optimizer.get_config())
            inner.build(weights)
        return _Replica(index, tf.DeviceSpec.from_string(device).to_string(), weights, inner)

    def slots(self, replica: _Replica) -> list[tf.Variable]:
        """A replica's inner optimizer's state, less its own iterations and learning rate."""
        return [internals.distributed_container(v) for v in replica.optimizer.variables][
            len(self.optimizer.variables) :
        ]

    # -- the update -----------------------------------------------------------------------
    def apply(self, grads: list[Any], variables: list[Any]) -> None:
        """The optimizer's update of ``variables`` by the reduced ``grads``, in replica context.

        ``grads`` are the same on every replica (all-reduced by ``DistributedUpdate``).
        """
        context = tf.distribute.get_replica_context()
        replica = self._local_replica(context)
        optimizer = self.optimizer
        pairs = [(g, v) for g, v in zip(grads, variables, strict=True) if g is not None]
        if not pairs:
            optimizer.iterations.assign_add(1)
            return
        grads = [tf.convert_to_tensor(g) for g, _ in pairs]  # IndexedSlices: their dense sum
        variables = [v for _, v in pairs]
        scale = optimizer.loss_scale_factor
        if scale is not None:
            grads = [g / scale for g in grads]
        grads = internals.optimizer_clip_gradients(optimizer, grads)
        learning_rate = optimizer.learning_rate
        inner = replica.optimizer
        inner.iterations.assign(tf.cast(optimizer.iterations, inner.iterations.dtype))
        if isinstance(inner, keras.optimizers.Nadam):
            _advance_nadam(inner)
        shards = []
        for gradient, variable in zip(grads, variables, strict=True):
            position = self._position(variable)
            shard = replica.weights[position]
            shard.assign(self.cut(variable, replica.index, _size(variable)))
            if optimizer.weight_decay is not None and internals.optimizer_uses_weight_decay(
                optimizer, variable
            ):
                decay = tf.cast(optimizer.weight_decay, shard.dtype)
                shard.assign_sub(shard * decay * tf.cast(learning_rate, shard.dtype))
            inner.update_step(
                self.cut(gradient, replica.index, _size(variable)),
                shard,
                tf.cast(learning_rate, shard.dtype),
            )
            shards.append(shard)
        full = self._gathered(context, shards, variables)
        _assign_each(self.strategy, context, variables, full)
        for variable in variables:
            if variable.constraint is not None:
                variable.assign(variable.constraint(variable))
        optimizer.iterations.assign_add(1)

    def _local_replica(self, context: tf.distribute.ReplicaContext) -> _Replica:
        index = tf.get_static_value(context.replica_id_in_sync_group)
        for replica in self.local:
            if replica.index == index:
                return replica
        raise AssertionError(f"replica {index} has no shards here ({len(self.local)} local)")

    def _position(self, variable: Any) -> int:
        key = internals.optimizer_variable_key(self.optimizer, variable)
        for i, each in enumerate(self.variables):
            if internals.optimizer_variable_key(self.optimizer, each) == key:
                return i
        raise TrainingError(
            explain(
                "The optimizer was asked to update a variable it was not built with.",
                received=getattr(variable, "path", str(variable)),
                fix="build the optimizer on every variable it updates "
                "(optimizer.build(model.trainable_variables))",
            )
        )

    def cut(self, value: Any, index: int, size: int) -> tf.Tensor:
        """Replica ``index``'s shard of ``value`` (a weight or a gradient of ``size``
        elements; a sparse gradient's dense shape may be unknown when traced), zero-padded."""
        flat = tf.reshape(tf.convert_to_tensor(value), [size])
        width = shard_size(size, self.replicas)
        padded = tf.pad(flat, [[0, width * self.replicas - size]])
        return padded[index * width : (index + 1) * width]

    def _gathered(
        self, context: tf.distribute.ReplicaContext, shards: list[tf.Variable], like: list[Any]
    ) -> list[tf.Tensor]:
        """Every replica's updated shards, gathered and cut back to each variable's shape;
        one all-gather per dtype."""
        out: list[tf.Tensor | None] = [None] * len(shards)
        by_dtype: dict[tf.DType, list[int]] = {}
        for i, shard in enumerate(shards):
            by_dtype.setdefault(shard.dtype, []).append(i)
        for positions in by_dtype.values():
            widths = [int(shards[i].shape[0]) for i in positions]
            packed = tf.concat([shards[i].read_value() for i in positions], axis=0)
            gathered = tf.reshape(
                internals.all_gather_without_gradient(context, packed, 0), [self.replicas, -1]
            )
            for i, part in zip(positions, tf.split(gathered, widths, axis=1), strict=True):
                shape = like[i].shape
                out[i] = tf.reshape(tf.reshape(part, [-1])[: _size(like[i])], shape)
        return [t for t in out if t is not None]

    # -- Keras's saving (model.save, save_weights) ---------------------------------------
    def save_own_variables(self, store: Any) -> None:
        """Keras's ``Optimizer.save_own_variables``: the optimizer's variables as the same
        optimizer unsharded has them (its base state, then each slot whole)."""
        for i, item in enumerate(self.view.saved):
            store[str(i)] = np.asarray(item.whole() if isinstance(item, _FullSlot) else item)

    def load_own_variables(self, store: Any) -> None:
        """Keras's ``Optimizer.load_own_variables``: whole slots, cut into this run's shards."""
        items = list(self.view.saved)
        if len(store.keys()) != len(items):
            # Keras's own behaviour for a count that does not match: a warning, no load.
            warnings.warn(
                f"Skipping variable loading for optimizer '{self.optimizer.name}', because it "
                f"has {len(items)} variables whereas the saved optimizer has "
                f"{len(store.keys())} variables (sharded state: built yet?).",
                stacklevel=2,
            )
            return
        for i, item in enumerate(items):
            if isinstance(item, _FullSlot):
                item.assign_whole(store[str(i)])
            else:
                item.assign(store[str(i)])

    # -- reading the state ----------------------------------------------------------------
    def slot_bytes(self) -> dict[str, int]:
        """Bytes of optimizer slots on each local device."""
        out: dict[str, int] = {}
        for replica in self.local:
            for slot in self.slots(replica):
                device = tf.DeviceSpec.from_string(slot.device).to_string()
                out[device] = out.get(device, 0) + _bytes(slot)
        return out


def _size(variable: Any) -> int:
    return int(math.prod(int(d) for d in variable.shape))


def _bytes(variable: Any) -> int:
    return _size(variable) * tf.as_dtype(variable.dtype).size


def _advance_nadam(inner: Any) -> None:
    """Nadam's once-per-update product of momentum factors, which Keras advances in its
    ``_backend_update_step`` before the variables' ``update_step``
    (keras/src/optimizers/nadam.py); the inner optimizer's copy advances as the whole
    optimizer's would."""
    product = internals.nadam_momentum_product(inner)
    dtype = product.dtype
    step = tf.cast(inner.iterations + 1, dtype)
    product.assign(product * inner.beta_1 * (1.0 - 0.5 * tf.pow(tf.constant(0.96, dtype), step)))


def _assign_each(
    strategy: tf.distribute.Strategy,
    context: tf.distribute.ReplicaContext,
    variables: list[Any],
    values: list[tf.Tensor],
) -> None:
    """Writes each gathered value into its (mirrored) variable's copy on every replica, the
    way Keras's TF optimizer writes its updates (``strategy.extended.update``)."""

    def assign(distribution: tf.distribute.Strategy, pairs: Any) -> None:
        for variable, value in pairs:
            distribution.extended.update(
                internals.distributed_container(variable),
                lambda copy, new: copy.assign(new),
                args=(value,),
                group=False,
            )

    pairs = list(zip(variables, values, strict=True))
    if internals.strategy_supports_no_merge_call():
        assign(strategy, pairs)
    else:
        context.merge_call(assign, args=(pairs,))


class _FullSlot(internals.trackable_base()):  # type: ignore[misc]
    """One slot as a checkpoint sees it: the whole slot, gathered from every replica's shard
    on save and cut into this run's shards on restore."""

    def __init__(self, state: ShardedState, position: int) -> None:
        self._state = state
        self._position = position

    def _shards(self) -> list[tf.Variable]:
        return [self._state.slots(r)[self._position] for r in self._state.local]

    def _of(self) -> Any | None:
        """The variable whose slot this is (None: a state of the optimizer's own)."""
        name = self._shards()[0].name
        found = _SHARD_NAME.search(name)
        return None if found is None else self._state.variables[int(found.group(1))]

    def whole(self) -> tf.Tensor:
        """The whole slot: every replica's shard gathered (over the workers too), unpadded."""
        state, shards, of = self._state, self._shards(), self._of()
        if of is None:
            return shards[0].read_value()  # the same on every replica
        strategy = state.strategy
        per_replica = strategy.experimental_distribute_values_from_function(
            lambda context: shards[_local_index(state, context)].read_value()
        )
        gathered = strategy.gather(per_replica, axis=0)
        return tf.reshape(gathered[: _size(of)], of.shape)

    def assign_whole(self, value: Any) -> None:
        """Cuts a whole slot's ``value`` into this process's shards."""
        state, of = self._state, self._of()
        for replica, shard in zip(state.local, self._shards(), strict=True):
            with tf.device(shard.device):
                shard.assign(value if of is None else state.cut(value, replica.index, _size(of)))

    def _serialize_to_tensors(self) -> dict[str, tf.Tensor]:
        return {"VARIABLE_VALUE": self.whole()}

    def _restore_from_tensors(self, restored_tensors: dict[str, tf.Tensor]) -> Any:
        self.assign_whole(restored_tensors["VARIABLE_VALUE"])
        return None


def _local_index(state: ShardedState, context: tf.distribute.ReplicaContext) -> int:
    index = tf.get_static_value(context.replica_id_in_sync_group)
    return [r.index for r in state.local].index(index)


class _CheckpointView(tf.Module):  # type: ignore[misc]
    """The optimizer's ``_variables`` as a checkpoint sees them (``saved``): its base state
    (iterations, learning rate), then each slot whole, in Keras's order, so the keys and
    values are those of the same optimizer unsharded."""

    def __init__(self, state: ShardedState) -> None:
        super().__init__(name=None)
        self._state = state
        self.saved: list[Any] = []  # tracked: a restore of items not yet listed waits

    def track_slots(self) -> None:
        """Lists the base state and the slots (the base state, then each slot as built); a
        restore asked for before they existed is applied now (deferred restoration)."""
        state = self._state
        self.saved.extend(state.optimizer.variables)
        first = state.local[0] if state.local else None
        if first is not None:
            self.saved.extend(_FullSlot(state, i) for i in range(len(state.slots(first))))


def sharded_state(optimizer: Any) -> ShardedState | None:
    """The optimizer's :class:`ShardedState`, or None where its state is not sharded."""
    found = optimizer.__dict__.get("_tfscale_sharded")
    return found if isinstance(found, ShardedState) else None


def install(optimizer: Any, strategy: tf.distribute.Strategy) -> ShardedState:
    """Shards ``optimizer``'s state under ``strategy`` (once; again for another strategy).

    Raises:
        TrainingError: The optimizer cannot be sharded (:func:`check_shardable`).
    """
    found = sharded_state(optimizer)
    if found is not None and found.strategy is strategy:
        return found
    if found is not None:
        registry.restore("sharded-optimizer", optimizer, "build")
    state = ShardedState(optimizer, strategy)
    registry.replace("model-state", optimizer, "_tfscale_sharded", state)
    return state


def slot_bytes_per_device(optimizer: Any, strategy: tf.distribute.Strategy) -> dict[str, int]:
    """Bytes of ``optimizer``'s slot variables (its state less iterations and learning rate)
    held on each of this process's devices, read from the variables' devices."""
    state = sharded_state(optimizer)
    if state is not None:
        return state.slot_bytes()
    base = {id(v) for v in internals.optimizer_base_variables(optimizer)}
    out: dict[str, int] = {}
    for variable in optimizer.variables:
        if id(variable) in base:
            continue
        for copy in strategy.experimental_local_results(internals.distributed_container(variable)):
            device = tf.DeviceSpec.from_string(copy.device).to_string()
            out[device] = out.get(device, 0) + _bytes(copy)
    return out
