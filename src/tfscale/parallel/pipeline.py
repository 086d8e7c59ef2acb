"""Pipeline parallelism (GPipe): stages on their devices, kept busy with micro-batches.

The batch is cut into M micro-batches. Stage s's forward of micro-batch m depends only on
stage s-1's forward of micro-batch m, so stage s can work on m while stage s+1 works on
m-1. Nothing here starts threads: inside a ``tf.function`` (Keras ``fit``, ``predict``,
``evaluate`` trace one), TensorFlow's executor runs every op whose inputs are ready, on
its device, with up to ``inter_op_parallelism_threads`` ops at once, so independent ops on
different devices run at the same time. The ops are emitted clock by clock in the order of
:meth:`tfscale.parallel.schedule.GPipeSchedule.forward_order` (the order only makes the
graph read like the schedule; the data dependencies are what lets the executor overlap).

The backward pass overlaps the same way, mirrored: each stage's gradient ops run on its
device (see :func:`tfscale.parallel.placement.run_stage`), and the gradient of the loss,
a mean over the whole batch, is the sum over micro-batches of each micro-batch's share, so
the tape accumulates the weights' gradients over micro-batches and the optimizer applies
them once per batch. The model's output is the concatenation of the micro-batches'
outputs, so Keras's ``train_step`` computes exactly the unsplit model's loss.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import keras
import tensorflow as tf

from tfscale.errors import PartitionError, TfscaleWarning, explain
from tfscale.parallel.partition import PartitionPlan, chain_layers, plan_partition
from tfscale.parallel.placement import PlacedModel, move_weights, resolve_devices
from tfscale.parallel.schedule import GPipeSchedule, gpipe_schedule

__all__ = ["PipelineModel", "pipeline", "valid_microbatches"]


def valid_microbatches(batch_size: int) -> list[int]:
    """Micro-batch counts that divide ``batch_size`` evenly."""
    return [m for m in range(1, batch_size + 1) if batch_size % m == 0]


def _microbatch_message(batch_size: int | None, microbatches: int) -> str:
    """The error's words; ``batch_size`` None when it is only known as the step runs."""
    if batch_size is None:
        batch, allowed = "this step's batch", "a batch size that is a multiple of microbatches"
    else:
        batch = f"the batch of {batch_size} examples"
        allowed = f"a divisor of {batch_size}: {valid_microbatches(batch_size)}"
    return explain(
        f"microbatches={microbatches} does not divide {batch} into equal micro-batches.",
        received=f"{batch}, microbatches={microbatches}",
        allowed=allowed,
        fix="choose a batch size that is a multiple of microbatches, and drop the last partial "
        "batch (dataset.batch(n, drop_remainder=True), or a number of examples that is a "
        "multiple of the batch size).",
    )


