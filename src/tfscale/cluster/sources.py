"""Where this process's cluster comes from: one small class per source, chosen in one place.

Like Lightning Fabric's cluster environments and its connector: each source says whether it
applies (``detect(env)``) and resolves the environment into a validated
:class:`~tfscale.cluster.config.ClusterConfig`; :func:`choose_source` picks the first that
applies, in this order::

    KubernetesSource  a pod (KUBERNETES_SERVICE_HOST) with TF_CONFIG: checked as a TFJob writes it
    TFConfigSource    TF_CONFIG set: parsed and validated
    SlurmSource       an srun task (SLURM_PROCID) without TF_CONFIG: every task of the step

``TFSCALE_CLUSTER_SOURCE`` overrides the choice: ``TF_CONFIG``, ``Slurm`` or ``Kubernetes``
name one source (used whether it detects or not), ``none`` means no cluster. Everything that
needs the cluster (``choose_strategy``, the doctor, a parameter server, ``bench --workers``
workers) reads it through :func:`cluster_from_env`, so a source's checks run at start-up.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Protocol

from tfscale.cluster.config import TF_CONFIG_ENV, ClusterConfig, parse_tf_config
from tfscale.cluster.kubernetes import KubernetesSource
from tfscale.cluster.slurm import SlurmSource
from tfscale.errors import ClusterConfigError, explain

__all__ = [
    "SOURCE_ENV",
    "ClusterSource",
    "TFConfigSource",
    "choose_source",
    "cluster_from_env",
]

#: Overrides the detected source: a source's name, or ``none``.
SOURCE_ENV = "TFSCALE_CLUSTER_SOURCE"


class ClusterSource(Protocol):
    """What a cluster source provides."""

    name: str

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        """Whether this source describes the process's environment."""
        ...

    def resolve(self, env: Mapping[str, str]) -> ClusterConfig:
        """The validated cluster.

        Raises:
            ClusterConfigError: The environment is malformed (the variable is named).
        """
        ...


class TFConfigSource:
    """``TF_CONFIG`` as written (by ``tfscale launch``, a scheduler or by hand)."""

    name = "TF_CONFIG"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        """``TF_CONFIG`` is set and not empty."""
        return bool(env.get(TF_CONFIG_ENV, "").strip())

    def resolve(self, env: Mapping[str, str]) -> ClusterConfig:
        """The parsed, validated ``TF_CONFIG`` (see :func:`parse_tf_config`)."""
        if not self.detect(env):
            raise ClusterConfigError(
                explain(
                    f"{SOURCE_ENV}=TF_CONFIG but TF_CONFIG is not set.",
                    received="TF_CONFIG not set",
                    allowed="a TF_CONFIG JSON object",
                    fix=f"set TF_CONFIG, or unset {SOURCE_ENV} to detect the source.",
                )
            )
        return parse_tf_config(env[TF_CONFIG_ENV])


_ORDER: tuple[type[ClusterSource], ...] = (KubernetesSource, TFConfigSource, SlurmSource)


def choose_source(env: Mapping[str, str] | None = None) -> ClusterSource | None:
    """The cluster source of this environment, or None (a single process).

    Raises:
        ClusterConfigError: ``TFSCALE_CLUSTER_SOURCE`` names no source.
    """
    env = os.environ if env is None else env
    forced = env.get(SOURCE_ENV, "").strip()
    if forced and forced.lower() != "auto":
        if forced.lower() == "none":
            return None
        by_name = {kind.name.lower(): kind for kind in _ORDER}
        if forced.lower() not in by_name:
            raise ClusterConfigError(
                explain(
                    f"{SOURCE_ENV} names no cluster source.",
                    received=f"{SOURCE_ENV}={forced!r}",
                    allowed=", ".join([*(kind.name for kind in _ORDER), "none", "auto"]),
                    fix=f"unset {SOURCE_ENV} to detect the source.",
                )
            )
        return by_name[forced.lower()]()
    for kind in _ORDER:
        if kind.detect(env):
            return kind()
    return None


def cluster_from_env(env: Mapping[str, str] | None = None) -> ClusterConfig | None:
    """The multi-process cluster this process belongs to, from whichever source applies.

    Args:
        env: The environment to read (``os.environ`` by default).

    Returns:
        The cluster (its ``source`` says which), or None when no source applies or the
        cluster has a single task (a one-task cluster means no multi-worker training).

    Raises:
        ClusterConfigError: The source's description is malformed; the message names the
            variable or field and the value received.
    """
    env = os.environ if env is None else env
    source = choose_source(env)
    if source is None:
        return None
    config = source.resolve(env)
    if config.source != source.name:
        config = ClusterConfig(config.cluster, config.task_type, config.task_index, source.name)
    total = sum(len(a) for a in config.cluster.values())
    return config if total > 1 else None
