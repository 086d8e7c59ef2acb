"""The doctor's probes: nvidia-smi parsing and fallback, CUDA library search."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from tfscale.doctor.probes import (
    find_cuda_libraries,
    library_from_filename,
    parse_nvidia_smi_xml,
    probe_driver,
)

from .fakes import H100_XML


def test_parses_nvidia_smi_xml_of_four_h100() -> None:
    driver, cuda, gpus = parse_nvidia_smi_xml(H100_XML.read_text())
    assert (driver, cuda) == ("550.90.07", "12.4")
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert {g.name for g in gpus} == {"NVIDIA H100 80GB HBM3"}
    assert {g.memory_mib for g in gpus} == {81559}
    assert gpus[0].uuid == "GPU-5b1d2c3e-8f47-4a6b-9c2d-1e0f3a4b5c6d"
    assert [g.pci_bus_id for g in gpus] == [
        "00000000:18:00.0",
        "00000000:2A:00.0",
        "00000000:3A:00.0",
        "00000000:5D:00.0",
    ]


@pytest.mark.parametrize(
    "text", ["", "NVIDIA-SMI has failed", "<other/>", "<nvidia_smi_log><gpu></nvidia_smi_log>"]
)
def test_rejects_what_is_not_nvidia_smi_xml(text: str) -> None:
    with pytest.raises(ValueError, match="nvidia-smi -q -x"):
        parse_nvidia_smi_xml(text)


def test_gpu_with_memory_not_available() -> None:
    text = (
        "<nvidia_smi_log><driver_version>550.90.07</driver_version><gpu id='0'>"
        "<product_name>X</product_name><fb_memory_usage><total>N/A</total></fb_memory_usage>"
        "</gpu></nvidia_smi_log>"
    )
    _, cuda, gpus = parse_nvidia_smi_xml(text)
    assert cuda is None and gpus[0].memory_mib is None


@pytest.mark.parametrize(
    ("filename", "name", "version"),
    [
        ("libcudart.so.12", "cudart", "12"),
        ("libcudart.so.12.4.127", "cudart", "12.4.127"),
        ("libcudnn.so.9.1.0", "cudnn", "9.1.0"),
        ("libnccl.so.2", "nccl", "2"),
        ("libcudart.so", None, None),
        ("libcudnn_ops.so.9", None, None),
        ("libcudart_static.a", None, None),
    ],
)
def test_library_version_from_file_name(
    filename: str, name: str | None, version: str | None
) -> None:
    library = library_from_filename(f"/x/{filename}")
    assert (library and (library.name, library.version)) == ((name, version) if name else None)


def _touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")


def test_finds_libraries_in_pip_packages_and_library_path(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    _touch(site / "nvidia/cuda_runtime/lib/libcudart.so.12")
    _touch(site / "nvidia/cudnn/lib/libcudnn.so.9")
    _touch(site / "nvidia/nccl/lib/libnccl.so.2")
    system = tmp_path / "cuda-11.8/lib64"
    _touch(system / "libcudart.so.11.0")
    _touch(system / "libcudart.so.11.8.89")  # the more precise name of the same library
    found = find_cuda_libraries(
        {"LD_LIBRARY_PATH": f"{system}{os.pathsep}{tmp_path / 'absent'}"},
        [str(site)],
        use_ldconfig=False,
    )
    mine = {(lib.name, lib.version) for lib in found if lib.path.startswith(str(tmp_path))}
    assert mine == {("cudart", "12"), ("cudnn", "9"), ("nccl", "2"), ("cudart", "11.8.89")}


def _fake_nvidia_smi(folder: Path, body: str) -> None:
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def fake_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder first on PATH; NVML is absent on this machine, so nvidia-smi is asked."""
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


@pytest.mark.multiprocess
def test_driver_falls_back_to_nvidia_smi(fake_bin: Path) -> None:
    _fake_nvidia_smi(fake_bin, f"cat '{H100_XML}'")
    report = probe_driver()
    assert report.source == "nvidia-smi"
    assert (report.driver_version, report.cuda_driver_version) == ("550.90.07", "12.4")
    assert len(report.gpus) == 4


@pytest.mark.multiprocess
def test_failing_nvidia_smi_is_reported(fake_bin: Path) -> None:
    _fake_nvidia_smi(
        fake_bin,
        'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."'
        "\nexit 9",
    )
    with pytest.raises(RuntimeError, match="exited with 9: NVIDIA-SMI has failed"):
        probe_driver()


@pytest.mark.multiprocess
def test_hung_nvidia_smi_times_out(fake_bin: Path) -> None:
    _fake_nvidia_smi(fake_bin, "exec sleep 30")
    with pytest.raises(RuntimeError, match=r"did not answer within 0\.5 s"):
        probe_driver(nvidia_smi_timeout=0.5)


class _FakeNvml:
    """The part of ``pynvml`` the probe uses, for 2 GPUs of an older driver (bytes names)."""

    def __init__(self) -> None:
        self.open = False

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self.open = True

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.open = False

    def nvmlSystemGetDriverVersion(self) -> bytes:  # noqa: N802
        return b"535.183.01"

    def nvmlSystemGetCudaDriverVersion(self) -> int:  # noqa: N802
        return 12020

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes:  # noqa: N802
        return b"NVIDIA A100-SXM4-40GB"

    def nvmlDeviceGetUUID(self, handle: int) -> str:  # noqa: N802
        return f"GPU-0000000{handle}-aaaa-bbbb-cccc-dddddddddddd"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> object:  # noqa: N802
        return type("Memory", (), {"total": 40960 * 2**20})()

    def nvmlDeviceGetPciInfo(self, handle: int) -> object:  # noqa: N802
        return type("Pci", (), {"busId": f"00000000:0{handle + 7}:00.0".encode()})()


def test_driver_read_through_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    report = probe_driver()
    assert (report.source, report.driver_version, report.cuda_driver_version) == (
        "nvml",
        "535.183.01",
        "12.2",
    )
    assert [(g.index, g.name, g.memory_mib, g.pci_bus_id) for g in report.gpus] == [
        (0, "NVIDIA A100-SXM4-40GB", 40960, "00000000:07:00.0"),
        (1, "NVIDIA A100-SXM4-40GB", 40960, "00000000:08:00.0"),
    ]
    assert not fake.open  # NVML shut down again
