"""`tfscale demo`: the main job trains to >= 90% test accuracy on 2 logical CPUs."""

from __future__ import annotations

import pytest

from tfscale.runtime.chatter import is_chatter
from tfscale.testing import run_python

pytestmark = pytest.mark.multiprocess


def test_demo_trains_to_90_percent_on_two_logical_cpus() -> None:
    result = run_python(
        "import sys; from tfscale.cli.main import main; sys.exit(main(['demo', '--epochs', '3']))",
        # As for a user (TensorFlow's defaults): no start-up chatter, oneDNN's notice included.
        env={"TF_CPP_MIN_LOG_LEVEL": "", "TF_ENABLE_ONEDNN_OPTS": ""},
        timeout=300,
    )
    lines = (result.stdout + result.stderr).splitlines()
    assert not [line for line in lines if is_chatter(line) or "oneDNN" in line]
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "MirroredStrategy with 2 replica(s)" in result.stdout
    line = next(s for s in result.stdout.splitlines() if s.startswith("test accuracy"))
    assert float(line.split()[2]) >= 0.9 and "examples/s" in line
