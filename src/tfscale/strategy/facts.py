"""Facts about this process that the strategy choice depends on, gathered once.

:func:`gather_facts` reads them without starting TensorFlow's runtime (see
``_logical_layout``), so ``tfscale doctor`` can show the choice and ``choose_strategy`` can
still build MultiWorkerMirroredStrategy and set GPU memory growth afterwards.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tfscale.cluster import ClusterConfig, cluster_from_env, worker_device_kinds
from tfscale.devices.names import normalize_device

__all__ = ["StrategyFacts", "gather_facts", "normalize_device"]


@dataclass(frozen=True)
class StrategyFacts:
    """What this process can see, gathered once by :func:`gather_facts`.

    Attributes:
        platform: ``sys.platform`` (``"linux"``, ``"win32"``, ``"darwin"``).
        physical_gpus: Number of physical GPUs TensorFlow sees.
        logical_devices: Device kind (``"CPU"``, ``"GPU"``) -> logical device names, e.g.
            ``{"CPU": ("/device:CPU:0",), "GPU": ("/device:GPU:0", "/device:GPU:1")}``.
        nccl_available: True where NCCL collectives exist (a CUDA build on Linux).
        cluster: The multi-process cluster from ``TF_CONFIG``, or None.
        worker_device_kinds: Device kind of every worker (chief first) as the launcher
            declared in ``TFSCALE_WORKER_DEVICE_KINDS``, or None when undeclared.
    """

    platform: str
    physical_gpus: int
    logical_devices: Mapping[str, tuple[str, ...]]
    nccl_available: bool
    cluster: ClusterConfig | None = None
    worker_device_kinds: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        frozen = MappingProxyType({k: tuple(v) for k, v in self.logical_devices.items()})
        object.__setattr__(self, "logical_devices", frozen)

    @property
    def gpus(self) -> tuple[str, ...]:
        """Logical GPU names."""
        return tuple(self.logical_devices.get("GPU", ()))

    @property
    def cpus(self) -> tuple[str, ...]:
        """Logical CPU names."""
        return tuple(self.logical_devices.get("CPU", ()))

    @property
    def all_devices(self) -> tuple[str, ...]:
        """Every logical device, GPUs first."""
        return (
            self.gpus
            + self.cpus
            + tuple(
                n
                for k, names in self.logical_devices.items()
                if k not in ("GPU", "CPU")
                for n in names
            )
        )


def _nccl_available(platform: str, build_info: Mapping[str, Any]) -> bool:
    # NCCL ships with TensorFlow's CUDA wheels for Linux only (none for Windows or macOS).
    return platform.startswith("linux") and bool(build_info.get("is_cuda_build"))


def _logical_layout(
    physical: Iterable[Any], configs: Callable[[Any], Any]
) -> dict[str, tuple[str, ...]]:
    """Names the logical devices the runtime will create, without starting it.

    Each visible physical device becomes as many logical devices as it has configurations
    (one when unconfigured), numbered per kind in order. Listing logical devices instead would
    start TensorFlow's runtime, after which MultiWorkerMirroredStrategy can no longer be built
    ("Collective ops must be configured at program startup") and memory growth is fixed.
    """
    counts: dict[str, int] = {}
    for device in physical:
        kind = device.device_type
        n = len(configs(device) or [None])
        counts[kind] = counts.get(kind, 0) + n
    return {k: tuple(f"/device:{k}:{i}" for i in range(n)) for k, n in counts.items()}


def gather_facts(env: Mapping[str, str] | None = None) -> StrategyFacts:
    """Takes one snapshot of what :func:`decide` needs, without starting TensorFlow's runtime.

    Args:
        env: Environment to read ``TF_CONFIG`` from (``os.environ`` by default).

    Returns:
        The facts.

    Raises:
        ClusterConfigError: ``TF_CONFIG`` or ``TFSCALE_WORKER_DEVICE_KINDS`` is malformed.
    """
    import tensorflow as tf

    cluster = cluster_from_env(env)
    kinds = worker_device_kinds(cluster, env) if cluster is not None else None
    visible = tf.config.get_visible_devices()
    return StrategyFacts(
        platform=sys.platform,
        physical_gpus=sum(d.device_type == "GPU" for d in visible),
        logical_devices=_logical_layout(visible, tf.config.get_logical_device_configuration),
        nccl_available=_nccl_available(sys.platform, tf.sysconfig.get_build_info()),
        cluster=cluster,
        worker_device_kinds=kinds,
    )
