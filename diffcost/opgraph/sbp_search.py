"""Searching per-operator SBP signatures: relaxed gradient descent and its baselines.

The problem (``sbp.SbpProblem`` with ``sbp.SbpCosts``) is a pairwise cost over one choice per
node: ``sum_i node_s[i, s_i] + sum_e edge_s[e, s_u(e), s_v(e)]``.

* ``gradient_search``: the project's relaxed-plan style. Each node holds logits over its
  signatures; the probabilities ``softmax(logits)`` are independent, so the expected cost
  ``sum_i p_i . node_s_i + sum_e p_u^T edge_s_e p_v`` is exact at one-hot choices and smooth in
  between. Adam (``descent.descend``) minimizes the expected cost minus a temperature times
  the choices' entropy (deterministic annealing), from many random starts at once (``vmap``)
  while the temperature falls geometrically. Each start is rounded node by node by
  conditional expectations (never above its mixture's expected cost), evaluated exactly, and
  the best is polished by local search over single and paired changes (as ``search.py``
  polishes its rounded plans).
* ``coordinate_descent``: AutoDDL's baseline. From a start (each node's cheapest own cost),
  visit the nodes in order and give each the signature that is cheapest with its neighbours
  fixed, until a full sweep changes nothing.
* ``exact_tree``: dynamic programming on a forest (the use graph without cycles once parallel
  uses are merged): leaves to root, each node's table of best subtree costs per signature.
* ``brute_force``: every assignment, for tiny problems.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from diffcost import descent
from diffcost.opgraph.sbp import SbpCosts, SbpProblem

_MASKED = -1e9


@dataclasses.dataclass(frozen=True)
class SbpSolution:
    """One signature index per node and the exact cost (seconds) of that assignment;
    ``rounded_s``: for a gradient search, the cost of its best rounded start before polishing."""

    choice: tuple[int, ...]
    cost_s: float
    method: str
    rounded_s: float | None = None


def _numpy(problem: SbpProblem, costs: SbpCosts):
    node = np.asarray(costs.node_s, dtype=float)
    edge = np.asarray(costs.edge_s, dtype=float)
    return node, edge, problem.edges(), problem.valid()


def assignment_cost_s(problem: SbpProblem, costs: SbpCosts, choice) -> float:
    """Exact seconds of the assignment ``choice`` (one signature index per node)."""
    node, edge, edges, valid = _numpy(problem, costs)
    c = np.asarray(choice, dtype=np.int64)
    ok = c.shape == (len(problem.nodes),) and bool(np.all((c >= 0) & (c < valid.shape[1])))
    if not ok or not valid[np.arange(len(c)), c].all():
        raise ValueError(f"assignment_cost_s: choice {choice} is not one valid index per node")
    total = node[np.arange(len(c)), c].sum()
    if len(edges):
        total += edge[np.arange(len(edges)), c[edges[:, 0]], c[edges[:, 1]]].sum()
    return float(total)


def _local_costs(i, c, node, edge, edges, valid, incident):
    """Cost of every signature of node ``i`` with the others fixed at ``c`` (inf if invalid)."""
    out = node[i].copy()
    for e in incident[i]:
        u, v = edges[e]
        out += edge[e, :, c[v]] if u == i else edge[e, c[u], :]
    return np.where(valid[i], out, np.inf)


def coordinate_descent(
    problem: SbpProblem, costs: SbpCosts, start=None, max_sweeps: int = 100
) -> SbpSolution:
    """AutoDDL's coordinate descent from ``start`` (default: each node's cheapest own cost)."""
    node, edge, edges, valid = _numpy(problem, costs)
    incident = _incident(problem, edges)
    if start is None:
        start = np.argmin(np.where(valid, node, np.inf), axis=1)
    c = np.asarray(start, dtype=np.int64).copy()
    for _ in range(max_sweeps):
        changed = False
        for i in range(len(c)):
            local = _local_costs(i, c, node, edge, edges, valid, incident)
            best = int(np.argmin(local))
            if local[best] < local[c[i]] - 1e-15 * abs(local[c[i]]):
                c[i], changed = best, True
        if not changed:
            break
    return SbpSolution(tuple(int(x) for x in c), assignment_cost_s(problem, costs, c), "cd")


def _incident(problem: SbpProblem, edges) -> list[list[int]]:
    incident: list[list[int]] = [[] for _ in problem.nodes]
    for e, (u, v) in enumerate(edges):
        incident[u].append(e)
        if v != u:
            incident[v].append(e)
    return incident


def _pair_table(u, v, c, node, edge, edges, valid, incident):
    """Cost terms that involve node ``u`` or ``v`` for every pair of their signatures with
    the others fixed at ``c``, ``[K, K]`` (inf where either is invalid)."""
    table = node[u][:, None] + node[v][None, :]
    for i, axis in ((u, 0), (v, 1)):
        for e in incident[i]:
            a, b = edges[e]
            if {a, b} == {u, v}:
                if axis == 0:  # the uses between u and v, once
                    table = table + (edge[e] if a == u else edge[e].T)
                continue
            row = edge[e, :, c[b]] if a == i else edge[e, c[a], :]
            table = table + (row[:, None] if axis == 0 else row[None, :])
    ok = valid[u][:, None] & valid[v][None, :]
    return np.where(ok, table, np.inf)


def pair_descent(problem: SbpProblem, costs: SbpCosts, start, max_sweeps: int = 20):
    """Local search over joint changes of the two ends of each use (a weight and the product
    reading it change together), alternating with ``coordinate_descent`` until neither
    improves. Each pair's move is priced from the terms that involve its two nodes only."""
    node, edge, edges, valid = _numpy(problem, costs)
    incident = _incident(problem, edges)
    best = coordinate_descent(problem, costs, start=start)
    pairs = sorted({tuple(sorted(e)) for e in edges.tolist() if e[0] != e[1]})
    for _ in range(max_sweeps):
        c = np.asarray(best.choice, dtype=np.int64)
        improved = False
        for u, v in pairs:
            table = _pair_table(u, v, c, node, edge, edges, valid, incident)
            a, b = np.unravel_index(int(np.argmin(table)), table.shape)
            now = table[c[u], c[v]]
            if table[a, b] < now - 1e-12 * max(best.cost_s, abs(now)):
                c[u], c[v], improved = a, b, True
        if not improved:
            break
        best = coordinate_descent(problem, costs, start=c)
    return best


