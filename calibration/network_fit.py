"""Fit the constants only the graph path uses (``diffcost.network.cost``) to collective tables.

``calibration.fit`` fits every constant ``diffcost.comm`` uses; the in-switch reduction's
constants (``SWITCH_CONSTANTS``: NVLink SHARP's efficiency as a share of the cluster's
``nvlink_eff`` and its fixed cost per call) and the XLA tables' chunk pass (``chunk_pass_Bps``)
enter only the graph path, so the joint fit leaves them at their prior. This fits such device
constants per GPU family, and optionally cluster constants per cluster (``nvlink_eff``, which
``comm``'s fit set without them), on tables priced on the graph, with everything else held at
the clusters' profiles: the same robust penalty on
``log(predicted / measured)`` as the joint fit (Huber turning into Cauchy,
``FitConfig.redescend``) plus the same Gaussian prior around the datasheet defaults
(``Constant.prior_sd``, ``FitConfig.prior_weight``), by Adam.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from calibration.fit import FitConfig, robust_penalty
from diffcost.params import CONSTANT, Params, raw_default

SWITCH_CONSTANTS = ("nvls_ratio", "nvls_latency_s")
# NCCL's LL128 protocol beside Simple (``diffcost.network.cost``'s ``protocols``).
PROTOCOL_CONSTANTS = ("ll128_bw_share", "ll128_half_bw_bytes")
# With LL128 beside it, the Simple protocol's small-message curve is its own: ``comm``'s fit set
# ``half_bw_bytes`` for one curve serving every size, so a cluster priced with ``protocols``
# refits it, the NVLink hop latency, which ``comm``'s fit set for one protocol's steps (LL128's
# are ``LL128_STEP_LATENCY_RATIO`` of Simple's) and without NVLS beside the ring, and the cost
# per call (XLA's table times each collective as one executable's run, ``compute_time_ns`` of
# its execution profile, median of 5, not as nccl-tests' loop of back-to-back calls; ``comm``'s
# one curve had absorbed part of that cost).
PROTOCOL_CLUSTER_CONSTANTS = ("half_bw_bytes", "nvlink_latency_scale", "collective_overhead_s")
# What ``benchmarks/topology_collectives.py`` fits: per GPU family the XLA tables' chunk pass,
# send/recv curve, channels and peers in flight (``diffcost.network.sendrecv``), LL128
# protocol and NVLS's cost per chunk (``diffcost.network.nvls``); per cluster its NVLink
# efficiency (the profiles' value was fitted by
# ``diffcost.comm``, whose one ring bandwidth per cluster absorbs the chunk pass) and, as device
# constants fitted per cluster (``SwitchFit(cluster_device=)``), the switch constants: NVLS's
# efficiency over the ring's and its fixed cost per call are set by the software that runs it
# (NCCL's version, the runtime launching it: nccl-tests on a DGX against XLA's programs) as much
# as by the switch.
GRAPH_CONSTANTS = (
    "chunk_pass_Bps",
    "chunk_reduce_Bps",
    "sendrecv_half_bw_bytes",
    "sendrecv_peer_bytes",
    "sendrecv_small_share",
    "sendrecv_peer_max_share",
    "sendrecv_concurrency",
    "sendrecv_balance_bytes",
    "sendrecv_channel_need",
    *PROTOCOL_CONSTANTS,
    "nvls_chunk_bytes",
)
GRAPH_CLUSTER_CONSTANTS = ("nvlink_eff",)
GRAPH_CLUSTER_DEVICE_CONSTANTS = SWITCH_CONSTANTS
# What a cluster's network transport (``ClusterSpec.transport``) adds to its own constants: over
# TCP the NIC's efficiency, latency and small-message curve (which ``comm``'s fit set for
# RDMA-like rings) and the two regimes of ``diffcost.network.cost``'s ``tcp`` pricing.
TRANSPORT_CONSTANTS = {
    "rdma": (),
    "tcp": ("nic_eff", "nic_latency_scale", "half_bw_bytes", "tcp_ring_share", "tcp_fill_s"),
}


@dataclasses.dataclass(frozen=True, eq=False)
class PricedTable:
    """One measured table priced on a graph.

    Attributes:
        cluster, family: where it was measured and the GPU family whose constants it informs.
        price: ``(params, sizes) -> seconds`` (jit- and grad-able in ``params``).
        sizes: ``[rows]`` message sizes (bytes).
        measured_s: ``[rows]`` measured times.
        params: the cluster's constants the fit starts from and holds.
    """

    cluster: str
    family: str
    price: Callable[[Params, jax.Array], jax.Array]
    sizes: np.ndarray
    measured_s: np.ndarray
    params: Params


def _check(names, level: str) -> list:
    unknown = [n for n in names if n not in CONSTANT]
    if unknown:
        raise ValueError(f"unknown constants {unknown}: expected names of diffcost.params")
    wrong = [n for n in names if CONSTANT[n].level != level]
    if wrong:
        raise ValueError(f"constants {wrong} are not {level} constants (diffcost.params)")
    return [CONSTANT[n] for n in names]


class SwitchFit:
    """The fit of ``names`` per GPU family of ``tables``, of ``cluster_names`` (cluster
    constants) and ``cluster_device`` (device constants) per cluster and of
    ``cluster_extra[cluster]`` for that cluster alone (its transport's), compiled once per
    family (the whole Adam run in one program, the family's clusters in it)
    and run for any row weights (``fit``).

    Every row of weight 1 weighs the same; the prior is ``cfg.prior_weight`` times the squared
    distance of each raw constant from its datasheet default in units of its prior width, as
    in ``calibration.fit``; the penalty turns from Huber's into Cauchy's over
    ``cfg.redescend`` of ``steps``.

    Raises:
        ValueError: an unknown constant name, or one of another level (``names`` and
            ``cluster_device`` are device constants, ``cluster_names`` and ``cluster_extra``
            cluster constants).
    """

    def __init__(
        self,
        tables: list[PricedTable],
        names: tuple[str, ...] = SWITCH_CONSTANTS,
        cfg: FitConfig | None = None,
        steps: int = 200,
        learning_rate: float = 0.05,
        cluster_names: tuple[str, ...] = (),
        cluster_extra: dict[str, tuple[str, ...]] | None = None,
        cluster_device: tuple[str, ...] = (),
    ):
        self.tables = list(tables)
        self.constants = _check(names, "device")
        self.cluster_constants = _check(cluster_names, "cluster") + _check(cluster_device, "device")
        self.extra = {k: _check(v, "cluster") for k, v in (cluster_extra or {}).items()}
        self.cfg = dataclasses.replace(cfg or FitConfig(), steps=steps)
        self.learning_rate = learning_rate
        self.families = sorted({t.family for t in self.tables})
        self._runs = {f: self._compile(f) for f in self.families}

    def _compile(self, family: str):
        mine = [t for t in self.tables if t.family == family]
        clusters = sorted({t.cluster for t in mine})
        own = {c: self.cluster_constants + self.extra.get(c, []) for c in clusters}
        per = self.constants + [c for name in clusters for c in own[name]]
        n_dev = len(self.constants)
        leaves = [c.leaf for c in self.constants]
        start = dict(zip(clusters, n_dev + np.cumsum([0] + [len(own[c]) for c in clusters])))
        raw0 = jnp.stack([raw_default(c) for c in per])
        width = jnp.asarray([c.prior_sd for c in per])
        cfg, opt = self.cfg, optax.adam(self.learning_rate)
        lo, hi = (f * cfg.steps for f in cfg.redescend)
        sizes = [jnp.asarray(t.sizes, dtype=float) for t in mine]
        log_meas = [jnp.log(jnp.asarray(t.measured_s, dtype=float)) for t in mine]
        first = [int(start[t.cluster]) for t in mine]
        cl_leaves = [[c.leaf for c in own[t.cluster]] for t in mine]

        def loss(raw, redescend, weights):
            total, rows = 0.0, 0.0
            for t, size, meas, w, k, cl in zip(mine, sizes, log_meas, weights, first, cl_leaves):
                values = dict(zip(leaves, raw[:n_dev])) | dict(zip(cl, raw[k : k + len(cl)]))
                resid = jnp.log(t.price(t.params.replace(**values), size)) - meas
                total = total + jnp.sum(w * robust_penalty(resid, cfg.huber_delta, redescend))
                rows = rows + jnp.sum(w)
            prior = jnp.sum(jnp.square((raw - raw0) / width))
            return total / jnp.maximum(rows, 1.0) + cfg.prior_weight * prior

        def run(weights):
            def step(i, carry):
                raw, state = carry
                redescend = jnp.clip((i - lo) / max(hi - lo, 1e-9), 0.0, 1.0)
                updates, state = opt.update(jax.grad(loss)(raw, redescend, weights), state)
                return optax.apply_updates(raw, updates), state

            return jax.lax.fori_loop(0, cfg.steps, step, (raw0, opt.init(raw0)))[0]

        return jax.jit(run), mine, [(c, int(start[c]), own[c]) for c in clusters]

    def fit(self, keep: dict | None = None) -> dict[str, dict[str, float]]:
        """``{cluster: {name: constrained value}}``: each cluster's own constants and its
        family's, fitted on the rows ``keep[id(table)]`` (``[rows]`` booleans; default every
        row) of each family's tables."""
        keep = keep or {}
        squash = {"log": np.exp, "logit": lambda x: 1.0 / (1.0 + np.exp(-x))}
        out = {}
        for run, mine, clusters in self._runs.values():
            weights = tuple(
                jnp.asarray(keep.get(id(t), np.ones(len(t.sizes), bool)), dtype=float) for t in mine
            )
            with jax.numpy_dtype_promotion("standard"):  # optax mixes its int32 step count in
                raw = np.asarray(run(weights))
            device = {c.name: float(squash[c.transform](r)) for c, r in zip(self.constants, raw)}
            for cluster, k, constants in clusters:
                out[cluster] = device | {
                    c.name: float(squash[c.transform](r))
                    for c, r in zip(constants, raw[k : k + len(constants)])
                }
        return out


def fit_switch_constants(tables: list[PricedTable], **kwargs) -> dict[str, dict[str, float]]:
    """``SwitchFit(tables, **kwargs).fit()``: the constants fitted on every row, per cluster."""
    return SwitchFit(tables, **kwargs).fit()
