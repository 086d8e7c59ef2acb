"""One worker process of ``tfscale bench --workers N``.

Started by :func:`tfscale.profiling.workers.profile_workers` through the launcher's job
running, as ``python -m tfscale.profiling.worker PAYLOAD`` with its own ``TF_CONFIG``. It
measures as one task of that cluster (:func:`tfscale.profiling.bench.measure_as_worker`);
worker 0 writes the report where the payload says.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """``PAYLOAD`` is JSON: ``{"model": spec, "settings": {...}, "result": path}``."""
    from tfscale.cluster import cluster_from_env
    from tfscale.profiling.bench import measure_as_worker

    payload = json.loads((sys.argv[1:] if argv is None else argv)[0])
    report = measure_as_worker(payload["model"], **payload["settings"])
    cluster = cluster_from_env()
    if cluster is not None and cluster.is_chief:
        partial = payload["result"] + ".partial"
        with open(partial, "wb") as handle:
            pickle.dump(report, handle)
        os.replace(partial, payload["result"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
