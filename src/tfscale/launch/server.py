"""``python -m tfscale.launch.server``: a ``ps`` or ``worker`` task of a parameter-server job.

Under ParameterServerStrategy only the chief runs the training script; the ``worker`` and
``ps`` tasks run a ``tf.distribute.Server`` and wait for the chief's ClusterCoordinator to
send them variables and functions. This module is what ``tfscale launch --ps P`` (and the
``PS``/``Worker`` replicas of a ``--k8s --ps`` TFJob) run for those tasks. It imports
TensorFlow, inside :func:`main` only: it runs in a task process, never in the launcher.
"""

from __future__ import annotations

import os
import sys

from tfscale.cluster import cluster_from_env
from tfscale.errors import ClusterConfigError, explain

__all__ = ["main"]


def main() -> int:
    """Starts this task's server from ``TF_CONFIG`` and serves until the process is stopped."""
    raw = os.environ.get("TF_CONFIG", "")
    config = cluster_from_env()  # a TFJob pod's TF_CONFIG is checked as a TFJob writes it
    if config is None or config.task_type not in ("ps", "worker") or "chief" not in config.cluster:
        raise ClusterConfigError(
            explain(
                "tfscale.launch.server runs the ps and worker tasks of a parameter-server job.",
                received=f"TF_CONFIG={raw!r}",
                allowed="TF_CONFIG with a chief task, and task.type 'ps' or 'worker'",
                fix="start it through `tfscale launch --ps P -n N script.py` (sets TF_CONFIG).",
            )
        )
    # Fail RPCs to a lost peer fast instead of retrying forever, as TensorFlow's
    # parameter-server guide advises, so a dead ps turns into an error the launcher sees.
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=config.task_type,
        task_index=config.task_index,
        protocol=resolver.rpc_layer or "grpc",
        start=True,
    )
    print(f"serving {config.task_type} {config.task_index} at {config.address}", flush=True)
    server.join()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
