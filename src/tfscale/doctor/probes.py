"""The impure half of ``tfscale doctor``: each probe reads one fact from the machine.

Probes may raise; :func:`tfscale.doctor.snapshot.take_snapshot` catches each one and
records its error text, so one broken probe never hides the others. Parsers of tool output
(:func:`parse_nvidia_smi_xml`, :func:`library_from_filename`) are pure and tested on samples.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import platform
import re
import shutil
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tfscale.processes import run

__all__ = [
    "TF_DISTRIBUTIONS",
    "CudaLibrary",
    "DriverGpu",
    "DriverReport",
    "StrategyView",
    "find_cuda_libraries",
    "library_from_filename",
    "parse_nvidia_smi_xml",
    "probe_driver",
    "probe_keras_version",
    "probe_strategy",
    "probe_tensorflow",
    "probe_tensorflow_distributions",
    "probe_tf_config",
    "probe_tf_gpus",
    "python_and_platform",
]

# pip distributions that install the ``tensorflow`` package; two at once overwrite each
# other's files (the CPU-only one often wins).
TF_DISTRIBUTIONS: tuple[str, ...] = (
    "tensorflow",
    "tensorflow-cpu",
    "tensorflow-gpu",
    "tensorflow-intel",
    "tensorflow-macos",
    "tf-nightly",
    "tf-nightly-cpu",
)
_LIBRARIES = ("cudart", "cudnn", "nccl")
_LIBRARY_FILE = re.compile(r"^lib(cudart|cudnn|nccl)\.so\.(\d+(?:\.\d+)*)$")
_NVIDIA_SMI_TIMEOUT_S = 10.0
_LDCONFIG_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class DriverGpu:
    """One GPU as the NVIDIA driver (NVML or nvidia-smi) reports it.

    Attributes:
        index: Position in the driver's (PCI bus) order, which CUDA indices follow when
            ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or the GPUs are identical.
        name: Product name, e.g. ``NVIDIA H100 80GB HBM3``.
        uuid: ``GPU-…`` identifier, usable in ``CUDA_VISIBLE_DEVICES``.
        memory_mib: Total memory in MiB, None where unknown.
        pci_bus_id: PCI bus id, e.g. ``00000000:18:00.0``.
    """

    index: int
    name: str
    uuid: str
    memory_mib: int | None
    pci_bus_id: str


@dataclass(frozen=True)
class CudaLibrary:
    """A CUDA runtime, cuDNN or NCCL shared library found on the system.

    Attributes:
        name: ``"cudart"``, ``"cudnn"`` or ``"nccl"``.
        version: Version read from the file name (``libcudart.so.12.4.127`` -> ``12.4.127``).
        path: Where it was found.
    """

    name: str
    version: str
    path: str

    @property
    def major(self) -> int:
        """The major version (``12`` for ``12.4.127``)."""
        return int(self.version.split(".")[0])


@dataclass(frozen=True)
class DriverReport:
    """What the driver probe found: driver and CUDA driver versions and the GPUs."""

    source: str
    driver_version: str | None
    cuda_driver_version: str | None
    gpus: tuple[DriverGpu, ...]


@dataclass(frozen=True)
class StrategyView:
    """The strategy ``choose_strategy`` would pick, as decided without building it.

    Attributes:
        kind: Strategy class name, e.g. ``MirroredStrategy``.
        replicas: Number of replicas it would run.
        collectives: The all-reduce implementation (``NCCL``, ``RING``, ...) or None.
        reasons: Why, one sentence per rule that fired.
    """

    kind: str
    replicas: int
    collectives: str | None
    reasons: tuple[str, ...]


def python_and_platform() -> tuple[str, str, str]:
    """Returns the Python version, the platform description and the OS name."""
    return platform.python_version(), platform.platform(), platform.system()


def probe_tensorflow() -> tuple[str, dict[str, Any], bool]:
    """Imports TensorFlow; returns its version, build info and whether XLA is built in."""
    import tensorflow as tf

    build = dict(tf.sysconfig.get_build_info())
    return str(tf.__version__), build, bool(tf.test.is_built_with_xla())


def probe_tensorflow_distributions() -> tuple[str, ...]:
    """The installed pip distributions that provide ``tensorflow``, as ``name==version``."""
    found = []
    for name in TF_DISTRIBUTIONS:
        try:
            found.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return tuple(found)


def probe_keras_version() -> str:
    """The installed Keras version (from package metadata, without importing Keras)."""
    try:
        return importlib.metadata.version("keras")
    except importlib.metadata.PackageNotFoundError:
        import keras

        return str(keras.__version__)


def probe_tf_gpus() -> tuple[str, ...]:
    """Names of the physical GPUs TensorFlow sees."""
    import tensorflow as tf

    return tuple(d.name for d in tf.config.list_physical_devices("GPU"))


def probe_driver(nvidia_smi_timeout: float = _NVIDIA_SMI_TIMEOUT_S) -> DriverReport:
    """GPUs seen by the NVIDIA driver: NVML first, ``nvidia-smi -q -x`` when NVML fails.

    Args:
        nvidia_smi_timeout: Seconds before a hung ``nvidia-smi`` is killed.

    Returns:
        The driver's report; no GPUs when no NVIDIA driver is installed.

    Raises:
        RuntimeError: A driver appears to be installed but neither probe could read it.
    """
    try:
        return _probe_nvml()
    except Exception as nvml_error:
        nvml_text = f"NVML: {type(nvml_error).__name__}: {nvml_error}"
    executable = shutil.which("nvidia-smi")
    if executable is None:
        if "LibraryNotFound" in nvml_text:
            # Neither the NVML library nor nvidia-smi: no NVIDIA driver, so no GPUs.
            return DriverReport("none", None, None, ())
        raise RuntimeError(f"{nvml_text}; nvidia-smi: not found on PATH")
    result = run([executable, "-q", "-x"], timeout=nvidia_smi_timeout)
    if result.timed_out:
        raise RuntimeError(
            f"{nvml_text}; nvidia-smi -q -x did not answer within {nvidia_smi_timeout:g} s"
        )
    if result.returncode != 0:
        detail = (result.stdout + result.stderr).strip().splitlines()
        raise RuntimeError(
            f"{nvml_text}; nvidia-smi -q -x exited with {result.returncode}: "
            f"{detail[0] if detail else 'no output'}"
        )
    driver, cuda, gpus = parse_nvidia_smi_xml(result.stdout)
    return DriverReport("nvidia-smi", driver, cuda, gpus)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _probe_nvml() -> DriverReport:
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda_int = int(pynvml.nvmlSystemGetCudaDriverVersion())
        cuda = f"{cuda_int // 1000}.{cuda_int % 1000 // 10}"
        gpus = []
        for index in range(int(pynvml.nvmlDeviceGetCount())):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // 2**20
            gpus.append(
                DriverGpu(
                    index=index,
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    memory_mib=memory,
                    pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
                )
            )
        return DriverReport("nvml", driver, cuda, tuple(gpus))
    finally:
        pynvml.nvmlShutdown()


def parse_nvidia_smi_xml(text: str) -> tuple[str | None, str | None, tuple[DriverGpu, ...]]:
    """Parses ``nvidia-smi -q -x`` output.

    Args:
        text: The XML document (``<nvidia_smi_log>``).

    Returns:
        The driver version, the CUDA driver version and the GPUs in document order.

    Raises:
        ValueError: The text is not an ``nvidia_smi_log`` XML document.
    """
    try:
        root = ElementTree.fromstring(text)
    except ElementTree.ParseError as error:
        raise ValueError(f"nvidia-smi -q -x printed no valid XML: {error}") from None
    if root.tag != "nvidia_smi_log":
        raise ValueError(f"nvidia-smi -q -x printed <{root.tag}>, expected <nvidia_smi_log>")
    gpus = []
    for index, node in enumerate(root.findall("gpu")):
        total = (node.findtext("fb_memory_usage/total") or "").split()
        memory = int(total[0]) if total and total[0].isdigit() else None
        gpus.append(
            DriverGpu(
                index=index,
                name=(node.findtext("product_name") or "").strip(),
                uuid=(node.findtext("uuid") or "").strip(),
                memory_mib=memory,
                pci_bus_id=node.get("id", "").strip(),
            )
        )
    driver = (root.findtext("driver_version") or "").strip() or None
    cuda = (root.findtext("cuda_version") or "").strip() or None
    return driver, cuda, tuple(gpus)


def library_from_filename(path: str) -> CudaLibrary | None:
    """The library a file name denotes (``libcudnn.so.9.1.0`` -> cudnn 9.1.0), else None."""
    match = _LIBRARY_FILE.match(os.path.basename(path))
    if match is None:
        return None
    return CudaLibrary(match.group(1), match.group(2), path)


def _ldconfig_paths() -> list[str]:
    executable = shutil.which("ldconfig") or (
        "/sbin/ldconfig" if os.path.exists("/sbin/ldconfig") else None
    )
    if executable is None:
        return []
    result = run([executable, "-p"], timeout=_LDCONFIG_TIMEOUT_S)
    if result.timed_out:
        return []
    return [line.split("=>", 1)[1].strip() for line in result.stdout.splitlines() if "=>" in line]


def _search_directories(env: Mapping[str, str], site_dirs: Sequence[str]) -> list[str]:
    directories = [d for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(variable):
            directories += [
                os.path.join(env[variable], "lib64"),
                os.path.join(env[variable], "lib"),
            ]
    directories += sorted(glob.glob("/usr/local/cuda*/lib*"))
    directories += ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib/aarch64-linux-gnu"]
    # tensorflow[and-cuda] installs CUDA as pip packages: site-packages/nvidia/<part>/lib.
    for site in site_dirs:
        directories += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib")))
    return directories


def find_cuda_libraries(
    env: Mapping[str, str] | None = None,
    site_dirs: Sequence[str] | None = None,
    *,
    use_ldconfig: bool = True,
) -> tuple[CudaLibrary, ...]:
    """Finds CUDA runtime, cuDNN and NCCL libraries the dynamic loader could load.

    Searches ``LD_LIBRARY_PATH``, ``CUDA_HOME``/``CUDA_PATH``, ``/usr/local/cuda*``, the
    system library directories, the ``ldconfig`` cache and the ``nvidia-*`` pip packages'
    ``lib`` folders. Of several files for one library in one folder (the ``.so.12`` link and
    the ``.so.12.4.127`` file) the most precise version is kept.

    Args:
        env: Environment to read (``os.environ`` by default).
        site_dirs: Folders holding pip packages (``sys.path`` by default).
        use_ldconfig: Also read ``ldconfig -p``.

    Returns:
        The libraries found, sorted by name, version and path.
    """
    env = os.environ if env is None else env
    site_dirs = [p for p in sys.path if p] if site_dirs is None else site_dirs
    candidates: list[str] = []
    for directory in _search_directories(env, site_dirs):
        for name in _LIBRARIES:
            candidates += glob.glob(os.path.join(directory, f"lib{name}.so.*"))
    if use_ldconfig:
        candidates += _ldconfig_paths()
    best: dict[tuple[str, str], CudaLibrary] = {}
    for path in candidates:
        library = library_from_filename(path)
        if library is None or not os.path.exists(path):
            continue
        key = (library.name, os.path.realpath(os.path.dirname(path)))
        kept = best.get(key)
        if kept is None or len(library.version) > len(kept.version):
            best[key] = library
    return tuple(sorted(best.values(), key=lambda lib: (lib.name, lib.version, lib.path)))


def probe_tf_config(env: Mapping[str, str]) -> str | None:
    """Validates ``TF_CONFIG`` as ``choose_strategy`` will (through the cluster sources: in a
    Kubernetes pod, as a TFJob writes it); returns the error text or None."""
    if not env.get("TF_CONFIG", "").strip():
        return None
    from tfscale.cluster import cluster_from_env
    from tfscale.errors import ClusterConfigError

    try:
        cluster_from_env(env)
    except ClusterConfigError as error:
        return str(error)
    return None


def probe_strategy(env: Mapping[str, str] | None = None) -> StrategyView:
    """Asks :func:`tfscale.strategy.decide` what it would pick here, building nothing.

    Args:
        env: Environment to read ``TF_CONFIG`` from (``os.environ`` by default).

    Raises:
        Exception: Whatever fact gathering or the decision raises (e.g. ClusterConfigError).
    """
    from tfscale.strategy import decide, gather_facts

    decision = decide(gather_facts(env))
    return StrategyView(
        kind=f"{decision.kind}Strategy",
        replicas=decision.num_replicas,
        collectives=decision.cross_device_ops,
        reasons=tuple(decision.reasons),
    )
