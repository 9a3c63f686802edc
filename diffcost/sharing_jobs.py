"""sharing_jobs: random jobs on random graphs, to check the network path's link sharing.

``random_job`` draws a graph (NVSwitch or NVLink-mesh domains over a leaf-spine, a two-tier
fat-tree or a tree of switches, a torus, or a preset of ``configs/topologies``) with random
link bandwidths and oversubscription, and a random plan of a dense or a mixture-of-experts
example (tensor, pipeline, data and expert parallel sizes, ZeRO stage, sequence parallelism,
and the order the dimensions are laid out in, which decides which groups share a switch or a
NIC). ``corpus`` draws many; ``reference_network.compare`` checks each. The graphs are small
(8 to 64 GPUs) so that the exact reference stays fast.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from diffcost import api
from diffcost.network import generators as gen
from diffcost.network.graph import LinkSpec, Topology
from diffcost.network.load import load_topology
from diffcost.network.tables import build_tables
from diffcost.spec_values import ConfigError

EXAMPLES = Path(__file__).resolve().parent.parent / "configs" / "examples"
BASES = ("llama3-70b-h100.yaml", "mixtral-8x7b.yaml")  # dense, and experts (ep divides dp)
PRESETS = ("dgx1-cube-mesh", "tree-4x2", "leaf-spine-2to1", "perftop-exponential-16",
           "tpu-torus-4x4x4")  # fmt: skip
GBps = 1e9
_RADIX = {1.0: (8, 16), 2.0: (12, 24), 4.0: (10, 20)}  # switch ports a taper splits evenly


@dataclasses.dataclass
class Job:
    """One job: its name, graph, GPU count and array pytrees (``cluster.network`` holds the
    tables of ``topology``)."""

    name: str
    topology: Topology
    n_gpus: int
    model: object
    plan: object
    cluster: object
    params: object


def _fabric_domains(rng, hosts: int):
    """A fabric of ``hosts`` NIC ports and the domains it joins."""
    nic = LinkSpec(float(rng.choice([12.5, 25.0, 50.0])) * GBps, 1e-6)
    osub = float(rng.choice([1.0, 2.0, 4.0]))
    kind = rng.integers(3)
    if kind == 0:
        leaves = int(rng.choice([2, 4]))
        spines = int(rng.choice([1, 2]))
        return gen.leaf_spine(leaves, hosts // leaves, nic, osub, spines)
    if kind == 1:
        radix = int(rng.choice(_RADIX[osub]))
        down = radix * osub / (1.0 + osub)
        return gen.fat_tree(2, radix, nic, osub, hosts=min(hosts, int(radix * down)))
    return gen.tree(int(rng.choice([2, 4])), 2 if hosts <= 16 else 3, nic)


def random_graph(rng: np.random.Generator) -> Topology:
    """A random graph of 8 to 64 GPUs (see the module docstring)."""
    kind = rng.integers(4)
    nvlink = LinkSpec(float(rng.uniform(50.0, 450.0)) * GBps, 1e-6)
    if kind == 0:
        return load_topology(str(rng.choice(PRESETS)))
    if kind == 1:
        dims = [int(x) for x in rng.choice([2, 4], size=int(rng.integers(2, 4)))]
        return gen.torus(dims, nvlink)
    g = int(rng.choice([2, 4, 8]))
    domain = gen.switch_domain(g, nvlink) if kind == 2 else gen.mesh(g, nvlink.scaled(0.25))
    fabric = _fabric_domains(rng, 16)
    hosts = len(fabric.endpoints)
    for domains in (8, 4, 2):  # NICs per domain must divide the fabric's hosts
        nics = hosts // domains
        if hosts % domains == 0 and max(nics, g) % min(nics, g) == 0:
            return gen.hierarchical(domain, domains, fabric)
    return gen.hierarchical(domain, 1, fabric)


def _power_of_two_below(n: int, cap: int = 64) -> int:
    return int(2 ** np.floor(np.log2(min(n, cap))))


def random_overrides(rng: np.random.Generator, n_gpus: int, experts: bool) -> list[str]:
    """Config overrides of a random plan on ``n_gpus`` (a power of two)."""
    tp = int(rng.choice([t for t in (1, 2, 4, 8) if t <= n_gpus]))
    pp = int(rng.choice([p for p in (1, 2, 4) if tp * p <= n_gpus]))
    dp = n_gpus // (tp * pp)
    order = list(rng.permutation(["tp", "cp", "dp", "pp"]))
    zero = int(rng.choice([0, 1, 2, 3] if pp == 1 else [0, 1, 2]))
    out = [
        f"gpus={n_gpus}",
        f"plan.tp={tp}",
        f"plan.pp={pp}",
        f"plan.dp={dp}",
        "plan.cp=1",
        f"plan.zero={zero}",
        f"plan.sequence_parallel={'true' if tp > 1 and rng.random() < 0.5 else 'false'}",
        f"plan.order=[{','.join(order)}]",
        f"plan.global_batch={dp * 4 * pp}",
        "plan.schedule=1f1b",
        "plan.chunks=1",
    ]
    if experts:
        out.append(f"plan.ep={int(rng.choice([e for e in (1, 2, 4, 8) if dp % e == 0]))}")
    return out


def random_job(rng: np.random.Generator, index: int = 0) -> Job:
    """A random plan of a random example on a random graph (redrawn until the config is
    valid)."""
    while True:
        graph = random_graph(rng)
        n = _power_of_two_below(len(graph.endpoints))
        if n < 4:
            continue
        base = str(rng.choice(BASES))
        overrides = random_overrides(rng, n, experts=base.startswith("mixtral"))
        try:
            return job_of(graph, n, base, overrides, f"random {index}")
        except ConfigError:
            continue


def job_of(graph: Topology, n: int, base: str, overrides, label: str, links=False) -> Job:
    """The job of example ``base`` (a file of ``configs/examples``) with config ``overrides``
    on ``n`` GPUs of ``graph`` (``links``: per-link tables, ``build_tables(links=True)``).

    Raises:
        ConfigError: the overrides make an invalid config.
    """
    exp = api.load(EXAMPLES / base, overrides)
    model, plan, cluster = api.experiment_arrays(exp)
    tables = build_tables(graph, n, links=links)
    params = api.params_for(exp)[0]
    name = f"{label}: {Path(base).stem} on {graph.name} ({n} GPUs) " + " ".join(
        o.split(".")[-1] for o in overrides[1:7]
    )
    return Job(name, graph, n, model, plan, cluster.replace(network=tables), params)


def corpus(n: int, seed: int = 0) -> list[Job]:
    """``n`` random jobs."""
    rng = np.random.default_rng(seed)
    return [random_job(rng, i) for i in range(n)]
