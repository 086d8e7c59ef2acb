"""Placement: run each stage of a partitioned model on its own device.

This is the usual manual model parallelism (``with tf.device(...)`` around groups of
layers), done correctly:

- the activation leaving a stage is copied to the next device explicitly with
  ``tf.identity`` under that device, so the transfer is one visible op per cut;
- the backward pass of a stage runs on the stage's device too. A ``tf.GradientTape``
  records no device for gradient ops (they are placed on the default device, so the whole
  backward pass would run on the first device); :func:`run_stage` wraps each stage in
  ``tf.custom_gradient`` whose gradient function computes under the stage's device.

Placement alone does not make devices work at the same time: stage s+1 needs stage s's
output, so the devices take turns (see docs/pipeline.md). :mod:`tfscale.parallel.pipeline`
adds micro-batches so that they overlap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from tfscale.devices.names import select_devices
from tfscale.errors import PartitionError, explain
from tfscale.interop import registry
from tfscale.interop.internals import (
    backing_variable,
    in_symbolic_build,
    reinitialize_variable,
    set_model_strategy,
)
from tfscale.parallel.partition import PartitionPlan, chain_layers

__all__ = ["PlacedModel", "move_weights", "place", "resolve_devices", "run_stage"]


def resolve_devices(devices: Sequence[str] | None) -> list[str]:
    """Full names of the devices to place stages on.

    Args:
        devices: Device names (``"/device:CPU:1"``, ``"GPU:0"``...), or None for every
            logical GPU, else every logical CPU (:mod:`tfscale.devices.names` decides).

    Returns:
        Fully qualified logical device names, in the order given.

    Raises:
        PartitionError: A name TensorFlow does not list, a repeated device, or an empty list.
    """
    logical = [d.name for d in tf.config.list_logical_devices()]
    return select_devices(
        devices,
        logical,
        who="pipeline/place",
        error=PartitionError,
        fix="pass devices=None to use every logical GPU (else CPU), or split one device "
        "with tfscale.use_virtual_devices(n) before TensorFlow starts.",
    )


def move_weights(model: keras.Model, placed: PlacedModel) -> None:
    """Moves each stage's weights onto the stage's device, in place.

    The Keras variables stay the same objects (the original model and the placed one keep
    sharing them, and an optimizer built for either still finds them); only the TensorFlow
    variable holding each value is re-created under the stage's device. Without this every
    weight stays where the model was built (often the first GPU), which defeats splitting a
    model that does not fit on one device, and every step copies weights across devices.
    Functions the original model traced before read the old copies, so they are dropped.
    """
    for index, device in enumerate(placed.stage_devices):
        for layer in placed.stage_layers(index):
            for variable in layer.weights:
                current = backing_variable(variable)
                if not isinstance(current, tf.Variable) or current.device.endswith(
                    device.rsplit("/", 1)[-1]
                ):
                    continue
                if isinstance(current, tf.distribute.DistributedValues) or (
                    tf.distribute.has_strategy()
                ):
                    continue  # a strategy owns these variables' placement
                with tf.init_scope(), tf.device(device):
                    reinitialize_variable(variable, tf.identity(current))
    for attribute in ("train_function", "test_function", "predict_function"):
        if getattr(model, attribute, None) is not None:
            registry.replace("compiled-functions", model, attribute, None)


def run_stage(
    layers: Sequence[keras.layers.Layer],
    inputs: tf.Tensor,
    *,
    device: str,
    training: bool | None,
    remat: bool = False,
) -> tf.Tensor:
    """Runs ``layers`` one after another on ``device``, backward pass included.

    Args:
        layers: The stage's layers, in order.
        inputs: The stage's input (already on ``device``).
        device: Where the forward and the backward ops of the stage run.
        training: Passed to every layer.
        remat: Keep only the stage's input for the backward pass and recompute the
            stage's forward there (activation memory of one stage, at one more forward).

    Returns:
        The output of the last layer.
    """

    def forward(x: tf.Tensor) -> tf.Tensor:
        for layer in layers:
            x = layer(x, training=training)
        return x

    if in_symbolic_build():
        # Keras tracing for shapes (the model's build): no gradient will be taken, and a
        # tf.custom_gradient would register one in TensorFlow's process-wide registry that
        # keeps this scratch graph alive for the process's life (tensorflow/tensorflow#97697).
        with tf.device(device):
            return forward(inputs)

    differentiable = inputs.dtype.is_floating

    @tf.custom_gradient  # type: ignore[misc]
    def stage(x: tf.Tensor) -> tuple[tf.Tensor, Callable[..., Any]]:
        with tf.device(device):
            if remat:
                y = forward(x)
                tape = None
            else:
                with tf.GradientTape(watch_accessed_variables=True) as tape:
                    if differentiable:
                        tape.watch(x)
                    y = forward(x)

        def grad(dy: tf.Tensor, variables: Sequence[tf.Variable] = ()) -> Any:
            with tf.device(device):
                if tape is None:
                    with tf.GradientTape() as again:
                        if differentiable:
                            again.watch(x)
                        again.watch(list(variables))
                        y_again = forward(x)
                    recorded, out = again, y_again
                else:
                    recorded, out = tape, y
                sources = [x] if differentiable else []
                grads = recorded.gradient(out, [*sources, *variables], output_gradients=dy)
            dx = grads[0] if differentiable else None
            return dx, list(grads[len(sources) :])

        return y, grad

    return stage(inputs)  # type: ignore[no-any-return]


class PlacedModel(keras.Model):  # type: ignore[misc]
    """A chain of layers split into stages, each stage on its own device.

    It shares the layers (and so the weights) of the model it was built from. Stages run
    one after another: this is the naive split that :class:`PipelineModel` improves on.
    """

    def __init__(
        self,
        layers: Sequence[keras.layers.Layer],
        sizes: Sequence[int],
        devices: Sequence[str],
        *,
        remat: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        if len(sizes) != len(devices):
            raise PartitionError(
                explain(
                    f"The plan has {len(sizes)} stages but {len(devices)} devices were given.",
                    received=list(devices),
                    allowed=f"{len(sizes)} devices, one per stage",
                    fix=f"plan with tfscale.plan_partition(model, {len(devices)}).",
                )
            )
        # This model places its own ops, one stage per device: it must not be replicated.
        # It declares the default (no-op) strategy as its own, so tfscale.fit, which
        # trains a model with the model's own strategy when given none, and Keras's fit
        # both train it as it is instead of choosing a MirroredStrategy over the devices.
        set_model_strategy(self, tf.distribute.get_strategy())
        self.chain = list(layers)
        self.stage_sizes = tuple(int(s) for s in sizes)
        self.stage_devices = tuple(devices)
        self.remat = bool(remat)

    def stage_layers(self, index: int) -> list[keras.layers.Layer]:
        """The layers of stage ``index``."""
        start = sum(self.stage_sizes[:index])
        return self.chain[start : start + self.stage_sizes[index]]

    def _stage(self, index: int, x: tf.Tensor, training: bool | None) -> tf.Tensor:
        device = self.stage_devices[index]
        with tf.device(device):
            x = tf.identity(x)  # the explicit copy of the activation onto this device
        return run_stage(
            self.stage_layers(index), x, device=device, training=training, remat=self.remat
        )

    def _check_not_replicated(self) -> None:
        self.check_strategy(tf.distribute.get_strategy())

    def check_strategy(self, strategy: tf.distribute.Strategy) -> None:
        """Refuses a strategy that would replicate the model (``tfscale.fit`` asks first).

        Raises:
            PartitionError: ``strategy`` has more than one replica.
        """
        if strategy.num_replicas_in_sync > 1:
            raise PartitionError(
                explain(
                    "A model split over devices places each stage itself and cannot also be "
                    "replicated by a distribution strategy.",
                    received=f"{type(strategy).__name__} with "
                    f"{strategy.num_replicas_in_sync} replicas",
                    allowed="the default strategy (no strategy scope)",
                    fix="train it outside any strategy scope: tfscale.fit(piped, x, y, ...) "
                    "with strategy=None or tf.distribute.get_strategy().",
                )
            )

    def call(self, inputs: tf.Tensor, training: bool | None = None) -> tf.Tensor:
        """Runs every stage in turn, each on its device."""
        self._check_not_replicated()
        x = inputs
        for index in range(len(self.stage_sizes)):
            x = self._stage(index, x, training)
        return x


def place(
    model: keras.Model,
    plan: PartitionPlan,
    devices: Sequence[str] | None = None,
    *,
    remat: bool = False,
    weights_on_devices: bool = True,
) -> keras.Model:
    """Runs each stage of ``plan`` on its device, one stage after another.

    Args:
        model: The model the plan was made for.
        plan: From :func:`tfscale.plan_partition`.
        devices: One device per stage; None takes the first ``plan.n_stages`` logical
            GPUs, else CPUs.
        remat: Recompute each stage's forward in the backward pass.
        weights_on_devices: Move each stage's weights onto its device (see
            :func:`move_weights`); False leaves them where the model was built.

    Returns:
        A Keras model sharing ``model``'s layers; compile and fit it as usual.

    Raises:
        PartitionError: The plan does not match the model or the devices.
    """
    layers = chain_layers(model)
    names = [layer.name for layer in layers]
    planned = [name for stage in plan.stages for name in stage.layers]
    if planned != names:
        raise PartitionError(
            explain(
                "The plan was made for another model: its layers differ.",
                received=f"plan layers {planned}",
                allowed=f"this model's layers {names}",
                fix="make the plan from this model: tfscale.plan_partition(model, n).",
            )
        )
    resolved = resolve_devices(devices)
    if devices is None:
        resolved = resolved[: plan.n_stages]
    placed = PlacedModel(layers, plan.sizes, resolved, remat=remat, name=f"{model.name}_placed")
    if weights_on_devices:
        move_weights(model, placed)
    return placed
