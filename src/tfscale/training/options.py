"""tfscale's options: :class:`Options`, what the user asks, and :class:`Decided`, what runs.

Every option is one field of :class:`Options`, defined once with its default, its doc, its
check and the entries that honour it (its :class:`Spec`). ``tfscale.fit``, ``prepare``,
``prepare_loop``, ``Trainer`` and the parameter-server loop take ``options=Options(...)``;
their keyword arguments of the same names are shorthand, made from these fields
(``shorthand.py``), and the parameter-server loop's list of what it honours is read from them
(``coordinator.HONOURED``). Adding an option is one field here and its use (Lightning
Fabric's configuration object, rather than the same options repeated in every signature,
which drifted: Trainer's ``jit_compile`` defaulted to False, ``prepare_loop`` never checked
``bucket_bytes``).

Each entry turns the user's :class:`Options` into one :class:`Decided` (:func:`decide`: the
precision policy, ``jit_compile`` against ``compile()``'s), which the step functions and the
distributed update read. Its own module so that ``prepare.py`` and ``loop.py`` both use it
without importing each other.
"""

from __future__ import annotations

import enum
import textwrap
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field, fields
from typing import Any

import numpy as np
import tensorflow as tf

from tfscale.errors import TrainingError, explain
from tfscale.training.allreduce import Compression, check_compression
from tfscale.training.checks import check_global_clipnorm, python_int
from tfscale.training.precision import Precision, resolve_precision

__all__ = [
    "Decided",
    "Entry",
    "Options",
    "Spec",
    "check_switch",
    "decide",
    "doc_lines",
    "option_fields",
    "resolve_strategy",
    "spec",
]


class Entry(enum.Enum):
    """An entry that takes :class:`Options` (its value is how messages name it)."""

    FIT = "tfscale.fit"
    PREPARE = "tfscale.prepare"
    PREPARE_LOOP = "tfscale.prepare_loop"
    TRAINER = "tfscale.Trainer"
    PARAMETER_SERVER = "tfscale.fit under ParameterServerStrategy"


@dataclass(frozen=True)
class Spec:
    """What one option is, besides its name, type and default.

    Attributes:
        doc: Its documentation (one paragraph), shown in each entry's docstring.
        check: ``check(name, value)`` returns the value normalized (a NumPy integer as an
            ``int``, ``"auto"`` as None) or raises a ``TrainingError``.
        entries: The entries that honour it; the others refuse it by name when it is set.
        unused: The values that leave it unused (its default, and for ``jit_compile`` also
            False): an entry that does not honour it accepts these.
    """

    doc: str
    check: Callable[[str, Any], Any]
    entries: frozenset[Entry]
    unused: tuple[object, ...]


def _option(
    default: Any,
    doc: str,
    check: Callable[[str, Any], Any],
    entries: frozenset[Entry],
    unused: tuple[object, ...] = (),
) -> Any:
    """A field of :class:`Options` carrying its :class:`Spec`."""
    spec = Spec(" ".join(doc.split()), check, entries, (default, *unused))
    return field(default=default, metadata={"tfscale": spec})


def check_switch(name: str, value: object, auto: bool = False) -> None:
    """A yes/no option (``remat``, ``sync_batchnorm``, ``jit_compile``): a bool; with
    ``auto``, also None or ``"auto"`` (the model's own ``compile`` setting). Anything else
    was read as yes or no by ``bool()``, silently.

    Raises:
        TrainingError: Another value.
    """
    if isinstance(value, (bool, np.bool_)):
        return
    if auto and (value is None or (isinstance(value, str) and value == "auto")):
        return
    raise TrainingError(
        explain(
            f"{name} is a yes/no option.",
            received=f"{name}={value!r}",
            allowed="True or False"
            + (", or None / 'auto' (the model's compile setting)" if auto else ""),
            fix=f"{name}=True",
        )
    )


def _switch(name: str, value: object) -> bool:
    check_switch(name, value)
    return bool(value)


def _switch_or_compiled(name: str, value: object) -> bool | None:
    check_switch(name, value, auto=True)
    return None if value is None or isinstance(value, str) else bool(value)


def _positive_int(name: str, value: object) -> int:
    value = python_int(value)  # NumPy integers, as model.fit takes them
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TrainingError(
            explain(
                f"{name} must be a positive integer.",
                received=f"{name}={value!r}",
                allowed="an int >= 1",
            )
        )
    return value


def _positive_int_or_none(name: str, value: object) -> int | None:
    return None if value is None else _positive_int(name, value)


def _precision(name: str, value: object) -> str | None:
    decided = resolve_precision(value)  # type: ignore[arg-type]
    return None if decided.policy is None else decided.name


def _compression(name: str, value: object) -> str | None:
    return check_compression(value)


def _global_clipnorm(name: str, value: object) -> float | None:
    return check_global_clipnorm(value)


