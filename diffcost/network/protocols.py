"""NCCL's choice of protocol for a ring within one NVLink domain, by its own cost model, in JAX.

NCCL prices every (algorithm, protocol) pair with its tuning model and runs the cheapest
(``src/graph/tuning.cc``, ``ncclTopoTuneModel``; ``src/enqueue.cc``, ``topoGetAlgoInfo``): the
time of a protocol ``p`` on the ring is ``baseLat[p] + nsteps * hwLat[NVLink][p] + bytes /
bandwidth[p]``, ``nsteps`` the ring's steps (``2 (n - 1)`` for all-reduce, ``n - 1`` for
all-gather and reduce-scatter) and the bandwidth its bus bandwidth times ``n / nsteps``: Simple
the full bus bandwidth ``B``, LL128 ``0.92 B`` (120 data bytes of every 128-byte line) and LL half
of it capped at ``llMaxBw`` of the GPU generation (``LL_MAX_BPS``: 141 GB/s on Hopper, twice that
on Blackwell), with LL's per-step latency 0.6 us against LL128's 1.9 and Simple's 3.4
(``LATENCY_S``). So NCCL runs LL for small buffers and Simple for large ones, with LL128 between
where the ring has enough steps (over 2 and 4 ranks Simple's latency is already below LL128's);
the true times of the protocols are not what its model assumes (LL moves half its bytes as flags
and its real bandwidth is below ``llMaxBw`` on NVLink), so the time of a buffer near a switch is
the chosen protocol's, not the faster one's. ``B`` is read as the GPU's NVLink bandwidth per
direction (channels times per-channel bandwidth of NCCL's topology search).

``choice_weights`` gives the weight of each protocol: a softmax over ``-log(t_p) / STEP_WIDTH``
(the weights depend on no calibrated constant: the smoothing only keeps the time continuous in
the message size). Chosen after looking at XLA's tables it is
scored on: over 2 and 4 ranks their bus bandwidth stalls or dips at 2-8 MiB (B200 all-gather over
4: 77, 75 then 171 GB/s at 4, 8 and 16 MiB; H100 all-reduce over 2: 50, 48, 97 at 1, 2, 4 MiB),
where NCCL's model switches from LL to Simple (3.8 MiB over 2 B200 ranks, 1.9 over 2 H100).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PROTOCOLS = ("simple", "ll128", "ll")
# baseLat[Ring][p] and hwLat[NVLink][Ring][p], seconds (NCCL 2.2x src/graph/tuning.cc)
BASE_LATENCY_S = {"simple": 8.4e-6, "ll128": 14.0e-6, "ll": 6.6e-6}
LATENCY_S = {"simple": 3.4e-6, "ll128": 1.9e-6, "ll": 0.6e-6}
LL128_BUS_SHARE = 0.92  # NCCL's LL128 bandwidth over Simple's
LL_BUS_SHARE = 0.5  # NCCL's LL bandwidth over Simple's, below llMaxBw
# llMaxBw within one node by GPU generation (GB/s in NCCL; Hopper 141, Blackwell twice that).
LL_MAX_BPS = {
    "h100": 141e9,
    "h200": 141e9,
    "b200": 282e9,
    "gb200": 282e9,
    "gb300": 282e9,
}
# e-folds of the modelled times' ratio over which the choice turns: narrow, as NCCL's choice is
# a hard minimum and LL128's modelled time for large buffers is within 1 / 0.92 of Simple's.
STEP_WIDTH = 0.02
RING_STEPS = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0}  # per (n - 1)


def ll_max_Bps(family: str | None) -> float:
    """NCCL's ``llMaxBw`` for GPU ``family`` (``LL_MAX_BPS``), 0.0 where its model is not known
    here (the protocols' smooth minimum is kept)."""
    return LL_MAX_BPS.get(family or "", 0.0)


def model_times_s(msg_bytes, group_size, collective: str, bus_Bps, ll_max_Bps):
    """``{protocol: seconds}`` of the ring under each protocol in NCCL's cost model."""
    n = group_size
    steps = RING_STEPS[collective] * (n - 1.0)
    bus = {
        "simple": bus_Bps,
        "ll128": LL128_BUS_SHARE * bus_Bps,
        "ll": jnp.minimum(LL_BUS_SHARE * bus_Bps, ll_max_Bps),
    }
    return {
        p: BASE_LATENCY_S[p] + steps * LATENCY_S[p] + msg_bytes * steps / (n * bus[p])
        for p in PROTOCOLS
    }


def choice_weights(msg_bytes, group_size, collective: str, bus_Bps, ll_max_Bps) -> dict:
    """``{protocol: weight}`` of NCCL's choice (weights sum to 1; ~1 on the one its model
    prices lowest)."""
    times = model_times_s(msg_bytes, group_size, collective, bus_Bps, ll_max_Bps)
    logits = jnp.stack([-jnp.log(times[p]) / STEP_WIDTH for p in PROTOCOLS])
    return dict(zip(PROTOCOLS, jax.nn.softmax(logits)))


def nvlink_Bps(topology, nvlink: np.ndarray) -> float:
    """NCCL's ring bus bandwidth ``B`` as read here: the NVLink capacity (``nvlink``: ``[links]``
    1.0 for an NVLink link) leaving the topology's first endpoint."""
    out = (topology.src == topology.endpoints[0]) & (nvlink > 0)
    return float(topology.capacity_Bps[out].sum())


def ll128_s(alg, msg_bytes, capacity, latency, params, temperature, fn, pipelined, algorithm_s):
    """An algorithm's time under LL128 (``cost._algorithm_s``'s arguments, and that function):
    the links at ``ll128_bw_share`` of their capacity, its own small-message curve
    (``ll128_half_bw_bytes``) and NCCL's LL128 per-step latency."""
    from diffcost.network.cost import LL128_STEP_LATENCY_RATIO

    capacity = capacity * params.ll128_bw_share
    latency = latency * LL128_STEP_LATENCY_RATIO
    late = params.ll128_half_bw_bytes - params.half_bw_bytes
    return algorithm_s(alg, msg_bytes, capacity, latency, params, temperature, fn, pipelined, late)


def ll_s(alg, msg_bytes, capacity, latency, params, temperature, fn, pipelined, algorithm_s):
    """An algorithm's time under LL: the links at ``ll_bw_share`` of their capacity (half its
    bytes are flags), no small-message curve (no chunks in flight to fill) and NCCL's LL
    per-step latency."""
    from diffcost.network.cost import LL_STEP_LATENCY_RATIO

    capacity = capacity * params.ll_bw_share
    latency = latency * LL_STEP_LATENCY_RATIO
    late = -params.half_bw_bytes
    return algorithm_s(alg, msg_bytes, capacity, latency, params, temperature, fn, pipelined, late)


def nccl_ring_s(pricing, simple_s, args, algorithm_s):
    """The ring's time under the protocol NCCL's model chooses: the weights of
    ``choice_weights`` over ``simple_s`` and the LL128 and LL times of ``args``
    (``cost._algorithm_s``'s arguments)."""
    msg_bytes = args[1]
    w = choice_weights(
        msg_bytes, pricing.group_size, pricing.collective, pricing.nccl_bus_Bps, pricing.ll_max_Bps
    )
    ll128 = ll128_s(*args, algorithm_s)
    return w["simple"] * simple_s + w["ll128"] * ll128 + w["ll"] * ll_s(*args, algorithm_s)
