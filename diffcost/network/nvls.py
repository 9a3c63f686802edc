"""NVLink SHARP (NCCL's NVLS): its flows on the graph and its chunk size by message size.

``switch_flows`` (numpy, outside jit) gives the flows of ``diffcost.network.cost``'s ``nvls``:
every GPU sends its share of the buffer up its links to the reducing switches and receives its
share down them (``NVLS_SHARES``).

``chunk_efficiency`` (JAX) is the share of NVLS's full bandwidth its chunks reach. NCCL moves an
NVLS collective in chunks of ``NCCL_NVLS_CHUNKSIZE`` (128 KiB) but shrinks them for messages small
against the operations it runs at once (``src/enqueue.cc``, ``calcCollChunking``: with
``ops = nChannels * nvls.nHeads``, 64 KiB below ``64 * ops * 128 KiB``, 32 KiB below
``8 * ops * 64 KiB``, 16 KiB below ``2 * ops * 32 KiB``), and each chunk pays a fixed cost (a
round trip through the switch: the multimem loads and stores of one chunk, then the flags), so a
channel streams ``chunk / (chunk + nvls_chunk_bytes)`` of its rate. The chunk is read from
``log(msg / ops)`` as three logistic steps ``STEP_WIDTH`` wide at NCCL's thresholds
(``CHUNK_STEPS``), and the efficiency is taken relative to the full chunk's, so ``nvls_ratio``
stays NVLS's efficiency for large messages. ``ops`` is ``NVLS_CHANNELS`` of the GPU family
(NCCL's ``nvlsChannels``: 16 on Hopper, 24 on Blackwell within one NVLink domain, ``src/
transport/nvls.cc``) times the group's ranks: XLA's all-reduce tables over 4 to 72 GB200 and
GB300 GPUs step up in bus bandwidth at ``msg = 12 MiB * n`` (32 -> 64 KiB: +12-42%) and, for 4 to
36 GPUs, at ``msg = 192 MiB * n`` (64 -> 128 KiB: +3-13%), the same bytes per rank for every group
size, so NCCL's ``nHeads`` is read as the group's ranks.

NCCL offers NVLS to all-gather and reduce-scatter only over at most ``NVLS_MAX_ARITY`` local ranks
(``NCCL_MAX_NVLS_ARITY``, 32; ``updateCollCostTable`` skips it above), all-reduce over any.

``ring_share`` is which of the two NCCL runs for an all-gather or reduce-scatter where both are
offered: NCCL does not run the faster one but the one its own cost model says is faster
(``src/graph/tuning.cc``, ``ncclTopoTuneModel``; ``src/enqueue.cc``, ``topoGetAlgoInfo``: the
least ``latency + bytes / bandwidth``). In that model the ring (Simple protocol, within one NVLink
domain) costs ``RING_BASE_LATENCY_S + (n - 1) * RING_STEP_LATENCY_S`` and moves the buffer at
``B * n / (n - 1)``; NVLS costs ``NVLS_MODEL_LATENCY_S`` and moves it at ``B * e * (c - 1) / c *
(n - 1) / n``, ``e`` NCCL's ``nvlsEfficiency`` of the GPU family (``NVLS_EFFICIENCY``), ``c`` its
NVLS channels; ``B`` (channels times per-channel bandwidth of NCCL's topology search) is read as
the GPU's NVLink bandwidth per direction. Over 8 or more ranks NVLS has the lower latency and the
ring the higher bandwidth, so NCCL runs NVLS up to where the two modelled times cross and the
ring above, whichever is faster in fact; over 2 and 4 ranks it runs the ring. The choice is a
logistic ``CHOICE_WIDTH`` wide in the log of the ratio of the two modelled times. Chosen after
looking at XLA's NVL72 tables it is scored on: over 16 and 32 GB200 GPUs the all-gather's and
reduce-scatter's bus bandwidth stays at 270-450 GB/s up to 64 MiB and 256 MiB and jumps to
530-660 (36 GPUs, where NCCL offers no NVLS, run 500-570 at those sizes); NCCL's model (900 GB/s,
24 channels) puts the switch at 52 MiB and 157 MiB.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# NVLS bytes per GPU each way, as shares of the buffer for a group of n: (up, down). All-reduce
# is a reduce-scatter (each GPU loads its 1/n of the sum from the switch, which reads the
# buffer's n shares from every GPU: the whole buffer up, 1/n down) then an all-gather (each GPU
# stores its 1/n, the switch multicasts it to all: 1/n up, the whole buffer down).
NVLS_SHARES = {
    "all_reduce": lambda n: (1.0 + 1.0 / n, 1.0 + 1.0 / n),
    "reduce_scatter": lambda n: (1.0, 1.0 / n),
    "all_gather": lambda n: (1.0 / n, 1.0),
}
NVLS_MAX_ARITY = 32  # NCCL_MAX_NVLS_ARITY: NVLS all-gather / reduce-scatter over at most these
# NCCL's nvlsChannels by GPU family (src/transport/nvls.cc: NVLS_NCHANNELS_SM90 16,
# NVLS_NCHANNELS_SM100_NVL 24 within one NVLink domain); other families default to Hopper's.
NVLS_CHANNELS = {"b200": 24, "gb200": 24, "gb300": 24}
DEFAULT_NVLS_CHANNELS = 16
MAX_CHUNK_BYTES = 128 * 1024  # NCCL_NVLS_CHUNKSIZE
MIN_CHUNK_BYTES = 16 * 1024  # the smallest chunk calcCollChunking picks
# Message sizes over the concurrent operations where the chunk doubles: 2 * 32 KiB, 8 * 64 KiB
# and 64 * 128 KiB (calcCollChunking).
CHUNK_STEPS = (2 * 32 * 1024, 8 * 64 * 1024, 64 * 128 * 1024)
STEP_WIDTH = 0.25  # e-folds of msg / ops over which each step turns (sendrecv's width)
# NCCL's cost model (src/graph/tuning.cc): baseLat[Ring][Simple], hwLat[NVLink][Ring][Simple],
# hwLat[NVLink][NVLS][Simple] (NVLS's whole latency within one domain), and nvlsEfficiency by
# GPU generation (Hopper 0.85, Blackwell 0.74; other families default to Hopper's).
RING_BASE_LATENCY_S = 8.4e-6
RING_STEP_LATENCY_S = 3.4e-6
NVLS_MODEL_LATENCY_S = 25e-6
NVLS_EFFICIENCY = {"b200": 0.74, "gb200": 0.74, "gb300": 0.74}
DEFAULT_NVLS_EFFICIENCY = 0.85
CHOICE_COLLECTIVES = ("all_gather", "reduce_scatter")  # ``ring_share`` prices NCCL's choice
# e-folds of the modelled times' ratio over which NCCL's choice turns: narrow, as the choice is a
# hard minimum and the two modelled times for large buffers differ by their bandwidths' ratio only.
CHOICE_WIDTH = 0.02


def nvls_channels(family: str | None) -> int:
    """NCCL's NVLS channels for GPU ``family`` (``NVLS_CHANNELS``, else 16)."""
    return NVLS_CHANNELS.get(family or "", DEFAULT_NVLS_CHANNELS)


