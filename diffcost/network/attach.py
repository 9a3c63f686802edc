"""The topology graph of a job, and its link-load tables, from a cluster's ``topology`` key.

``ClusterSpec.topology`` opts a cluster into the network path of the cost model: ``""`` (the
default) keeps the NVLink ring-share table and the fabric's oversubscription; ``"cluster"``
takes the graph the spec itself describes (``generators.from_cluster``: its nodes' NVLink
domains, their NICs on a leaf per node, an uplink divided by ``oversubscription``); anything
else names a preset of ``configs/topologies`` or a YAML file (``load.load_topology``).
"""

from __future__ import annotations

from diffcost.network.generators import from_cluster
from diffcost.network.graph import Topology
from diffcost.network.load import load_topology
from diffcost.network.tables import NetworkTables, build_tables
from diffcost.spec_values import ConfigError
from diffcost.specs import ClusterSpec

FROM_CLUSTER = "cluster"


def job_topology(cluster: ClusterSpec, n_gpus: int, topology: str | None = None) -> Topology:
    """The graph ``n_gpus`` ranks of ``cluster`` run on (``topology`` overrides the
    cluster's ``topology`` key).

    Raises:
        ConfigError: no topology named, an unknown preset or bad file, or a graph with fewer
            endpoints than ``n_gpus``.
    """
    name = cluster.topology if topology is None else topology
    if not name:
        raise ConfigError(
            f"cluster {cluster.name!r}: no topology (set topology: cluster or a preset)"
        )
    if name == FROM_CLUSTER:
        nodes = -(-n_gpus // cluster.gpus_per_node)
        return from_cluster(cluster, nodes)
    graph = load_topology(name)
    if len(graph.endpoints) < n_gpus:
        raise ConfigError(
            f"cluster {cluster.name!r}: topology={name!r} has {len(graph.endpoints)} GPUs, "
            f"the job {n_gpus}: use a larger topology or fewer GPUs"
        )
    return graph


def job_tables(
    cluster: ClusterSpec,
    n_gpus: int,
    topology: str | None = None,
    contention: bool = True,
    links: bool = False,
) -> NetworkTables:
    """``build_tables`` of ``job_topology`` (cached per graph, ``n_gpus`` and ``links``)."""
    return build_tables(job_topology(cluster, n_gpus, topology), n_gpus, contention, links)
