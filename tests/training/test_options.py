"""``tfscale.Options``: every option defined once, and every entry's keyword arguments made
from its fields (#37.4): the same names, defaults, checks and messages however an option is
given, and an option an entry does not honour refused by name."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import tfscale
from tfscale.training.coordinator import (
    _REFUSED,
    HONOURED,
    fit_with_coordinator,
    refuse_unsupported,
)
from tfscale.training.loop import loop_state
from tfscale.training.options import Decided, Entry, decide, spec
from tfscale.training.prepare import prepared

from .helpers import DATA, strategy_for, tiny_model

pytestmark = pytest.mark.tf

FIELDS = [f.name for f in dataclasses.fields(tfscale.Options)]
UPDATE = ["accumulation_steps", "global_clipnorm", "bucket_bytes", "gradient_compression"]

# What each entry honours, written out here so that a wrong Spec.entries fails.
HONOURS: dict[Entry, list[str]] = {
    Entry.FIT: FIELDS,
    Entry.PREPARE: FIELDS,
    Entry.TRAINER: [n for n in FIELDS if n != "shard_optimizer_state"],
    Entry.PREPARE_LOOP: [*UPDATE, "shard_optimizer_state"],
    Entry.PARAMETER_SERVER: [],
}
ENTRIES: dict[Entry, Any] = {
    Entry.FIT: tfscale.fit,
    Entry.PREPARE: tfscale.prepare,
    Entry.TRAINER: tfscale.Trainer,
    Entry.PREPARE_LOOP: tfscale.prepare_loop,
}

# Every option set away from its default (NumPy numbers and alias names included), the
# same values normalized, and a value each option refuses.
SET = {
    "accumulation_steps": np.int64(2),
    "global_clipnorm": np.float32(1.5),
    "mixed_precision": "mixed_bfloat16",
    "remat": np.bool_(True),
    "jit_compile": False,
    "sync_batchnorm": True,
    "global_load_balancing": np.bool_(True),
    "bucket_bytes": np.int32(4096),
    "gradient_compression": "bf16",
    "shard_optimizer_state": True,
}
NORMALIZED = {
    "accumulation_steps": 2,
    "global_clipnorm": 1.5,
    "mixed_precision": "bf16",
    "remat": True,
    "jit_compile": False,
    "sync_batchnorm": True,
    "global_load_balancing": True,
    "bucket_bytes": 4096,
    "gradient_compression": "bf16",
    "shard_optimizer_state": True,
}
BAD = {
    "accumulation_steps": 0,
    "global_clipnorm": -1.0,
    "mixed_precision": "int8",
    "remat": "all",
    "jit_compile": "yes",
    "sync_batchnorm": 1,
    "global_load_balancing": "global",
    "bucket_bytes": 0,
    "gradient_compression": "int4",
    "shard_optimizer_state": "yes",
    "clipnorm": 1.0,
}


def test_every_option_has_a_default_doc_check_and_its_entries() -> None:
    assert sorted(SET) == sorted(FIELDS) and sorted(BAD) == sorted([*FIELDS, "clipnorm"])
    assert set(HONOURS) == set(Entry)
    for name in FIELDS:
        assert spec(name).doc and spec(name).entries == {e for e in Entry if name in HONOURS[e]}
        assert f"\n        {name}: " in (tfscale.Options.__doc__ or "")


def test_options_are_checked_normalized_and_frozen() -> None:
    options = tfscale.Options(**SET)
    assert dataclasses.asdict(options) == NORMALIZED
    assert type(options.accumulation_steps) is int and type(options.remat) is bool
    assert options == tfscale.Options(**NORMALIZED) and hash(options) == hash(
        tfscale.Options(**NORMALIZED)
    )
    assert tfscale.Options(jit_compile="auto").jit_compile is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.remat = False  # type: ignore[misc]


@pytest.mark.parametrize("entry", list(ENTRIES), ids=lambda e: e.name)
def test_each_entrys_keywords_are_the_fields_it_honours_with_their_defaults(entry: Entry) -> None:
    parameters = list(inspect.signature(ENTRIES[entry]).parameters.values())
    names = [p.name for p in parameters]
    at = names.index("options")
    assert parameters[at].default is None and parameters[at].kind is inspect.Parameter.KEYWORD_ONLY
    shorthand = parameters[at + 1 : at + 1 + len(HONOURS[entry])]
    assert [p.name for p in shorthand] == HONOURS[entry]
    defaults = tfscale.Options()
    for parameter in shorthand:
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
        assert parameter.default == getattr(defaults, parameter.name)
    # No option is spelled anywhere else in the signature, or the old refused name.
    assert not set(names[:at] + names[at + 1 + len(HONOURS[entry]) :]) & {*FIELDS, "clipnorm"}
    # The docstring documents options= and each honoured option once, and no other.
    entry_point = ENTRIES[entry].__init__ if entry is Entry.TRAINER else ENTRIES[entry]
    doc = entry_point.__doc__ or ""
    assert "options: A ``tfscale.Options``" in doc
    for name in FIELDS:
        assert doc.count(f"\n            {name}: ") + doc.count(f"\n        {name}: ") == (
            name in HONOURS[entry]
        ), name


def test_the_parameter_server_loop_honours_the_fields_it_says_and_refuses_the_others() -> None:
    assert sorted(HONOURED & set(FIELDS)) == HONOURS[Entry.PARAMETER_SERVER]
    assert "options" in HONOURED
    for name in FIELDS:
        if name not in HONOURED:
            unused, fix = _REFUSED[name]
            assert getattr(tfscale.Options(), name) in unused and fix
    # tfscale.fit's signature (fields included) is what the coordinator loop judges.
    fit_arguments = set(inspect.signature(tfscale.fit).parameters)
    assert fit_arguments >= set(FIELDS) and fit_arguments <= HONOURED | set(_REFUSED)


@pytest.mark.parametrize("name", FIELDS)
def test_an_option_in_options_is_refused_under_parameter_server_as_its_keyword(name: str) -> None:
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    data = (np.zeros((8, 2), "float32"), np.zeros((8, 1), "float32"))
    value = True if name == "jit_compile" else NORMALIZED[name]  # False: unused, no XLA there
    messages = []
    for given in ({name: value}, {"options": tfscale.Options(**{name: value})}):
        with pytest.raises(tfscale.TrainingError, match=f"does not support: {name}") as info:
            fit_with_coordinator(model, data, strategy=None, **given)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    refuse_unsupported({"options": tfscale.Options()})  # all unused: nothing refused


def _prepare(**given: Any) -> Decided:
    model = tiny_model(strategy_for(2))
    tfscale.prepare(model, strategy_for(2), **given)
    state = prepared(model)
    assert state is not None
    return state.options


def _fit(**given: Any) -> Decided:
    model = tiny_model(strategy_for(2))
    tfscale.fit(model, *DATA, epochs=0, verbose=0, strategy=strategy_for(2), **given)
    state = prepared(model)
    assert state is not None
    return state.options


def _trainer(**given: Any) -> Decided:
    trainer = tfscale.Trainer(tiny_model(strategy_for(2)), strategy_for(2), **given)
    state = prepared(trainer.model)
    assert state is not None
    return state.options


def _loop(**given: Any) -> Decided:
    model = tiny_model(strategy_for(2))
    optimizer = tfscale.prepare_loop(model, strategy=strategy_for(2), **given)
    state = loop_state(optimizer)
    assert state is not None
    return state.update.options  # type: ignore[no-any-return]


DECIDED: dict[Entry, Callable[..., Decided]] = {
    Entry.FIT: _fit,
    Entry.PREPARE: _prepare,
    Entry.TRAINER: _trainer,
    Entry.PREPARE_LOOP: _loop,
}


@pytest.mark.parametrize("entry", list(DECIDED), ids=lambda e: e.name)
def test_options_and_shorthand_decide_the_same(entry: Entry) -> None:
    honoured = {name: SET[name] for name in HONOURS[entry]}
    shorthand = DECIDED[entry](**honoured)
    given = DECIDED[entry](options=tfscale.Options(**honoured))
    half = dict(list(honoured.items())[::2])
    rest = {k: v for k, v in honoured.items() if k not in half}
    mixed = DECIDED[entry](options=tfscale.Options(**half), **rest)
    assert shorthand == given == mixed == decide(tfscale.Options(**honoured))
    assert shorthand != DECIDED[entry]()  # every honoured option reached the decided form
    assert shorthand.accumulation_steps == 2 and shorthand.global_clipnorm == 1.5


def _call(entry: Entry, model: Any, **given: Any) -> Any:
    """``entry`` called on ``model`` with ``given``."""
    if entry is Entry.FIT:
        return tfscale.fit(model, *DATA, verbose=0, strategy=strategy_for(2), **given)
    if entry is Entry.PREPARE_LOOP:
        return tfscale.prepare_loop(model, strategy=strategy_for(2), **given)
    return ENTRIES[entry](model, strategy_for(2), **given)


def _refused(entry: Entry, **given: Any) -> str:
    """The message of ``entry``'s refusal of ``given``, which left the model untouched."""
    model = tiny_model(strategy_for(2))
    before = model.get_weights()
    with pytest.raises(tfscale.TrainingError) as info:
        _call(entry, model, **given)
    assert prepared(model) is None and loop_state(model.optimizer) is None
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))
    return str(info.value)


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_is_refused_with_the_same_message_whichever_way_it_is_given(
    name: str,
) -> None:
    with pytest.raises(tfscale.TrainingError) as info:
        tfscale.Options(**{name: BAD[name]})
    message = str(info.value)
    assert f"{name}=" in message or repr(BAD[name]) in message
    for entry in ENTRIES:
        if name == "clipnorm" or name in HONOURS[entry]:
            assert _refused(entry, **{name: BAD[name]}) == message, entry


