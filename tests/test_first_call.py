"""``import tfscale`` and then any first public call, with ``TFSCALE_VIRTUAL_DEVICES`` set.

The import hook applies the variable the moment TensorFlow has finished importing, which may
be while the tfscale module of that first call is itself importing TensorFlow. It used to
import ``tfscale.devices.discovery`` there, and a first call to ``discover_devices`` or
``use_virtual_devices`` (whose module was half imported) failed with "cannot import name
'apply_env_virtual_devices' from partially initialized module 'tfscale.devices.discovery'" (#21.4).
Each first call runs in a fresh process: only the first import of TensorFlow shows it.
``make test`` runs the names that are called (``_CALLS``); the look-ups of the other public
modules run in ``make test-full`` (a child process each, 2 CPU-s of TensorFlow start-up), the
same hook at the same first import being the ``fit`` case's.
"""

from __future__ import annotations

import pytest

import tfscale
from tfscale.testing import run_python

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

_MODEL = """
import keras, numpy as np
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
model.compile("sgd", "mse")
x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
"""

# Public name -> the first call made with it (after `entry = tfscale.<name>`, which imports
# its module). Names not listed are only looked up, which is what imports TensorFlow.
_CALLS = {
    "discover_devices": "assert entry()",
    "use_virtual_devices": "assert entry(2) == ['/device:CPU:0', '/device:CPU:1']",
    "choose_strategy": "assert entry().num_replicas == 2",
    "fit": _MODEL + "entry(model, x, y, epochs=1, verbose=0)",
    "prepare": _MODEL + "entry(model).fit(x, y, epochs=1, verbose=0)",
    "check_scope": _MODEL + "entry(model)",
    "TaskPool": "with entry() as pool:\n    assert pool.submit(lambda: 1).result(60) == 1",
    "pipeline": _MODEL + "entry(model, ['/device:CPU:0', '/device:CPU:1'], microbatches=2)",
}


_LOOKUP_EQUIVALENT = (
    "tests/test_first_call.py::test_first_public_call_with_virtual_devices_in_the_environment[fit]"
)


# `make test` calls fit first in a fresh process (the entry a training script starts with);
# the other called names, prepare among them, run in `make test-full`, naming fit's (the same
# import hook splits the CPU before TensorFlow's runtime starts, whichever name is called
# first).
_IN_MAKE_TEST = ("fit",)
_CALLED_ELSEWHERE = pytest.mark.full(_LOOKUP_EQUIVALENT)


def _first_calls() -> list[object]:
    """Every name of `_CALLS`, and one name for each other module of tfscale's public API
    (``full``: a look-up only)."""
    names: list[object] = [
        name if name in _IN_MAKE_TEST else pytest.param(name, id=name, marks=_CALLED_ELSEWHERE)
        for name in _CALLS
    ]
    covered = {tfscale._LAZY[name] for name in _CALLS}
    for name, module in sorted(tfscale._LAZY.items()):
        if module not in covered:
            names.append(pytest.param(name, id=name, marks=pytest.mark.full(_LOOKUP_EQUIVALENT)))
            covered.add(module)
    return names


@pytest.mark.parametrize("name", _first_calls())
def test_first_public_call_with_virtual_devices_in_the_environment(name: str) -> None:
    call = _CALLS.get(name, "")
    code = (
        f"import sys, tfscale\nentry = tfscale.{name}\n{call}\n"
        "if 'tensorflow' in sys.modules:\n"
        "    import tensorflow as tf\n"
        "    print('logical CPUs:', len(tf.config.list_logical_devices('CPU')))\n"
    )
    result = run_python(code, virtual_devices=2, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    # Every call starts TensorFlow (a bare lookup may not): then it has the 2 devices asked for.
    if name in _CALLS or "logical CPUs:" in result.stdout:
        assert result.stdout.strip().splitlines()[-1] == "logical CPUs: 2", result.stdout
