"""The cluster a process belongs to: the model (``config.py``) and its sources.

``ClusterConfig`` is the one frozen description every source produces; ``TF_CONFIG`` is
parsed, validated and built in ``config.py``; the sources (plain ``TF_CONFIG``, Slurm,
a Kubernetes TFJob) are one small class each with ``detect()``, chosen in one place
(``sources.py``, :func:`cluster_from_env`). Imports no TensorFlow: the launcher uses it.
"""

from __future__ import annotations

from tfscale.cluster.config import (
    DEVICE_KINDS_ENV,
    TASK_TYPES,
    TF_CONFIG_ENV,
    ClusterConfig,
    parse_tf_config,
    tf_config,
    validate,
    worker_device_kinds,
)
from tfscale.cluster.kubernetes import KubernetesSource, cluster_from_kubernetes
from tfscale.cluster.slurm import DEFAULT_SLURM_PORT, SlurmSource, cluster_from_slurm
from tfscale.cluster.sources import (
    SOURCE_ENV,
    ClusterSource,
    TFConfigSource,
    choose_source,
    cluster_from_env,
)

__all__ = [
    "DEFAULT_SLURM_PORT",
    "DEVICE_KINDS_ENV",
    "SOURCE_ENV",
    "TASK_TYPES",
    "TF_CONFIG_ENV",
    "ClusterConfig",
    "ClusterSource",
    "KubernetesSource",
    "SlurmSource",
    "TFConfigSource",
    "choose_source",
    "cluster_from_env",
    "cluster_from_kubernetes",
    "cluster_from_slurm",
    "parse_tf_config",
    "tf_config",
    "validate",
    "worker_device_kinds",
]