def _shard_optimizer_state(name: str, value: object) -> bool:
    # Carried into Decided; DistributedUpdate shards the optimizer's state where it is set
    # (training/sharding.py).
    return _switch(name, value)


_SYNCHRONOUS = frozenset({Entry.FIT, Entry.PREPARE, Entry.TRAINER})
_EVERY_UPDATE = _SYNCHRONOUS | {Entry.PREPARE_LOOP}


@dataclass(frozen=True)
class Options:
    """tfscale's options, defined once: ``tfscale.fit``, ``tfscale.prepare``,
    ``tfscale.prepare_loop`` and ``tfscale.Trainer`` take ``options=Options(...)``, and
    the same names as keyword arguments (shorthand: ``tfscale.fit(model, x, y,
    accumulation_steps=4)`` is ``tfscale.fit(model, x, y,
    options=tfscale.Options(accumulation_steps=4))``).

    Each value is checked when the object is made, with the same ``TrainingError`` however
    it is given; NumPy integers and booleans are taken. An entry refuses, by name and before
    any work, an option it does not honour that is set (the entries that honour each are
    listed below); ``tfscale.fit`` under ParameterServerStrategy honours none of them.
    ``clipnorm=`` is refused with its fix: the global-norm clip is ``global_clipnorm``, as
    in Keras, where ``clipnorm`` clips each variable (set that on the optimizer).

    Attributes:
    """

    accumulation_steps: int = _option(
        1,
        """Batches (steps) per optimizer update; the update is the mean over all their
        examples, and ``optimizer.iterations`` counts updates.""",
        _positive_int,
        _EVERY_UPDATE,
    )
    global_clipnorm: float | None = _option(
        None,
        """Clip the all-reduced gradient to this global norm (Keras's ``global_clipnorm``,
        applied after the all-reduce); None does not clip.""",
        _global_clipnorm,
        _EVERY_UPDATE,
    )
    mixed_precision: str | None = _option(
        None,
        """None, ``"bf16"`` or ``"fp16"`` (Keras's policy names are taken too); ``"fp16"``
        wraps the optimizer in Keras's ``LossScaleOptimizer``, whose finiteness test then
        sees the all-reduced gradient.""",
        _precision,
        _SYNCHRONOUS,
    )
    remat: bool = _option(
        False,
        "Recompute each weighted layer's activations in the backward pass to save memory.",
        _switch,
        _SYNCHRONOUS,
    )
    jit_compile: bool | None = _option(
        None,
        """XLA for each replica's whole step, forward and backward pass; None (or
        ``"auto"``) keeps what ``compile(jit_compile=...)`` decided.""",
        _switch_or_compiled,
        _SYNCHRONOUS,
        unused=(False,),
    )
    sync_batchnorm: bool = _option(
        False,
        """BatchNormalization layers normalize with the statistics of the whole global
        batch (``BatchNormalization(synchronized=True)``), as on one device.""",
        _switch,
        _SYNCHRONOUS,
    )
    global_load_balancing: bool = _option(
        False,
        """A mixture-of-experts layer's load-balancing loss (KerasHub's Mixtral, QwenMoe,
        Qwen3Moe, Qwen3.5-MoE) is computed over the whole global batch's tokens, as on one
        device, instead of over each replica's share (what Keras's own fit and
        Megatron's default do): each layer gathers the replicas' router logits.""",
        _switch,
        _SYNCHRONOUS,
    )
    bucket_bytes: int | None = _option(
        None,
        """All-reduce the gradients in buckets of about this many bytes, from the last
        layer's backwards, so that communication overlaps the rest of the backward pass (a
        larger gradient is a bucket of its own); None packs them into one all-reduce, the
        cheapest for models whose gradients are small against ``sqrt(alpha * bytes / beta)``
        (``tfscale bench`` measures alpha and beta and recommends a size).""",
        _positive_int_or_none,
        _EVERY_UPDATE,
    )
    gradient_compression: str | None = _option(
        None,
        """``"bf16"`` or ``"fp16"``: all-reduce dense gradients in that type (half the
        bytes; the sum is rounded to it); ``"fp16"`` overflows past 65504: use it with loss
        scaling, which backs off on overflow.""",
        _compression,
        _EVERY_UPDATE,
    )
    shard_optimizer_state: bool = _option(
        False,
        """Shard the optimizer's state over the replicas (ZeRO stage 1). Not yet acted on:
        it is checked and accepted, and the update is the unsharded one.""",
        _shard_optimizer_state,
        frozenset({Entry.FIT, Entry.PREPARE, Entry.PREPARE_LOOP}),
    )
    clipnorm: InitVar[None] = None

    def __post_init__(self, clipnorm: None) -> None:
        check_global_clipnorm(None, clipnorm)  # refused, with the global_clipnorm fix
        for each in option_fields():
            value = spec(each.name).check(each.name, getattr(self, each.name))
            object.__setattr__(self, each.name, value)  # frozen: normalized once, here