def brute_force(problem: SbpProblem, costs: SbpCosts, limit: int = 200_000) -> SbpSolution:
    """The exact optimum by enumeration (at most ``limit`` assignments)."""
    sizes = [len(n.signatures) for n in problem.nodes]
    if np.prod(sizes, dtype=float) > limit:
        raise ValueError(f"brute_force: {np.prod(sizes, dtype=float):.3g} assignments > {limit}")
    best = min(
        itertools.product(*(range(s) for s in sizes)),
        key=lambda c: assignment_cost_s(problem, costs, c),
    )
    return SbpSolution(best, assignment_cost_s(problem, costs, best), "brute_force")


def _merged_edges(edges, edge):
    """Parallel uses between the same two nodes summed into one matrix ``{(u, v): [K, K]}``."""
    merged: dict[tuple[int, int], np.ndarray] = {}
    for (u, v), m in zip(edges, edge):
        key, mat = ((u, v), m) if u < v else ((v, u), m.T)
        merged[key] = merged.get(key, 0.0) + mat
    return merged


def is_forest(problem: SbpProblem) -> bool:
    """Whether the use graph, parallel uses merged, has no cycle."""
    parent = list(range(len(problem.nodes)))

    def root(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for u, v in {tuple(sorted(e)) for e in problem.edges().tolist()}:
        ru, rv = root(u), root(v)
        if ru == rv:
            return False
        parent[ru] = rv
    return True


def exact_tree(problem: SbpProblem, costs: SbpCosts) -> SbpSolution:
    """The exact optimum of a forest-shaped problem by dynamic programming."""
    if not is_forest(problem):
        raise ValueError("exact_tree: the use graph has a cycle; use brute_force or a search")
    node, edge, edges, valid = _numpy(problem, costs)
    merged = _merged_edges(edges, edge)
    nbrs: list[list[int]] = [[] for _ in problem.nodes]
    for u, v in merged:
        nbrs[u].append(v)
        nbrs[v].append(u)
    local = np.where(valid, node, np.inf)
    choice = np.zeros(len(problem.nodes), dtype=np.int64)
    seen = np.zeros(len(problem.nodes), dtype=bool)
    total = 0.0
    for r in range(len(problem.nodes)):
        if seen[r]:
            continue
        order, parent, stack = [], {r: -1}, [r]  # depth-first order from root r
        while stack:
            x = stack.pop()
            seen[x] = True
            order.append(x)
            for y in nbrs[x]:
                if y != parent[x]:
                    parent[y] = x
                    stack.append(y)
        table = {x: local[x].copy() for x in order}
        best_child: dict[int, np.ndarray] = {}
        for x in reversed(order[1:]):  # fold each subtree into its parent
            p = parent[x]
            m = merged[(p, x)] if (p, x) in merged else merged[(x, p)].T  # [K_p, K_x]
            full = m + table[x][None, :]
            best_child[x] = np.argmin(full, axis=1)
            table[p] = table[p] + full.min(axis=1)
        choice[r] = int(np.argmin(table[r]))
        total += float(table[r][choice[r]])
        for x in order[1:]:
            choice[x] = best_child[x][choice[parent[x]]]
    cost = assignment_cost_s(problem, costs, choice)
    return SbpSolution(tuple(int(x) for x in choice), cost, "dp")


def expected_cost_s(logits, node_s, edge_s, edges, mask):
    """Expected seconds under independent ``softmax(logits)`` choices per node."""
    p = jax.nn.softmax(logits + mask, axis=-1)
    pu, pv = p[edges[:, 0]], p[edges[:, 1]]
    pair = jnp.einsum("ea,eab,eb->", pu, edge_s, pv)
    return jnp.sum(p * node_s) + pair


def free_energy(logits, node_s, edge_s, edges, mask, temperature):
    """Expected cost minus ``temperature`` times the choices' entropy (deterministic
    annealing: at a high temperature the uniform mixture is optimal, as it falls the
    choices harden one by one)."""
    p = jax.nn.softmax(logits + mask, axis=-1)
    entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0))
    return expected_cost_s(logits, node_s, edge_s, edges, mask) - temperature * entropy


