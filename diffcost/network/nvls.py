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


def nvls_channels(family: str | None) -> int:
    """NCCL's NVLS channels for GPU ``family`` (``NVLS_CHANNELS``, else 16)."""
    return NVLS_CHANNELS.get(family or "", DEFAULT_NVLS_CHANNELS)


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
