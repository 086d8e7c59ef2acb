"""TaskPool with the Ray backend: the equivalence test, where Ray is installed."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from tfscale.tasks import TaskPool, current_device

# CI (`make test`, which installs the ray extra) must run this test: there a missing Ray is a
# failure, not a skip. Elsewhere the extra is optional.
_MISSING = importlib.util.find_spec("ray") is None
if _MISSING and os.environ.get("CI"):
    raise ImportError('ray is not installed in CI: `make venv` installs the "ray" extra')

pytestmark = [
    pytest.mark.ray,
    pytest.mark.tf,
    pytest.mark.multiprocess,
    pytest.mark.skipif(_MISSING, reason='ray is not installed (pip install "tfscale[ray]")'),
]


def _square_sum(x: np.ndarray) -> tuple[float, str | None]:
    import tensorflow as tf

    return float(tf.reduce_sum(tf.square(tf.constant(x)))), current_device()


def test_ray_map_equals_the_loop(cpu_devices: list[str]) -> None:
    import tensorflow as tf

    rng = np.random.default_rng(3)
    items = [rng.standard_normal(100).astype(np.float32) for _ in range(16)]
    expected = [float(tf.reduce_sum(tf.square(tf.constant(x)))) for x in items]
    with TaskPool(cpu_devices, backend="ray") as pool:
        results = list(pool.map(_square_sum, items, chunksize=1))
        stats = pool.stats()
    assert [r[0] for r in results] == expected
    assert {r[1] for r in results} <= set(cpu_devices)
    assert stats.tasks == len(items)