@dataclasses.dataclass(frozen=True)
class GradientConfig:
    """Relaxed-search settings: random starts, Adam steps and rate, the temperature paths
    (geometric from each of ``tau_starts`` to ``tau_end``, in units of the mean cost per node
    of the replicated assignment)."""

    restarts: int = 64
    steps: int = 400
    learning_rate: float = 0.2
    tau_starts: tuple[float, ...] = (1.0, 0.3, 0.1, 0.03)  # the restarts take these in turn
    tau_end: float = 0.001
    init_scales: tuple[float, ...] = (1.0, 3.0)  # spread of the random starting logits
    polish: bool = True
    seed: int = 0

    def __post_init__(self):
        for name in ("restarts", "steps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"GradientConfig.{name}: {getattr(self, name)}; must be >= 1")
        for name in ("learning_rate", "tau_end"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GradientConfig.{name}: {getattr(self, name)}; must be > 0")
        if not self.tau_starts or not self.init_scales:
            raise ValueError("GradientConfig: tau_starts and init_scales need one value or more")


def relaxed_descent(problem: SbpProblem, costs: SbpCosts, cfg: GradientConfig):
    """Final logits ``[restarts, n_nodes, K]`` of Adam on the normalized expected cost."""
    valid = problem.valid()
    mask = jnp.where(jnp.asarray(valid), 0.0, _MASKED)
    node_s = jnp.where(jnp.asarray(valid), costs.node_s, 0.0)
    edges = jnp.asarray(problem.edges()).reshape(-1, 2)
    replicated = [len(n.signatures) - 1 for n in problem.nodes]  # all B: always valid
    scale = max(assignment_cost_s(problem, costs, replicated) / len(problem.nodes), 1e-30)

    def loss(logits, tau):
        return free_energy(logits, node_s / scale, costs.edge_s / scale, edges, mask, tau)

    key = jax.random.PRNGKey(cfg.seed)
    scales = jnp.resize(jnp.repeat(jnp.asarray(cfg.init_scales), len(cfg.tau_starts)), cfg.restarts)
    starts = scales[:, None, None] * jax.random.normal(key, (cfg.restarts, *valid.shape))
    taus = jnp.stack([descent.geometric(t, cfg.tau_end, cfg.steps) for t in cfg.tau_starts])
    taus = jnp.tile(taus, (-(-cfg.restarts // len(cfg.tau_starts)), 1))[: cfg.restarts]
    optimizer = descent.adam(cfg.learning_rate, cfg.steps)
    run = lambda x0, tau: descent.descend(loss, x0, optimizer, (tau,))[0]  # noqa: E731
    return jax.jit(jax.vmap(run))(starts, taus) + mask


def conditional_rounding(problem: SbpProblem, costs: SbpCosts, probs) -> tuple[int, ...]:
    """Round a mixture node by node (method of conditional expectations): each node in turn
    takes the signature of least expected cost given the nodes already fixed and the others'
    probabilities. The expected cost never rises, so the result costs at most the mixture's
    expected cost."""
    node, edge, edges, valid = _numpy(problem, costs)
    p = np.where(valid, np.asarray(probs, dtype=float), 0.0)
    incident = _incident(problem, edges)
    choice = np.zeros(len(problem.nodes), dtype=np.int64)
    for i in range(len(problem.nodes)):
        local = node[i].copy()
        for e in incident[i]:
            u, v = edges[e]
            local += edge[e] @ p[v] if u == i else p[u] @ edge[e]
        choice[i] = int(np.argmin(np.where(valid[i], local, np.inf)))
        p[i] = np.eye(p.shape[1])[choice[i]]
    return tuple(int(x) for x in choice)


def gradient_search(
    problem: SbpProblem, costs: SbpCosts, cfg: GradientConfig | None = None, starts=()
) -> SbpSolution:
    """The best rounded start of the relaxed descent, polished by ``pair_descent`` when
    ``cfg.polish`` (method ``"gradient"``; ``"gradient+local"`` if polishing changed it).

    ``starts``: known assignments (a data-parallel plan) that compete with the rounded starts
    before polishing; when one of them is the best, the method says ``"start"`` instead of
    ``"gradient"`` (``rounded_s`` stays the best rounded start's cost)."""
    cfg = cfg or GradientConfig()
    logits = np.asarray(relaxed_descent(problem, costs, cfg))
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    rounded = [conditional_rounding(problem, costs, p) for p in probs]
    scored = sorted((assignment_cost_s(problem, costs, c), c) for c in set(rounded))
    cost, best = scored[0]
    method, rounded_s = "gradient", cost
    for start in starts:
        start_s = assignment_cost_s(problem, costs, start)
        if start_s < cost:
            cost, best, method = start_s, tuple(int(x) for x in start), "start"
    if cfg.polish:
        polished = pair_descent(problem, costs, start=best)
        if polished.cost_s < cost:
            return SbpSolution(polished.choice, polished.cost_s, f"{method}+local", rounded_s)
    return SbpSolution(best, cost, method, rounded_s)


def describe(problem: SbpProblem, solution: SbpSolution) -> list[tuple[str, str]]:
    """``(node name, signature name)`` of every node of a solution."""
    return [(node.name, node.signatures[s].name) for node, s in zip(problem.nodes, solution.choice)]
