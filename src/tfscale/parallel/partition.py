"""Partition planning: cut a chain of Keras layers into contiguous, balanced stages.

A model can be pipelined when its layers form a chain: each layer takes the previous
layer's single output. Sequential models always do; a functional model does when no layer
feeds two layers or takes two inputs. A block that branches (a residual block, an inception
block) can still be pipelined by wrapping it in one layer (a nested ``keras.Model``), so
that it becomes one link of the chain and is never cut inside.

Facts about the model are gathered once into :class:`LayerInfo` records; cutting them into
stages (:func:`split_sizes`) and judging sizes (:func:`check_sizes`) are pure functions.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfscale.errors import PartitionError, explain
from tfscale.interop.internals import functional_nodes, inbound_nodes, node_key, tensor_producer

__all__ = [
    "LayerInfo",
    "PartitionPlan",
    "StagePlan",
    "chain_layers",
    "check_sizes",
    "plan_partition",
    "split_sizes",
]

_BALANCES = ('"params"', '"time"', "a list of stage sizes")


@dataclass(frozen=True)
class LayerInfo:
    """One link of the chain.

    Attributes:
        name: The layer's name (unique in its model).
        params: Number of parameters (weights) of the layer.
        activation_bytes: Bytes per example of the layer's output, None if a dimension
            other than the batch is unknown.
        seconds: Measured forward + backward time on the sample batch, None if not measured.
    """

    name: str
    params: int
    activation_bytes: int | None
    seconds: float | None = None


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: a contiguous run of layers.

    Attributes:
        index: Position of the stage, 0 first.
        layers: Names of the stage's layers, in order.
        params: Parameters held by the stage.
        activation_bytes: Bytes per example of the stage's output (what moves to the next
            device), None where unknown.
        seconds: Measured forward + backward time of the stage, None if not measured.
    """

    index: int
    layers: tuple[str, ...]
    params: int
    activation_bytes: int | None
    seconds: float | None