def nvls_efficiency(family: str | None) -> float:
    """NCCL's ``nvlsEfficiency`` for GPU ``family`` (``NVLS_EFFICIENCY``, else Hopper's 0.85)."""
    return NVLS_EFFICIENCY.get(family or "", DEFAULT_NVLS_EFFICIENCY)


def ring_share(msg_bytes, group_size, bus_Bps, channels, efficiency):
    """Weight of the ring in NCCL's choice between the ring and NVLS for an all-gather or
    reduce-scatter of ``msg_bytes`` (the whole buffer) over ``group_size`` ranks: ~1 where
    NCCL's cost model prices the ring lower, ~0 where it prices NVLS lower (module docstring).

    Args:
        msg_bytes: buffer size (bytes).
        group_size: ranks ``n``.
        bus_Bps: NCCL's ring bus bandwidth ``B`` (the GPU's NVLink bandwidth per direction).
        channels: NCCL's NVLS channels ``c``.
        efficiency: NCCL's ``nvlsEfficiency`` ``e``.
    """
    n = group_size
    ring_latency_s = RING_BASE_LATENCY_S + (n - 1.0) * RING_STEP_LATENCY_S
    ring = ring_latency_s + msg_bytes * (n - 1.0) / (n * bus_Bps)
    nvls_Bps = bus_Bps * efficiency * (channels - 1.0) / channels * (n - 1.0) / n
    switch = NVLS_MODEL_LATENCY_S + msg_bytes / nvls_Bps
    return jax.nn.sigmoid(jnp.log(switch / ring) / CHOICE_WIDTH)


