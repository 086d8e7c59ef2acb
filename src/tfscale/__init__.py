"""tfscale: make TensorFlow and Keras 3 use every device you have, and say why they are not.

Public names are loaded lazily (PEP 562) so that ``import tfscale`` and the parts that need
no TensorFlow (the launcher, the command line's help, error types) start in milliseconds and
never start TensorFlow's runtime before devices are configured.

If ``TFSCALE_VIRTUAL_DEVICES=N`` is set, importing tfscale splits the CPU (or the single GPU)
into N logical devices before TensorFlow starts.
"""

from __future__ import annotations

import os

from tfscale.errors import (
    ClusterConfigError,
    DeviceConfigError,
    LaunchError,
    NonFiniteLossError,
    OutOfMemoryError,
    PartitionError,
    ProfileError,
    ScopeError,
    StrategyError,
    TaskError,
    TfscaleError,
    TfscaleWarning,
    TrainingError,
)
from tfscale.runtime.lazy import lazy_names

__version__ = "0.1.0"

# Public name -> module that defines it. Keep sorted by module.
_LAZY: dict[str, str] = {
    "DeviceInfo": "tfscale.devices.discovery",
    "discover_devices": "tfscale.devices.discovery",
    "use_virtual_devices": "tfscale.devices.discovery",
    # >>> public names added by feature modules (keep one line per name) >>>
    "ProfileCallback": "tfscale.profiling.callback",
    "profile": "tfscale.profiling.bench",
    "ClusterConfig": "tfscale.cluster",
    "StrategyChoice": "tfscale.strategy",
    "choose_strategy": "tfscale.strategy",
    "check_scope": "tfscale.scope",
    "fix_scope": "tfscale.scope",
    "track_variable_creation": "tfscale.scope",
    "CheckpointConfig": "tfscale.training.checkpoint",
    "Options": "tfscale.training.options",
    "Trainer": "tfscale.training.trainer",
    "fit": "tfscale.training.fit",
    "gather_batch": "tfscale.training.batchwide",
    "prepare": "tfscale.training.prepare",
    "prepare_loop": "tfscale.training.loop",
    "PartitionPlan": "tfscale.parallel.partition",
    "plan_partition": "tfscale.parallel.partition",
    "place": "tfscale.parallel.placement",
    "pipeline": "tfscale.parallel.pipeline",
    "TaskPool": "tfscale.tasks",
    "current_device": "tfscale.tasks",
    "MemoryPlan": "tfscale.training.memory",
    "plan_memory": "tfscale.training.memory",
    "out_of_memory_explained": "tfscale.training.memory.oom",
    # <<< public names added by feature modules <<<
}

__all__ = [
    "ClusterConfigError",
    "DeviceConfigError",
    "LaunchError",
    "NonFiniteLossError",
    "OutOfMemoryError",
    "PartitionError",
    "ProfileError",
    "ScopeError",
    "StrategyError",
    "TaskError",
    "TfscaleError",
    "TfscaleWarning",
    "TrainingError",
    "__version__",
    *sorted(_LAZY),
]


__getattr__, __dir__ = lazy_names("tfscale", _LAZY, globals())


# TensorFlow is configured when it is imported (tfscale/tf_import.py), not by importing
# tfscale: quiet in a process a tfscale command started quietly, and split into the logical
# devices TFSCALE_VIRTUAL_DEVICES asks for (checked now, applied before TensorFlow starts).
from tfscale.runtime import tf_import as _tf_import  # noqa: E402

if os.environ.get("TFSCALE_VIRTUAL_DEVICES"):
    from tfscale.devices.virtual import env_request as _env_request

    _env_request()  # a bad value fails here, at import tfscale

    def _apply_virtual_devices() -> None:
        # Not tfscale.devices.discovery: it may be the module whose import of TensorFlow is running
        # now; logical_devices imports TensorFlow only inside its functions (#21.4).
        from tfscale.devices.logical import apply_env_virtual_devices

        apply_env_virtual_devices()

    _tf_import.on_import(_apply_virtual_devices)
else:
    _tf_import.on_import()
