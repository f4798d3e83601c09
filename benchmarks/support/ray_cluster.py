"""A Ray cluster of several nodes on this machine (Ray's own multi-node test cluster), for the
tests and the rollouts benchmark: a head with no CPU for tasks (where a driver connects) and
`workers` nodes of `cpus` CPUs each, whose death the head notices within about a second."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

NODE = {"object_store_memory": 80 << 20}


@contextmanager
def local_cluster(workers: int = 2, cpus: int = 2) -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    settings = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_memory_monitor_refresh_ms": "0", "RAY_worker_niceness": "0"}
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)  # the nodes' processes read them as they start
    health = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 2}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": health, **NODE},
    )
    try:
        for _ in range(workers):
            cluster.add_node(num_cpus=cpus, **NODE)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()
        for name, value in before.items():  # what runs after (a test's harness) sees none of them
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def worker_nodes(cluster: Any) -> set[str]:
    """The node ids of the cluster's worker nodes (the head runs no episode)."""
    return {node.node_id for node in cluster.list_all_nodes() if node is not cluster.head_node}
