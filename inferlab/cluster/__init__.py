"""N engine replicas behind a router plugin: in this process, as Ray actors, or simulated on one
virtual clock (docs/cluster.md)."""

from inferlab.cluster.cluster import Cluster

__all__ = ["Cluster"]
