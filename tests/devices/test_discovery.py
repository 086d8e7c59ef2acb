"""Device discovery and virtual devices: the session's 4 logical CPUs, and fresh processes."""

from __future__ import annotations

import pytest

import tfscale
from tfscale.testing import run_python


@pytest.mark.tf
def test_discover_lists_physical_cpu_and_four_logical_cpus() -> None:
    infos = tfscale.discover_devices()
    physical = [i for i in infos if i.physical]
    logical = [i for i in infos if not i.physical and i.kind == "CPU"]
    assert [i.kind for i in physical] == ["CPU"]
    assert physical[0].memory_bytes and physical[0].memory_bytes > 2**30
    assert [i.name for i in logical] == [f"/device:CPU:{n}" for n in range(4)]


@pytest.mark.tf
def test_same_configuration_again_is_harmless() -> None:
    assert tfscale.use_virtual_devices(4) == [f"/device:CPU:{i}" for i in range(4)]


@pytest.mark.tf
def test_reconfiguring_after_start_is_a_clear_error() -> None:
    tfscale.discover_devices()  # the runtime has started
    with pytest.raises(tfscale.DeviceConfigError, match="already started") as info:
        tfscale.use_virtual_devices(3)
    assert "TFSCALE_VIRTUAL_DEVICES=3" in str(info.value)


@pytest.mark.tf
@pytest.mark.parametrize("bad", [0, -1, 2.5, "2", True, 65, 1000])
def test_bad_counts_are_refused(bad: object) -> None:
    with pytest.raises(tfscale.DeviceConfigError, match="an integer from 1 to 64") as info:
        tfscale.use_virtual_devices(bad)  # type: ignore[arg-type]
    assert f"Received: n={bad!r}" in str(info.value)


@pytest.mark.tf
def test_absent_gpu_is_refused_with_what_is_present() -> None:
    with pytest.raises(tfscale.DeviceConfigError, match="No physical GPU") as info:
        tfscale.use_virtual_devices(2, "GPU", memory_limit_mb=512)
    assert "CPU" in str(info.value)


@pytest.mark.tf
def test_unknown_kind_is_refused() -> None:
    with pytest.raises(tfscale.DeviceConfigError, match="Unknown device kind"):
        tfscale.use_virtual_devices(2, "QPU")


@pytest.mark.multiprocess
def test_environment_variable_splits_before_start_and_bad_value_is_clear() -> None:
    result = run_python(
        """
        import tfscale, tensorflow as tf
        print(len(tf.config.list_logical_devices("CPU")))
        """,
        virtual_devices=3,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "3"
    bad = run_python("import tfscale", env={"TFSCALE_VIRTUAL_DEVICES": "two"}, timeout=120)
    assert bad.returncode != 0
    assert "DeviceConfigError" in bad.stderr and "'two'" in bad.stderr
