"""The cluster's settings (`cluster.*`): how many replicas, where they run. The router is a plugin
kind of its own (`router=NAME`, its options under `router.`)."""

import math
from dataclasses import dataclass

BACKENDS = ("local", "ray")


@dataclass
class ClusterConfig:
    """`cluster.replicas=N` engines behind a router (docs/cluster.md). One replica on the local
    backend is today's single engine, unchanged."""

    replicas: int = 1
    backend: str = "local"  # local: every replica in this process; ray: each a Ray actor
    # Each replica's share of a GPU (0.5 puts two on one GPU): a Ray actor's num_gpus; simulated
    # replicas share virtual GPUs alike, time-sliced (executor.timeslice_s, executor.context_switch_s)
    gpus_per_replica: float = 1.0
    ray_address: str | None = None  # ray: an existing Ray cluster ("auto", "ray://host:10001"); None starts one here
    # Prefill/decode disaggregation (docs/disaggregation.md): P replicas compute prompts and first
    # tokens, D decode; the K/V moves through the kv_transfer plugin. Unset: colocated replicas.
    prefill_replicas: int | None = None
    decode_replicas: int | None = None


def cluster_problems(cluster) -> list[str]:
    """What is wrong with the cluster settings (a ClusterConfig or its Hydra node), each naming the
    setting and what it allows; empty when they can run."""
    problems = []
    replicas = cluster.replicas
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        problems.append(f"cluster.replicas must be a whole number >= 1, got {replicas!r}")
    if cluster.backend not in BACKENDS:
        problems.append(f"cluster.backend must be one of {', '.join(BACKENDS)}, got {cluster.backend!r}")
    gpus = cluster.gpus_per_replica
    if isinstance(gpus, bool) or not isinstance(gpus, (int, float)) or not 0 <= gpus < math.inf:
        problems.append(
            f"cluster.gpus_per_replica must be a finite number >= 0 (0.5: two replicas a GPU), got {gpus!r}"
        )
    address = cluster.ray_address
    if address is not None and (not isinstance(address, str) or not address):
        problems.append(f"cluster.ray_address must be an address string or null, got {address!r}")
    if cluster.backend == "local" and address is not None:
        problems.append("cluster.ray_address applies to cluster.backend=ray")
    return problems + role_problems(cluster)


def role_problems(cluster) -> list[str]:
    """What is wrong with the prefill/decode split: asking for roles takes at least one replica of
    each, and cluster.replicas is then their sum."""
    prefill, decode = cluster.prefill_replicas, cluster.decode_replicas
    if prefill is None and decode is None:
        return []
    counts = {"cluster.prefill_replicas": prefill, "cluster.decode_replicas": decode}
    bad = [
        f"{name}={value!r}"
        for name, value in counts.items()
        if isinstance(value, bool) or not isinstance(value, int) or value < 1
    ]
    if bad:
        return [
            f"splitting prefill from decode takes cluster.prefill_replicas and cluster.decode_replicas, each a whole "
            f"number >= 1 (got {', '.join(bad)}); leave both unset for colocated replicas"
        ]
    if cluster.replicas not in (1, prefill + decode):
        return [
            f"cluster.replicas={cluster.replicas} but cluster.prefill_replicas + cluster.decode_replicas = "
            f"{prefill + decode}: with roles the cluster is those replicas; leave cluster.replicas unset"
        ]
    return []


class ClusterConfigError(ValueError):
    """Cluster settings that cannot work; raised before any replica is built."""


def validate_cluster(cluster) -> None:
    problems = cluster_problems(cluster)
    if problems:
        raise ClusterConfigError("; ".join(problems))
