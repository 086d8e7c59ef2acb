"""One snapshot of the environment: every fact ``tfscale doctor`` judges, gathered once.

:func:`take_snapshot` runs each probe of :mod:`tfscale.doctor.probes` and records what it
found; a probe that raises leaves its field empty and its error text in
``Snapshot.errors[probe]``, so one broken probe never hides the others. Checks
(:mod:`tfscale.doctor.checks`) are pure functions of the snapshot and tests fake it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

from tfscale.doctor.probes import (
    CudaLibrary,
    DriverGpu,
    StrategyView,
    find_cuda_libraries,
    probe_driver,
    probe_keras_version,
    probe_strategy,
    probe_tensorflow,
    probe_tensorflow_distributions,
    probe_tf_config,
    probe_tf_gpus,
    python_and_platform,
)

__all__ = ["CudaLibrary", "DriverGpu", "Snapshot", "StrategyView", "take_snapshot"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class Snapshot:
    """The facts about this machine that decide whether TensorFlow can use its GPUs.

    A field is None (or empty) when its probe failed; ``errors`` then holds the error text
    under the probe's name (``tensorflow``, ``keras``, ``driver``, ``tf_gpus``,
    ``libraries``, ``distributions``, ``tf_config``).

    Attributes:
        python_version: e.g. ``3.11.9``.
        platform: ``platform.platform()``, e.g. ``Linux-6.8.0-x86_64-with-glibc2.39``.
        system: ``Linux``, ``Windows`` or ``Darwin``.
        tensorflow_version: ``tf.__version__``.
        tensorflow_distributions: Installed pip distributions providing ``tensorflow``
            (``tensorflow-cpu==2.21.0``); more than one overwrite each other.
        keras_version: The installed Keras version.
        is_cuda_build: ``tf.sysconfig.get_build_info()["is_cuda_build"]``.
        cuda_build_version: The CUDA version TensorFlow was built for (``12.5.1``).
        cudnn_build_version: The cuDNN version TensorFlow was built for (``9``).
        driver_source: ``nvml``, ``nvidia-smi`` or ``none`` (no NVIDIA driver installed).
        driver_version: NVIDIA driver version, e.g. ``550.90.07``.
        cuda_driver_version: The newest CUDA the driver supports, e.g. ``12.4``.
        driver_gpus: GPUs the driver sees (it ignores ``CUDA_VISIBLE_DEVICES``).
        tf_gpus: Physical GPU names TensorFlow sees.
        cuda_libraries: CUDA runtime, cuDNN and NCCL libraries found on the system.
        cuda_visible_devices: ``CUDA_VISIBLE_DEVICES`` as set, None when unset.
        tf_config: ``TF_CONFIG`` as set, None when unset.
        tf_config_error: The ``ClusterConfigError`` text when ``TF_CONFIG`` is malformed.
        nccl_available: Whether TensorFlow can all-reduce with NCCL (a CUDA build on Linux).
        xla_available: Whether TensorFlow was built with XLA.
        strategy: What ``choose_strategy`` would pick, decided without building it.
        strategy_error: Why no strategy could be decided (e.g. a broken ``TF_CONFIG``).
        errors: Probe name -> error text for each probe that failed.
    """

    python_version: str
    platform: str
    system: str
    tensorflow_version: str | None = None
    tensorflow_distributions: tuple[str, ...] = ()
    keras_version: str | None = None
    is_cuda_build: bool | None = None
    cuda_build_version: str | None = None
    cudnn_build_version: str | None = None
    driver_source: str | None = None
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    driver_gpus: tuple[DriverGpu, ...] = ()
    tf_gpus: tuple[str, ...] = ()
    cuda_libraries: tuple[CudaLibrary, ...] = ()
    cuda_visible_devices: str | None = None
    tf_config: str | None = None
    tf_config_error: str | None = None
    nccl_available: bool | None = None
    xla_available: bool | None = None
    strategy: StrategyView | None = None
    strategy_error: str | None = None
    errors: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dictionary (tuples become lists)."""
        data = asdict(self)
        data["errors"] = dict(self.errors)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Snapshot:
        """Rebuilds a snapshot from :meth:`to_dict`'s output (after a JSON round trip).

        Raises:
            ValueError: ``data`` has keys a snapshot does not.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"not snapshot fields: {', '.join(unknown)}")
        values = dict(data)
        values["tensorflow_distributions"] = tuple(data.get("tensorflow_distributions", ()))
        values["driver_gpus"] = tuple(DriverGpu(**g) for g in data.get("driver_gpus", ()))
        values["tf_gpus"] = tuple(data.get("tf_gpus", ()))
        values["cuda_libraries"] = tuple(CudaLibrary(**c) for c in data.get("cuda_libraries", ()))
        strategy = data.get("strategy")
        if strategy is not None:
            values["strategy"] = StrategyView(
                kind=strategy["kind"],
                replicas=int(strategy["replicas"]),
                collectives=strategy.get("collectives"),
                reasons=tuple(strategy.get("reasons", ())),
            )
        values["errors"] = dict(data.get("errors", {}))
        return cls(**values)


def _attempt(errors: dict[str, str], probe: str, call: Callable[[], _T]) -> _T | None:
    try:
        return call()
    except Exception as error:  # A probe's failure is a finding, not a crash.
        errors[probe] = f"{type(error).__name__}: {error}".strip()
        return None


def take_snapshot(env: Mapping[str, str] | None = None) -> Snapshot:
    """Probes this machine once and returns everything the checks need.

    Imports TensorFlow (a few seconds) and lists its physical devices; asks the strategy
    module what it would choose without building any strategy. Never raises for what it
    finds: a probe that fails records its error text in ``Snapshot.errors``.

    Args:
        env: Environment to read ``CUDA_VISIBLE_DEVICES``, ``TF_CONFIG`` and library paths
            from (``os.environ`` by default).

    Returns:
        The snapshot.
    """
    env = os.environ if env is None else env
    errors: dict[str, str] = {}
    python_version, platform_text, system = python_and_platform()
    tensorflow = _attempt(errors, "tensorflow", probe_tensorflow)
    tf_version, build, xla = tensorflow if tensorflow else (None, {}, None)
    is_cuda = build.get("is_cuda_build") if tensorflow else None
    driver = _attempt(errors, "driver", probe_driver)
    tf_gpus = _attempt(errors, "tf_gpus", probe_tf_gpus) if tensorflow else None
    libraries = _attempt(errors, "libraries", lambda: find_cuda_libraries(env))
    tf_config = env.get("TF_CONFIG")
    tf_config_error = _attempt(errors, "tf_config", lambda: probe_tf_config(env))
    strategy, strategy_error = None, None
    if tensorflow:
        strategy_errors: dict[str, str] = {}
        strategy = _attempt(strategy_errors, "strategy", lambda: probe_strategy(env))
        strategy_error = strategy_errors.get("strategy")
    return Snapshot(
        python_version=python_version,
        platform=platform_text,
        system=system,
        tensorflow_version=tf_version,
        tensorflow_distributions=_attempt(errors, "distributions", probe_tensorflow_distributions)
        or (),
        keras_version=_attempt(errors, "keras", probe_keras_version),
        is_cuda_build=None if is_cuda is None else bool(is_cuda),
        cuda_build_version=_optional_text(build.get("cuda_version")),
        cudnn_build_version=_optional_text(build.get("cudnn_version")),
        driver_source=driver.source if driver else None,
        driver_version=driver.driver_version if driver else None,
        cuda_driver_version=driver.cuda_driver_version if driver else None,
        driver_gpus=driver.gpus if driver else (),
        tf_gpus=tf_gpus or (),
        cuda_libraries=libraries or (),
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        tf_config=tf_config,
        tf_config_error=tf_config_error,
        # TensorFlow's NCCL all-reduce ships in its CUDA builds for Linux only.
        nccl_available=None if is_cuda is None else bool(is_cuda) and system == "Linux",
        xla_available=xla,
        strategy=strategy,
        strategy_error=strategy_error,
        errors=errors,
    )


def _optional_text(value: object) -> str | None:
    return None if value is None or value == "" else str(value)
