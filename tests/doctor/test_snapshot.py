"""The snapshot: JSON round trip, the real probe on this machine, failures recorded."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tfscale.doctor.checks import CHECKS, run_checks
from tfscale.doctor.snapshot import Snapshot, take_snapshot

from . import fakes


@pytest.mark.parametrize("scenario", sorted(fakes.SCENARIOS))
def test_json_round_trip(scenario: str) -> None:
    snapshot = fakes.SCENARIOS[scenario]()
    again = Snapshot.from_dict(json.loads(json.dumps(snapshot.to_dict())))
    assert again == snapshot


def test_from_dict_rejects_unknown_fields() -> None:
    data = fakes.four_gpus().to_dict()
    data["gpus"] = 4
    with pytest.raises(ValueError, match="not snapshot fields: gpus"):
        Snapshot.from_dict(data)


# take_snapshot imports TensorFlow in this process (it passed unmarked only where an earlier
# test of the same process had imported it; alone, the import gate made its probe fail).
@pytest.mark.tf
@pytest.mark.multiprocess
def test_real_snapshot_of_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    snapshot = take_snapshot()
    assert snapshot.tensorflow_version and snapshot.tensorflow_version.startswith("2.")
    assert snapshot.keras_version and snapshot.keras_version.startswith("3.")
    assert snapshot.cuda_visible_devices == "0"
    assert snapshot.tf_config is None
    assert snapshot.xla_available is not None
    # The strategy module's decision, on this pytest process's 4 logical CPU devices.
    assert snapshot.strategy is not None, snapshot.strategy_error
    assert (snapshot.strategy.kind, snapshot.strategy.replicas) == ("MirroredStrategy", 4)
    assert Snapshot.from_dict(json.loads(json.dumps(snapshot.to_dict()))) == snapshot
    results = run_checks(snapshot)
    assert [r.name for r in results] == [c(snapshot).name for c in CHECKS]
    # This machine has no usable GPU: nothing may fail, whatever the probes found.
    assert [r for r in results if r.status == "fail"] == []


@pytest.mark.tf  # take_snapshot imports TensorFlow here
@pytest.mark.multiprocess
def test_failing_probe_is_recorded_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\necho 'Unable to determine the device handle for GPU0'\nexit 15\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    snapshot = take_snapshot()
    assert snapshot.driver_source is None
    assert "exited with 15: Unable to determine" in snapshot.errors["driver"]
    verdict = {r.name: r for r in run_checks(snapshot)}["gpu-visibility"]
    assert verdict.status == "warn" and "Unable to determine" in verdict.message