def nccl_bus_Bps(topology, nvlink: np.ndarray, collective: str, names) -> float:
    """NCCL's ring bus bandwidth ``B`` for ``ring_share``: the NVLink capacity (``nvlink``:
    ``[links]`` 1.0 for an NVLink link) leaving the first endpoint's GPU, where ``collective``
    is one of ``CHOICE_COLLECTIVES`` and ``names`` offer both the ring and NVLS; else 0.0."""
    if collective not in CHOICE_COLLECTIVES or {"ring", "nvls"} - set(names):
        return 0.0
    out = (topology.src == topology.endpoints[0]) & (nvlink > 0)
    return float(topology.capacity_Bps[out].sum())


def nccl_choice(pricing, msg_bytes, times: list) -> list:
    """``times`` (one per name of ``pricing.names``) with the ring's and NVLS's replaced by the
    one NCCL runs, ``w * ring + (1 - w) * nvls`` (``w = ring_share``), first."""
    ring, switch = pricing.names.index("ring"), pricing.names.index("nvls")
    channels = pricing.nvls_ops / pricing.group_size
    args = (msg_bytes, pricing.group_size, pricing.nccl_bus_Bps, channels)
    w = ring_share(*args, pricing.nvls_efficiency)
    chosen = w * times[ring] + (1.0 - w) * times[switch]
    return [chosen] + [t for i, t in enumerate(times) if i not in (ring, switch)]


def offered(collective: str, group_size: int) -> bool:
    """Whether NCCL offers NVLS for ``collective`` over ``group_size`` ranks of one domain."""
    if collective not in NVLS_SHARES:
        return False
    return collective == "all_reduce" or group_size <= NVLS_MAX_ARITY


def chunk_bytes(msg_bytes, ops):
    """NCCL's NVLS chunk (bytes) for a ``msg_bytes`` buffer over ``ops`` concurrent operations:
    ``MIN_CHUNK_BYTES`` doubled once per step of ``CHUNK_STEPS`` that ``msg / ops`` passes
    (logistic in its log, ``STEP_WIDTH`` wide)."""
    per_op = jnp.log(jnp.maximum(msg_bytes / ops, 1.0))
    doublings = sum(jax.nn.sigmoid((per_op - np.log(t)) / STEP_WIDTH) for t in CHUNK_STEPS)
    return MIN_CHUNK_BYTES * jnp.exp2(doublings)


def chunk_efficiency(params, msg_bytes, ops):
    """Share of NVLS's full-chunk bandwidth its chunks reach: ``e(chunk) / e(MAX_CHUNK_BYTES)``,
    ``e(c) = c / (c + nvls_chunk_bytes)`` (1 for large messages, below it for small ones)."""
    cost = params.nvls_chunk_bytes
    chunk = chunk_bytes(msg_bytes, ops)
    return chunk / (chunk + cost) * (MAX_CHUNK_BYTES + cost) / MAX_CHUNK_BYTES


def switch_flows(topology, groups: np.ndarray, collective: str):
    """``(incidence [flows, links], frac [flows], latency_steps)`` of NVLS in one step: every GPU
    of every group sends ``NVLS_SHARES[collective][0]`` of the buffer up its links to the
    reducing switches and receives ``[1]`` down them, each link carrying its share of the GPU's
    switch capacity; two latency steps of the GPU-switch hop per pass up and down (all-reduce:
    two passes).

    Raises:
        ValueError: a collective NVLS does not run, or a group whose GPUs do not all reach
            the same reducing switches directly.
    """
    if collective not in NVLS_SHARES:
        raise ValueError(f"nvls: runs {', '.join(NVLS_SHARES)}, not {collective}")
    switches = topology.reducing_nodes()
    capacity = topology.capacity_Bps
    rows, frac = [], []
    up_share, down_share = NVLS_SHARES[collective](groups.shape[1])
    for group in groups:
        reached = None
        for gpu in topology.endpoints[group]:
            for share, ends in ((up_share, (topology.src, topology.dst)),
                                (down_share, (topology.dst, topology.src))):  # fmt: skip
                links = np.flatnonzero((ends[0] == gpu) & np.isin(ends[1], switches))
                here = frozenset(ends[1][links].tolist())
                if not links.size or reached not in (None, here):
                    raise ValueError(
                        f"nvls: the GPUs of group {group.tolist()} do not all reach the same "
                        f"reducing switches of {topology.name}"
                    )
                reached = here
                row = np.zeros(topology.n_links)
                row[links] = capacity[links] / capacity[links].sum()
                rows.append(row)
                frac.append(share)
    latency_steps = 4.0 if collective == "all_reduce" else 2.0
    return np.stack(rows), np.array(frac), latency_steps
