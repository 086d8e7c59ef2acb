"""Names a package loads on first use (PEP 562), so that importing it imports no TensorFlow.

``tfscale``, ``tfscale.strategy`` and ``tfscale.training`` each map a public name to the
module that defines it; the name is imported the first time it is read, then kept.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str, names: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose globals are ``namespace``:
    ``names`` maps each public name to the module defining it."""

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module hook's own name
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:  # noqa: N807
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