@dataclass(frozen=True)
class PartitionPlan:
    """How a model is cut into stages, and what each stage costs.

    Attributes:
        stages: The stages, first to last.
        balance: How the cut was chosen: ``"params"``, ``"time"`` or ``"sizes"``.
        sample_batch: Batch size of the time measurement (0 when time was not measured).
    """

    stages: tuple[StagePlan, ...]
    balance: str
    sample_batch: int = 0

    @property
    def sizes(self) -> list[int]:
        """Number of layers of each stage."""
        return [len(s.layers) for s in self.stages]

    @property
    def n_stages(self) -> int:
        """Number of stages."""
        return len(self.stages)

    def table(self) -> str:
        """A readable table: layers, parameters, activation size and time per stage."""
        header = ("stage", "layers", "params", "act/example", "time")
        rows = [header]
        for stage in self.stages:
            first, last = stage.layers[0], stage.layers[-1]
            span = first if first == last else f"{first} .. {last}"
            rows.append(
                (
                    str(stage.index),
                    f"{len(stage.layers)} ({span})",
                    f"{stage.params:,}",
                    _bytes(stage.activation_bytes),
                    "-" if stage.seconds is None else f"{stage.seconds * 1e3:.2f} ms",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        title = f"PartitionPlan: {self.n_stages} stages, balance={self.balance}"
        if self.sample_batch:
            title += f", time = forward+backward on a batch of {self.sample_batch}"
        return "\n".join([title, *(line.rstrip() for line in lines)])

    def __str__(self) -> str:
        return self.table()


def _bytes(value: int | None) -> str:
    if value is None:
        return "?"
    if value < 1024:
        return f"{value} B"
    if value < 1024 * 1024:
        return f"{value / 1024:.1f} KiB"
    return f"{value / (1024 * 1024):.1f} MiB"


# ---------------------------------------------------------------- the chain of layers


def chain_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The layers of ``model`` in order, when they form a chain.

    Args:
        model: A built ``keras.Sequential`` model, or a functional ``keras.Model`` with one
            input and one output.

    Returns:
        The layers (input layers left out), each taking the previous one's output.

    Raises:
        PartitionError: The model is not built, not a chain (the message names the layers
            that branch), or of another kind (a subclassed model).
    """
    if isinstance(model, keras.Sequential):
        layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
        if not model.built or not model.inputs:
            raise PartitionError(
                explain(
                    "The Sequential model is not built, so its layer shapes are unknown.",
                    received=f"model {model.name!r} with built={model.built}",
                    allowed="a model built with an input shape",
                    fix="start it with keras.Input(shape=...) or call model.build((None, ...)).",
                )
            )
        return layers
    nodes = functional_nodes(model)
    if nodes is None or not getattr(model, "inputs", None):
        raise PartitionError(
            explain(
                "Only Sequential and functional models can be split into stages: "
                "a subclassed model's call() can do anything between its layers.",
                received=type(model).__name__,
                allowed="keras.Sequential, or a functional keras.Model whose layers form a chain",
                fix="rebuild it as keras.Sequential([...]) of its blocks.",
            )
        )
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise PartitionError(
            explain(
                "A pipelined model needs exactly one input and one output.",
                received=f"{len(model.inputs)} inputs, {len(model.outputs)} outputs",
                allowed="1 input, 1 output",
            )
        )
    return _functional_chain(model, nodes)


def _functional_chain(model: keras.Model, nodes: Any) -> list[keras.layers.Layer]:
    operations = list(getattr(model, "operations", model.layers))
    body = [op for op in operations if not isinstance(op, keras.layers.InputLayer)]
    consumers: dict[str, list[str]] = {op.name: [] for op in operations}
    inputs_of: dict[str, list[str]] = {}
    problems: dict[str, list[str]] = {}
    for op in body:
        # Only this model's calls of the layer (it may be reused by another model too).
        own = [n for i, n in enumerate(inbound_nodes(op)) if node_key(op, i) in nodes]
        if len(own) != 1:
            problems.setdefault(op.name, []).append(f"is called {len(own)} times (a shared layer)")
        if not isinstance(op, keras.layers.Layer):
            problems.setdefault(op.name, []).append(
                "is an operation, not a layer (wrap it in keras.layers.Lambda)"
            )
        sources = [tensor_producer(t).name for n in own for t in n.input_tensors]
        inputs_of[op.name] = sources
        for source in sources:
            consumers.setdefault(source, []).append(op.name)
        if len(own) == 1 and len(own[0].output_tensors) != 1:
            problems.setdefault(op.name, []).append(f"has {len(own[0].output_tensors)} outputs")
    for op in body:
        sources = inputs_of[op.name]
        if len(sources) > 1:
            problems.setdefault(op.name, []).append(
                f"takes {len(sources)} inputs ({_names(sources)})"
            )
    for op in operations:
        used_by = consumers.get(op.name, [])
        if len(used_by) > 1:
            problems.setdefault(op.name, []).append(
                f"feeds {len(used_by)} layers ({_names(used_by)})"
            )
    if problems:
        blocking = [op.name for op in operations if op.name in problems]
        detail = "; ".join(f"{name!r} {' and '.join(problems[name])}" for name in blocking)
        raise PartitionError(
            explain(
                "The model's layers do not form a chain, so it cannot be cut into pipeline "
                f"stages: a branch would cross a cut. Blocking layers: {_names(blocking)}.",
                received=detail,
                allowed="a chain: every layer takes the previous layer's only output",
                fix="wrap each branching block in one layer so that the model becomes a chain:\n"
                "    block = keras.Model(block_input, block_output)  # the residual block\n"
                "    model = keras.Sequential([keras.Input(...), stem, block, head])",
            )
        )
    return [op for op in body]


def _names(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names)


# ---------------------------------------------------------------- facts about each layer


def _layer_infos(
    model: keras.Model, layers: Sequence[keras.layers.Layer], sample_batch: int | None
) -> list[LayerInfo]:
    spec = model.inputs[0]
    specs = []
    for layer in layers:
        specs.append(spec)
        spec = layer.compute_output_spec(spec)
    outputs = [*specs[1:], spec]
    infos = []
    for layer, in_spec, out_spec in zip(layers, specs, outputs, strict=True):
        seconds = None if sample_batch is None else _measure(layer, in_spec, sample_batch)
        infos.append(
            LayerInfo(layer.name, int(layer.count_params()), _per_example(out_spec), seconds)
        )
    return infos


def _per_example(spec: Any) -> int | None:
    dims = list(spec.shape[1:])
    if any(d is None for d in dims):
        return None
    return int(math.prod(dims)) * np.dtype(spec.dtype).itemsize


def _measure(layer: keras.layers.Layer, in_spec: Any, batch: int, repeats: int = 5) -> float:
    """Median seconds of one forward + backward of ``layer`` on a random batch."""
    shape = [batch, *(d if d is not None else 8 for d in in_spec.shape[1:])]
    dtype = tf.as_dtype(in_spec.dtype)
    rng = np.random.default_rng(0)
    if dtype.is_floating:
        x = tf.constant(rng.standard_normal(shape), dtype=dtype)
    else:
        x = tf.zeros(shape, dtype=dtype)  # ids, masks: 0 is valid for every embedding

    @tf.function
    def step(x: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            if dtype.is_floating:
                tape.watch(x)
            y = layer(x)
            total = tf.reduce_sum(tf.cast(y, tf.float32))
        sources = [x] if dtype.is_floating else []
        grads = tape.gradient(total, [*sources, *layer.trainable_variables])
        return tf.add_n([total, *(tf.reduce_sum(g) for g in grads if g is not None)])

    step(x).numpy()  # trace and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(x).numpy()
        times.append(time.perf_counter() - start)
    return float(statistics.median(times))


# ---------------------------------------------------------------- cutting (pure)


def check_sizes(sizes: Sequence[object], n_layers: int, n_stages: int) -> list[int]:
    """Validates explicit stage sizes.

    Args:
        sizes: Layers per stage as given by the user.
        n_layers: Number of layers of the chain.
        n_stages: Number of stages asked for.

    Returns:
        The sizes as ints.

    Raises:
        PartitionError: Wrong count, a non-positive size, or a sum other than ``n_layers``.
    """
    if len(sizes) != n_stages:
        raise PartitionError(
            explain(
                f"balance gives {len(sizes)} stage sizes for {n_stages} stages.",
                received=list(sizes),
                allowed=f"a list of {n_stages} positive ints summing to {n_layers}",
            )
        )
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise PartitionError(
            explain(
                "Every stage needs at least one layer.",
                received=list(sizes),
                allowed=f"{n_stages} ints >= 1 summing to {n_layers}",
            )
        )
    ints = [int(s) for s in sizes]  # type: ignore[call-overload]
    if sum(ints) != n_layers:
        raise PartitionError(
            explain(
                f"The stage sizes add up to {sum(ints)} layers but the model has {n_layers}.",
                received=ints,
                allowed=f"{n_stages} ints >= 1 summing to {n_layers}",
            )
        )
    return ints


def split_sizes(weights: Sequence[float], n_stages: int) -> list[int]:
    """Cuts ``weights`` into ``n_stages`` contiguous non-empty runs minimising the largest sum.

    Exact dynamic programme (O(S·N²)); ties go to the later cut, so that weightless layers
    (activations, reshapes) stay with the layer before them.

    Args:
        weights: Cost of each layer, in chain order.
        n_stages: Number of runs, at most ``len(weights)``.

    Returns:
        The number of layers of each run.
    """
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][i]: the smallest possible largest run when the first i layers form k runs.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value <= best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes: list[int] = []
    i = n
    for k in range(n_stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def _stages(infos: Sequence[LayerInfo], sizes: Sequence[int]) -> tuple[StagePlan, ...]:
    stages = []
    start = 0
    for index, size in enumerate(sizes):
        part = infos[start : start + size]
        start += size
        times = [i.seconds for i in part if i.seconds is not None]
        stages.append(
            StagePlan(
                index=index,
                layers=tuple(i.name for i in part),
                params=sum(i.params for i in part),
                activation_bytes=part[-1].activation_bytes,
                seconds=sum(times) if len(times) == len(part) else None,
            )
        )
    return tuple(stages)


def plan_partition(
    model: keras.Model,
    n_stages: int,
    balance: str | Sequence[int] = "params",
    *,
    measure_time: bool = False,
    sample_batch: int = 32,
) -> PartitionPlan:
    """Cuts a chain model into ``n_stages`` contiguous stages.

    Args:
        model: A built Sequential model, or a functional model whose layers form a chain.
        n_stages: Number of stages (usually the number of devices).
        balance: ``"params"`` balances parameter counts, ``"time"`` balances measured
            forward + backward time per layer, a list gives the number of layers per stage.
        measure_time: Also measure (and report) time per stage when balancing otherwise.
        sample_batch: Batch size used to measure layer time.

    Returns:
        The plan; ``print(plan)`` shows parameters, activation size and time per stage.

    Raises:
        PartitionError: The model is not a chain (naming the blocking layers), more stages
            than layers, or bad sizes or balance mode.
    """
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise PartitionError(
            explain("n_stages must be a positive integer.", received=n_stages, allowed="int >= 1")
        )
    layers = chain_layers(model)
    if n_stages > len(layers):
        raise PartitionError(
            explain(
                f"{n_stages} stages were asked for but the model has only {len(layers)} layers, "
                "and every stage needs at least one.",
                received=f"n_stages={n_stages}",
                allowed=f"1 to {len(layers)} stages",
                fix="use fewer devices, or split big layers into several.",
            )
        )
    if isinstance(balance, str) and balance not in ("params", "time"):
        raise PartitionError(
            explain("Unknown balance mode.", received=balance, allowed=" or ".join(_BALANCES))
        )
    if not isinstance(balance, (str, list, tuple)):
        raise PartitionError(
            explain("Unknown balance mode.", received=balance, allowed=" or ".join(_BALANCES))
        )
    timed = measure_time or balance == "time"
    infos = _layer_infos(model, layers, sample_batch if timed else None)
    if balance == "params":
        sizes = split_sizes([i.params for i in infos], n_stages)
        mode = "params"
    elif balance == "time":
        sizes = split_sizes([i.seconds or 0.0 for i in infos], n_stages)
        mode = "time"
    else:
        sizes = check_sizes(list(balance), len(infos), n_stages)
        mode = "sizes"
    return PartitionPlan(_stages(infos, sizes), mode, sample_batch if timed else 0)