class PipelineModel(PlacedModel):
    """A chain model whose stages run on their devices under the GPipe schedule.

    Built by :func:`tfscale.pipeline`; shares the layers (and weights) of the model it was
    built from. Compile and train it like any Keras model.
    """

    def __init__(
        self,
        layers: Sequence[keras.layers.Layer],
        sizes: Sequence[int],
        devices: Sequence[str],
        *,
        microbatches: int,
        remat: bool = False,
        plan: PartitionPlan | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(layers, sizes, devices, remat=remat, name=name)
        self.microbatches = int(microbatches)
        self.schedule: GPipeSchedule = gpipe_schedule(len(self.stage_sizes), self.microbatches)
        self.plan = plan

    def check_batches(self, batch_size: int, examples: int | None = None) -> None:
        """Refuses batches that ``microbatches`` does not divide, before training starts.

        Args:
            batch_size: The batch size of a step.
            examples: Examples in an epoch, when known: the last, partial batch must divide
                too.

        Raises:
            PartitionError: The batch, or the last partial batch, does not divide.
        """
        sizes = [batch_size]
        if examples is not None and examples % batch_size:
            sizes.append(examples % batch_size)
        for size in sizes:
            if size % self.microbatches:
                message = _microbatch_message(size, self.microbatches)
                if size != batch_size:
                    message = (
                        f"The last batch of an epoch holds {size} of {examples} examples.\n"
                        + message
                    )
                raise PartitionError(message)

    def _split(self, inputs: tf.Tensor) -> list[tf.Tensor]:
        m = self.microbatches
        static = inputs.shape[0]
        if static is not None and static % m:
            raise PartitionError(_microbatch_message(int(static), m))
        if m == 1:
            return [inputs]
        with tf.device(self.stage_devices[0]):
            checks = []
            if static is None:
                # The batch size is only known when the step runs (a step traced with an
                # unknown batch, e.g. a dataset without drop_remainder): check it there,
                # before the split, with the same words (an InvalidArgumentError).
                batch = tf.shape(inputs)[0]
                message = _microbatch_message(None, m)
                checks.append(
                    tf.debugging.Assert(
                        tf.equal(batch % m, 0), [message, "Batch size of this step:", batch]
                    )
                )
            with tf.control_dependencies(checks):
                return list(tf.split(inputs, m, axis=0))

    def call(self, inputs: tf.Tensor, training: bool | None = None) -> tf.Tensor:
        """Runs the forward pass micro-batch by micro-batch in schedule order."""
        self._check_not_replicated()
        micro = self._split(inputs)
        n_stages = len(self.stage_sizes)
        # acts[m] is micro-batch m's activation after the last stage that has run on it.
        acts: list[tf.Tensor] = list(micro)
        for stage, m in self.schedule.forward_order():
            with tf.name_scope(f"stage{stage}_micro{m}"):  # names that tests and traces read
                acts[m] = self._stage(stage, acts[m], training)
        if len(acts) == 1:
            return acts[0]
        with tf.device(self.stage_devices[n_stages - 1]):
            return tf.concat(acts, axis=0)


def _warn_random_layers(layers: Sequence[keras.layers.Layer]) -> None:
    """Recomputing a random layer (Dropout...) draws new numbers: gradients would not match."""
    random = [layer.name for layer in layers if getattr(layer, "seed_generator", None) is not None]
    if random:
        warnings.warn(
            f"remat=True recomputes each stage's forward pass in the backward pass, and the "
            f"random layers {random} draw new random numbers when recomputed, so their "
            "gradients do not match the forward pass. Use remat=False with random layers.",
            TfscaleWarning,
            stacklevel=3,
        )


def pipeline(
    model: keras.Model,
    devices: Sequence[str] | None = None,
    *,
    microbatches: int,
    balance: str | Sequence[int] = "params",
    remat: bool = False,
    weights_on_devices: bool = True,
) -> keras.Model:
    """Splits ``model`` over ``devices`` and runs it with the GPipe micro-batch schedule.

    Args:
        model: A built Sequential model, or a functional model whose layers form a chain.
        devices: One device per stage; None uses every logical GPU, else every logical CPU.
        microbatches: Micro-batches per batch (M); it must divide the batch size. More
            micro-batches shrink the idle share (S-1)/(M+S-1) but make each op smaller.
        balance: How to cut the model: ``"params"``, ``"time"`` or a list of stage sizes.
        remat: Each stage keeps only its input for the backward pass and recomputes its
            forward there (less activation memory, about one more forward pass of work).
        weights_on_devices: Move each stage's weights onto its device (the same Keras
            variables, re-created there); False leaves them where the model was built.

    Returns:
        A Keras model sharing ``model``'s weights. Compile it, then train it with
        ``tfscale.fit`` or ``fit``; ``model.plan`` and ``model.schedule`` describe it.

    Raises:
        PartitionError: The model is not a chain, ``microbatches`` is not a positive
            integer, or the devices are unknown. A batch that ``microbatches`` does not
            divide raises it when the model is called.

    Example::

        piped = tfscale.pipeline(model, ["/device:CPU:0", "/device:CPU:1"], microbatches=8)
        piped.compile(optimizer="sgd", loss="mse")
        tfscale.fit(piped, x, y, epochs=2, batch_size=64)
    """
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise PartitionError(
            explain(
                "microbatches must be a positive integer.",
                received=microbatches,
                allowed="an int >= 1 that divides the batch size",
            )
        )
    resolved = resolve_devices(devices)
    plan = plan_partition(model, len(resolved), balance)
    if remat:
        _warn_random_layers(chain_layers(model))

    piped = PipelineModel(
        chain_layers(model),
        plan.sizes,
        resolved,
        microbatches=microbatches,
        remat=remat,
        plan=plan,
        name=f"{model.name}_pipeline",
    )
    if weights_on_devices:
        move_weights(model, piped)
    return piped
