"""Which of a module's tests the session runs, for a module fixture that starts a job (or
trains a case) per test: ``make test`` deselects the ``full`` variants (tests/README.md),
whose jobs then are not started (the launched and elastic jobs here, the parameter-server
cases of tests/training/test_coordinator_train_step.py)."""

from __future__ import annotations

import pytest


def selected_tests(request: pytest.FixtureRequest) -> list[pytest.Function]:
    """The tests of the requesting module that this session runs (after ``-m`` and ``-k``;
    under ``--dist loadgroup`` the module's xdist_group keeps them all in this process)."""
    return [
        item
        for item in request.session.items
        if isinstance(item, pytest.Function) and item.module is request.module
    ]


def selected_param(request: pytest.FixtureRequest, name: str) -> set[str]:
    """The values of the parameter ``name`` among :func:`selected_tests`."""
    return {
        str(item.callspec.params[name])
        for item in selected_tests(request)
        if hasattr(item, "callspec") and name in item.callspec.params
    }
