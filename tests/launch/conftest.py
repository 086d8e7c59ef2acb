"""The one-node Slurm cluster (``slurm_cluster.py``), started once for the session by the
first test that asks for it and stopped at its end; its tests skip, with the reason, where it
cannot run (not root, Slurm or munge not installed, daemons not up in time)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .slurm_cluster import SlurmCluster, UnavailableError, start_cluster


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """munged, slurmctld and slurmd running, the node idle; stopped after the session with
    no process left (``SlurmCluster.stop`` raises otherwise)."""
    try:
        cluster = start_cluster()
    except UnavailableError as why:
        pytest.skip(f"no one-node Slurm cluster: {why}")
    try:
        yield cluster
    finally:
        cluster.stop()