def option_fields() -> tuple[Any, ...]:
    """The fields of :class:`Options` (``dataclasses.Field``), in order."""
    return fields(Options)


def spec(name: str) -> Spec:
    """The :class:`Spec` of the option ``name``.

    Raises:
        KeyError: No such option.
    """
    for each in option_fields():
        if each.name == name:
            found: Spec = each.metadata["tfscale"]
            return found
    raise KeyError(name)


def doc_lines(entry: Entry | None, indent: str, width: int = 92) -> list[str]:
    """Google-style ``Args:`` / ``Attributes:`` lines of the options ``entry`` honours
    (None: of every option, each saying which entries honour it)."""
    lines = []
    for each in option_fields():
        found = spec(each.name)
        if entry is not None and entry not in found.entries:
            continue
        text = f"{each.name}: {found.doc}"
        if entry is None:
            honoured = ", ".join(e.value for e in Entry if e in found.entries)
            text += f" Default {each.default!r}; honoured by {honoured}."
        lines += textwrap.wrap(
            text,
            width,
            initial_indent=indent,
            subsequent_indent=indent + "    ",
            break_on_hyphens=False,
            break_long_words=False,
        )
    return lines


Options.__doc__ = "\n".join([(Options.__doc__ or "").rstrip(), *doc_lines(None, " " * 8)])


@dataclass(frozen=True)
class Decided:
    """The options as the step functions and the distributed update read them: one per
    prepared model or loop (``Prepared.options``, ``StepFunction.options``,
    ``DistributedUpdate.options``), made from :class:`Options` by :func:`decide`.

    Attributes:
        accumulation_steps: Micro-batches (steps) per optimizer update.
        global_clipnorm: Clip the all-reduced gradient to this global norm, or None.
        bucket_bytes: Bytes per gradient all-reduce bucket; None, one packed all-reduce.
        gradient_compression: ``"bf16"`` / ``"fp16"``: all-reduce dense gradients in it.
        remat: Recompute activations in the backward pass.
        jit_compile: Compile the model's forward and backward pass with XLA (decided).
        sync_batchnorm: BatchNormalization statistics over all replicas' examples.
        global_load_balancing: Mixture-of-experts load-balancing losses over the whole
            batch's tokens.
        precision: The decided mixed precision.
        shard_optimizer_state: Keep each optimizer slot once, one shard per replica (ZeRO
            stage 1, ``training/sharding.py``).
    """

    accumulation_steps: int = 1
    global_clipnorm: float | None = None
    bucket_bytes: int | None = None
    gradient_compression: Compression | None = None
    remat: bool = False
    jit_compile: bool = False
    sync_batchnorm: bool = False
    global_load_balancing: bool = False
    precision: Precision = field(default_factory=lambda: resolve_precision(None))
    shard_optimizer_state: bool = False


def decide(options: Options, compiled_jit: bool = False) -> Decided:
    """The :class:`Decided` form of checked ``options``.

    Args:
        options: The user's options.
        compiled_jit: What ``compile()`` decided for XLA (``model.jit_compile``), taken
            where ``options.jit_compile`` is None.
    """
    return Decided(
        accumulation_steps=options.accumulation_steps,
        global_clipnorm=options.global_clipnorm,
        bucket_bytes=options.bucket_bytes,
        gradient_compression=check_compression(options.gradient_compression),
        remat=options.remat,
        jit_compile=compiled_jit if options.jit_compile is None else options.jit_compile,
        sync_batchnorm=options.sync_batchnorm,
        global_load_balancing=options.global_load_balancing,
        precision=resolve_precision(options.mixed_precision),
        shard_optimizer_state=options.shard_optimizer_state,
    )


def resolve_strategy(model: Any, strategy: tf.distribute.Strategy | None) -> Any:
    """The strategy to train with: ``strategy_in_effect`` (explicit, the active scope's, the
    model's own), else ``tfscale.choose_strategy()`` over every device.

    Raises:
        TrainingError: ``strategy`` is neither None nor a ``tf.distribute.Strategy`` (a
            ``StrategyChoice`` or a name).
    """
    from tfscale.strategy import choose_strategy, strategy_in_effect

    if strategy is not None and not isinstance(strategy, tf.distribute.Strategy):
        given = type(strategy).__name__
        fix = (
            "strategy=choice.strategy, where choice = tfscale.choose_strategy()"
            if hasattr(strategy, "strategy")
            else "strategy=tf.distribute.MirroredStrategy(), or leave strategy=None: "
            "tfscale.choose_strategy() decides"
        )
        raise TrainingError(
            explain(
                "strategy= takes a tf.distribute.Strategy.",
                received=f"strategy={strategy!r} ({given})",
                allowed="None, or a tf.distribute.Strategy object",
                fix=fix,
            )
        )

    found = strategy_in_effect(model, strategy)
    return found if found is not None else choose_strategy().strategy
