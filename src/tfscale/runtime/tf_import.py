"""What happens when this process imports TensorFlow, set up before it does.

Two things must happen at TensorFlow's import and not later: its start-up chatter is held
back (``chatter.py``; it is printed while the module loads), and the logical devices
``TFSCALE_VIRTUAL_DEVICES`` asks for are configured (before any op starts the runtime). A
finder at the front of ``sys.meta_path`` loads the ``tensorflow`` module with both, so that
``import tfscale`` itself never imports TensorFlow (the launcher and the command line's parser
stay fast) and the first ``import tensorflow``, wherever it comes from, is the right one.
TensorFlow-free.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from tfscale.runtime import chatter

__all__ = ["on_import", "on_keras_import"]

# Module -> what runs once it has finished importing. Keras imports TensorFlow while it is
# itself half imported, so what needs Keras waits for Keras's own import to finish.
_AFTER: dict[str, list[Callable[[], Any]]] = {"tensorflow": [], "keras": []}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._inner.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        if self._name == "tensorflow" and chatter.quiet():
            with chatter.quiet_stderr():
                self._inner.exec_module(module)
            chatter.quiet_python_loggers()
        else:
            self._inner.exec_module(module)
        waiting = _AFTER[self._name]
        while waiting:
            waiting.pop(0)()


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``tensorflow`` and ``keras`` as the other finders do, and loads them through
    :class:`_Loader`."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _AFTER:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


def _install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def on_import(then: Callable[[], Any] | None = None) -> None:
    """Arranges this process's ``import tensorflow`` (quiet if ``chatter.quiet()``), and
    ``then`` right after it; if TensorFlow is already imported, ``then`` runs now."""
    if "tensorflow" in sys.modules:
        if chatter.quiet():
            chatter.quiet_python_loggers()
        if then is not None:
            then()
        return
    if then is not None:
        _AFTER["tensorflow"].append(then)
    _install()


def on_keras_import(then: Callable[[], Any]) -> None:
    """Runs ``then`` once Keras has finished importing (now, if it has)."""
    keras = sys.modules.get("keras")
    if keras is not None and hasattr(keras, "Model"):
        then()
        return
    _AFTER["keras"].append(then)
    _install()