def test_an_option_an_entry_does_not_honour_is_refused_by_name_before_any_work() -> None:
    for entry, name in (
        (Entry.PREPARE_LOOP, "remat"),
        (Entry.PREPARE_LOOP, "mixed_precision"),
        (Entry.TRAINER, "shard_optimizer_state"),
    ):
        message = _refused(entry, **{name: SET[name]})
        assert message == _refused(entry, options=tfscale.Options(**{name: SET[name]}))
        honouring = ", ".join(e.value for e in Entry if name in HONOURS[e])
        assert message.startswith(f"{entry.value} does not honour: {name}.")
        assert f"{name}: honoured by {honouring}" in message
    # Values that leave an option unused are no reason to refuse.
    _call(Entry.PREPARE_LOOP, tiny_model(strategy_for(2)), remat=False, jit_compile=False)
    _call(
        Entry.TRAINER,
        tiny_model(strategy_for(2)),
        options=tfscale.Options(shard_optimizer_state=False),
    )


def test_a_keyword_that_contradicts_options_is_refused_and_one_that_agrees_is_taken() -> None:
    twice = _refused(
        Entry.PREPARE, options=tfscale.Options(accumulation_steps=2), accumulation_steps=3
    )
    assert "set twice" in twice
    assert "accumulation_steps=3 and options.accumulation_steps=2" in twice
    assert "remat=False and options.remat=True" in _refused(
        Entry.PREPARE, options=tfscale.Options(remat=True), remat=False
    )
    # The same value again, or an option options= leaves at its default: taken.
    model = tiny_model(strategy_for(2))
    _call(
        Entry.PREPARE,
        model,
        options=tfscale.Options(accumulation_steps=2),
        accumulation_steps=np.int64(2),
        remat=True,
    )
    state = prepared(model)
    assert state is not None and state.options.accumulation_steps == 2 and state.options.remat
    assert "options= takes a tfscale.Options" in _refused(
        Entry.PREPARE, options={"accumulation_steps": 2}
    )
    with pytest.raises(TypeError, match="unexpected keyword argument 'acumulation_steps'"):
        _call(Entry.PREPARE, tiny_model(strategy_for(2)), acumulation_steps=2)


def test_the_table_in_the_training_guide_is_the_fields() -> None:
    guide = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    section = guide.split("### One set of options: `tfscale.Options`")[1].split("\n#")[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    columns = {
        Entry.FIT: 3,
        Entry.PREPARE: 3,
        Entry.TRAINER: 4,
        Entry.PREPARE_LOOP: 5,
        Entry.PARAMETER_SERVER: 6,
    }
    assert [row.split("`")[1] for row in rows] == FIELDS
    for row, name in zip(rows, FIELDS, strict=True):
        cells = [cell.strip() for cell in row.split("|")]
        assert cells[2].split(" ")[0] == repr(getattr(tfscale.Options(), name)), row
        for entry, column in columns.items():
            assert cells[column] == ("yes" if name in HONOURS[entry] else "refused"), row
