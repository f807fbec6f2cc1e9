"""A real Ray cluster of two nodes on loopback for tests (the launcher's and data preparation's)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

# Ray's multi-node switch off makes every Ray process, and each node's advertised address, 127.0.0.1
# (only loopback traffic is allowed on these machines); ray.cluster_utils adds nodes without that switch.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
RAY_CLI = str(Path(sys.executable).parent / "ray")


@contextlib.contextmanager
def loopback_cluster(head_node_args: dict, node_args: dict) -> Iterator:
    """A head and one more node (ray.cluster_utils.Cluster) on 127.0.0.1, with RAY_ENV set while it runs;
    every Ray process stopped and the environment restored after. One cluster at a time on the machine
    (a lock the test workers share): the teardown's `ray stop --force` would take down another's."""
    from ray.cluster_utils import Cluster

    lock = open(Path(tempfile.gettempdir()) / "phalanx-tests-ray-cluster.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ.update(RAY_ENV)
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={**head_node_args, "node_ip_address": "127.0.0.1"})
        cluster.add_node(**node_args, node_ip_address="127.0.0.1")
        yield cluster
    finally:
        if cluster is not None:
            cluster.shutdown()
        subprocess.run([RAY_CLI, "stop", "--force"], capture_output=True, timeout=120)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        lock.close()  # releases the lock
