"""The entries' option keyword arguments, made from the fields of :class:`Options`.

An entry is written with one keyword-only ``options`` parameter and decorated with
:func:`takes_options`, which gives it, from the fields of ``Options`` that it honours
(``Spec.entries``), its keyword arguments (``__signature__``, which ``help()``,
``inspect.signature`` and IDEs read) and their lines in its docstring's ``Args:``; each call's
keywords become one ``Options`` handed to the entry. So the list of options exists once::

    tfscale.prepare(model, accumulation_steps=4, mixed_precision="bf16")
        -> prepare(model, options=Options(accumulation_steps=4, mixed_precision="bf16"))
    tfscale.prepare(model, options=Options(remat=True), accumulation_steps=4)
        -> prepare(model, options=Options(remat=True, accumulation_steps=4))

The static type of an entry is ``Callable[..., R]``: a type checker accepts the keywords
(it cannot read a signature made at import), and the values are checked when the
``Options`` is made.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from tfscale.errors import TrainingError, explain
from tfscale.training.options import Entry, Options, doc_lines, option_fields, spec

__all__ = ["KEYWORDS", "options_for", "refuse_unhonoured", "takes_options"]

R = TypeVar("R")

#: Every keyword an entry turns into its Options: the fields, and the refused ``clipnorm``.
KEYWORDS = frozenset(inspect.signature(Options).parameters)


def refuse_unhonoured(entry: Entry, options: Options) -> None:
    """Raises, before any work, for the options set in ``options`` that ``entry`` does not
    honour (``Spec.entries``), naming each and the entries that do.

    Raises:
        TrainingError: At least one such option.
    """
    refused = [
        (each.name, getattr(options, each.name))
        for each in option_fields()
        if entry not in spec(each.name).entries
        and getattr(options, each.name) not in spec(each.name).unused
    ]
    if not refused:
        return
    lines = "".join(
        f"\n    {name}: honoured by " + ", ".join(e.value for e in Entry if e in spec(name).entries)
        for name, _ in refused
    )
    raise TrainingError(
        explain(
            f"{entry.value} does not honour: {', '.join(name for name, _ in refused)}.",
            received=", ".join(f"{name}={value!r}" for name, value in refused),
            allowed=", ".join(f.name for f in option_fields() if entry in spec(f.name).entries),
            fix=f"drop {'it' if len(refused) == 1 else 'them'} here, or use an entry that "
            "honours it:" + lines,
        )
    )


def options_for(entry: Entry, options: object, given: Mapping[str, Any]) -> Options:
    """The :class:`Options` of one call of ``entry``: ``options=`` with the keyword
    shorthands ``given`` applied, checked, and refused where ``entry`` does not honour one.

    Raises:
        TrainingError: ``options`` is not an ``Options``; a value is invalid (the field's
            check: the same message as ``Options(...)``); a shorthand contradicts
            what ``options=`` sets (a field it holds away from the default); or an option
            set is not honoured by ``entry``.
    """
    if options is not None and not isinstance(options, Options):
        raise TrainingError(
            explain(
                "options= takes a tfscale.Options.",
                received=f"options={options!r} ({type(options).__name__})",
                allowed="None, or tfscale.Options(...)",
                fix="options=tfscale.Options(accumulation_steps=4), or pass the options as "
                f"keyword arguments: {entry.value}(..., accumulation_steps=4)",
            )
        )
    base = options if options is not None else Options()
    merged = dataclasses.replace(base, **given) if given else base
    if options is not None:
        # options= sets a field it holds away from the default; a keyword may add to it.
        default = Options()
        clashes = [
            n
            for n in given
            if n != "clipnorm"
            and getattr(base, n) != getattr(default, n)
            and getattr(merged, n) != getattr(base, n)
        ]
        if clashes:
            raise TrainingError(
                explain(
                    "An option was set twice, in options= and as a keyword, differently.",
                    received=", ".join(
                        f"{n}={given[n]!r} and options.{n}={getattr(base, n)!r}" for n in clashes
                    ),
                    fix="give each option once: in options=, or as a keyword argument",
                )
            )
    refuse_unhonoured(entry, merged)
    return merged


def takes_options(entry: Entry) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Gives an entry the keyword shorthand of the options it honours (see the module doc).

    The decorated function has a keyword-only ``options`` parameter and an ``Args:``
    section; it is called with a checked :class:`Options` (never None).
    """

    def decorate(function: Callable[..., R]) -> Callable[..., R]:
        signature = _signature(function, entry)

        @functools.wraps(function)
        def entry_point(*args: Any, **kwargs: Any) -> R:
            given = {name: kwargs.pop(name) for name in list(kwargs) if name in KEYWORDS}
            kwargs["options"] = options_for(entry, kwargs.pop("options", None), given)
            return function(*args, **kwargs)

        entry_point.__signature__ = signature  # type: ignore[attr-defined]
        entry_point.__doc__ = _documented(function.__doc__ or "", entry)
        return entry_point

    return decorate


def _signature(function: Callable[..., Any], entry: Entry) -> inspect.Signature:
    """``function``'s signature with ``options`` defaulting to None and, after it, one
    keyword-only parameter per option ``entry`` honours (the field's default and type)."""
    signature = inspect.signature(function)
    parameters = list(signature.parameters.values())
    names = [p.name for p in parameters]
    if "options" not in names or parameters[names.index("options")].kind is not (
        inspect.Parameter.KEYWORD_ONLY
    ):
        raise TypeError(f"{function.__qualname__} needs a keyword-only 'options' parameter")
    at = names.index("options")
    shorthand = [
        inspect.Parameter(
            each.name, inspect.Parameter.KEYWORD_ONLY, default=each.default, annotation=each.type
        )
        for each in option_fields()
        if entry in spec(each.name).entries
    ]
    parameters[at] = parameters[at].replace(default=None, annotation="Options | None")
    return signature.replace(parameters=[*parameters[: at + 1], *shorthand, *parameters[at + 1 :]])


def _documented(doc: str, entry: Entry) -> str:
    """``doc`` with the ``options`` argument and each option ``entry`` honours added at the
    end of its ``Args:`` section."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Args:"), None)
    if start is None:
        raise TypeError(f"the docstring of {entry.value} has no Args: section")
    outer = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and (len(lines[end]) - len(lines[end].lstrip()) > outer):
        end += 1
    indent = " " * (outer + 4)
    added = [
        f"{indent}options: A ``tfscale.Options``; the keyword arguments after it are its",
        f"{indent}    fields (those {entry.value} honours), as shorthand.",
        *doc_lines(entry, indent),
    ]
    return "\n".join([*lines[:end], *added, *lines[end:]])
