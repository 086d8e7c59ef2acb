"""The Kubernetes cluster source: a pod of a Kubeflow TFJob, whose ``TF_CONFIG`` the operator set.

Beyond plain ``TF_CONFIG`` parsing, a TFJob guarantees more, and a pod whose ``TF_CONFIG``
breaks it was misconfigured by hand (copied between pods, addresses reordered): every
address is the service name ``<job>-<type>-<index>.<namespace>.svc:<port>`` of its task, in
index order, and this pod (``HOSTNAME``) is the task ``TF_CONFIG`` names. Validated at
start-up, in ``choose_strategy``, as every source is.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping

from tfscale.cluster.config import TF_CONFIG_ENV, ClusterConfig, fail, parse_tf_config

__all__ = ["KubernetesSource", "cluster_from_kubernetes"]

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
#: Set in every pod by Kubernetes itself.
_IN_A_POD = "KUBERNETES_SERVICE_HOST"
_NOT_A_TFJOB = (
    " If this pod is not part of a TFJob, read TF_CONFIG as written: "
    "export TFSCALE_CLUSTER_SOURCE=TF_CONFIG."
)


class KubernetesSource:
    """A TFJob pod's ``TF_CONFIG``, checked as a TFJob writes it.

    See :func:`cluster_from_kubernetes`.
    """

    name = "Kubernetes"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        """In a Kubernetes pod (``KUBERNETES_SERVICE_HOST``) with ``TF_CONFIG`` set."""
        return bool(env.get(_IN_A_POD, "").strip()) and bool(env.get(TF_CONFIG_ENV, "").strip())

    def resolve(self, env: Mapping[str, str]) -> ClusterConfig:
        """The cluster (see :func:`cluster_from_kubernetes`)."""
        return cluster_from_kubernetes(env)


def _is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _check_pod_address(field_name: str, address: str, task_type: str, index: int) -> None:
    host = address.rpartition(":")[0]
    labels = host.split(".")
    if _is_ip_address(host) or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        raise fail(
            field_name,
            "an IP address, not the service name of a TFJob task."
            if _is_ip_address(host)
            else "not a Kubernetes service DNS name.",
            address,
            "'<job>-<type>-<index>.<namespace>.svc:<port>' as a TFJob writes it",
            "let the TFJob operator set TF_CONFIG; do not write it by hand in a pod."
            + _NOT_A_TFJOB,
        )
    expected_suffix = f"-{task_type}-{index}"
    if not labels[0].endswith(expected_suffix):
        raise fail(
            field_name,
            f"the service name does not end in {expected_suffix!r}, so it is "
            f"not the address of {task_type} {index}.",
            address,
            f"'<job>{expected_suffix}.<namespace>.svc:<port>'",
            "list each replica type's addresses in index order, as the TFJob operator does."
            + _NOT_A_TFJOB,
        )


def cluster_from_kubernetes(env: Mapping[str, str] | None = None) -> ClusterConfig:
    """The cluster of a pod started by a Kubeflow TFJob, from the ``TF_CONFIG`` it was given.

    Beyond :func:`parse_tf_config`, checks what a TFJob guarantees: every address is a
    service DNS name ``<job>-<type>-<index>.<namespace>.svc:<port>`` in index order, and
    (where ``HOSTNAME`` is set) this pod is the task ``TF_CONFIG`` says it is.

    Args:
        env: The environment (``os.environ`` by default).

    Returns:
        The cluster, with ``source="Kubernetes"``.

    Raises:
        ClusterConfigError: ``TF_CONFIG`` is missing or malformed, an address is not the
            service name of its task, or the task does not match this pod.
    """
    env = os.environ if env is None else env
    raw = env.get(TF_CONFIG_ENV, "").strip()
    if not raw:
        raise fail(
            TF_CONFIG_ENV,
            "the variable is not set.",
            "not set",
            "TF_CONFIG set by the TFJob operator in each pod",
            "run the script as a TFJob (tfscale launch --k8s writes one).",
        )
    parsed = parse_tf_config(raw)
    for task_type, addresses in parsed.cluster.items():
        for index, address in enumerate(addresses):
            _check_pod_address(f"cluster.{task_type}[{index}]", address, task_type, index)
    hostname = env.get("HOSTNAME", "").strip()
    own = parsed.address
    if hostname and own is not None and own.split(".")[0] != hostname:
        raise fail(
            "task",
            f"this pod is {hostname!r} but TF_CONFIG names task "
            f"{parsed.task_type} {parsed.task_index} at {own!r}.",
            {"type": parsed.task_type, "index": parsed.task_index},
            f"the task whose address starts with {hostname!r}",
            "do not copy TF_CONFIG between pods; each pod gets its own from the operator.",
        )
    return ClusterConfig(parsed.cluster, parsed.task_type, parsed.task_index, source="Kubernetes")
