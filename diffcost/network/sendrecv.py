"""Channels of grouped sends and receives by per-peer size (XLA's all-to-all), in JAX.

NCCL stripes each send of a group over a number of channels that grows with its bytes
(``src/enqueue.cc``, ``calcP2pChannelCount``: starting from the fewest channels a peer gets when
every peer of the communicator has one, the count doubles while each channel would carry more
than its maximum). An all-to-all over ``n`` ranks sends ``msg / n`` to each peer, so a small
buffer over many ranks runs every send on few channels, below the links' bandwidth. XLA's
collective table shows it as a step: over NVL72 groups of 8 to 72 GPUs the all-to-all's
algorithm bandwidth stays at 80-150 GB/s while ``msg / n`` is at most 0.5 MiB and jumps to
240-400 GB/s at 1 MiB (a 64 MiB buffer over 64 GPUs takes less time than a 32 MiB one).

``peer_share`` prices it as a logistic step in ``log(msg / n)``: ``sendrecv_small_share`` of
the bandwidth well below ``sendrecv_peer_bytes``, all of it well above, over
``STEP_WIDTH`` (natural log) either side. The form was chosen from those rows; the two
constants are fitted per GPU family (``calibration.network_fit``). One peer's send takes at most
NCCL's channels per peer (``p2pnChannelsPerPeer``: ``nChannelsMax`` in
``scheduleP2pTasksToPlan``) of its p2p channels, so the sends to few peers at once use fewer
channels than to many: the share is also capped at ``(n - 1) * sendrecv_peer_max_share``. That
was chosen after looking at XLA's all-to-all over 2 GPUs: at 2 GiB 424 GB/s of bus bandwidth on
B200 where 8 GPUs reach 588 (H100: 321 and 340), which no one efficiency per link gives.

``peers_in_flight`` is how many peers' sends run at once. NCCL runs the sends and receives of a
group (an all-to-all: ``ncclGroupStart``, one ``ncclSend`` and one ``ncclRecv`` per peer,
``ncclGroupEnd``) as one kernel whose p2p channels each work on several peers' operations at
once; the peers it targets concurrently are its p2p channels over the channels each peer's
operation takes, times the operations a channel's work batch holds (``src/enqueue.cc``,
``addP2pToPlan``, ``NCCL_MAX_DEV_WORK_P2P_PER_BATCH``). So the ``n - 1`` path latencies of the
pairwise sends are paid ``sendrecv_concurrency`` at a time while each peer's send takes few
channels, and one after another once each takes all of them: ``c ** (1 - step)``, the same step
in the bytes per peer as ``peer_share``. The form was chosen after looking at XLA's NVL72
all-to-all rows it is fitted on: at 1 MiB the time does not grow from 8 to 32 GPUs (18-21 us,
where ``n - 1`` latencies in series gave 33-64 us), and above the step the time over a buffer's
bandwidth grows by about 0.65 us per peer (27 us over 8 GPUs, 64 us over 64).

``channel_rounds`` is how evenly the sends fill NCCL's p2p channels. A group of ``n`` ranks
gives each peer's send the most channels, a power of two, that lets all ``n`` fit the p2p
channels at once (``scheduleP2pTasksToPlan``: ``nChannelsMin`` halves while ``nChannelsMin *
nRanks`` exceeds ``p2pnChannels``), so ``n - 1`` peers keep ``(n - 1) / pow2_up(n)`` of the
channels busy (the busiest channel carries ``pow2_up(n)`` peers' worth against an even
``n - 1``, for ``n`` up to twice the channel count): all but one share for a power of two, about
half for 18, 36 or 72 ranks. As each peer's bytes grow NCCL doubles its channels, and the idle
share falls in proportion: ``n - 1 + (pow2_up(n) - n + 1) / (1 + peer / sendrecv_balance_bytes)``
(default 16 MiB: NCCL's largest part per channel within a node, 32 p2p chunks of 512 KiB).
The form was chosen after looking at XLA's NVL72 all-to-all rows: at 0.5 MiB per peer the time
over 18, 36 and 72 GPUs equals that over 32, 64 and 128 (two 64-GPU rounds), and at
4-8 MiB per peer they are still 1.2-1.5x slower per byte than 16, 32 and 64 GPUs, at 256 MiB
1.05x.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from diffcost import smooth

STEP_WIDTH = 0.25  # e-folds of per-peer size over which the step turns (a factor ~1.3)
# The channel cap's softness, in units of the caller's temperature (0.1 at the default 1e-3):
# channels fill the links gradually, and a hard minimum would give its constant no gradient
# wherever the other term is the smaller one.
CAP_SOFTNESS = 100.0


def _all_channels(params, msg_bytes, group_size):
    """The step: ~0 well below ``sendrecv_peer_bytes`` per peer (few channels each), ~1 well
    above (each peer's send on all its channels), a logistic in ``log(msg / group_size)``."""
    peer = jnp.maximum(msg_bytes / group_size, 1.0)
    return jax.nn.sigmoid((jnp.log(peer) - params.sendrecv_peer_log_bytes) / STEP_WIDTH)


def peer_share(params, msg_bytes, group_size, temperature=smooth.DEFAULT_TEMPERATURE):
    """Share of the links' bandwidth grouped sends reach with ``msg_bytes / group_size`` bytes
    per peer: ``s + (1 - s) * sigmoid(log(peer / sendrecv_peer_bytes) / STEP_WIDTH)``,
    ``s = sendrecv_small_share``, times the share of the channels the ``n - 1`` peers' sends
    keep busy, ``smin((n - 1) / channel_rounds, (n - 1) * sendrecv_peer_max_share)``
    (``CAP_SOFTNESS * temperature`` its softness)."""
    small = params.sendrecv_small_share
    share = small + (1.0 - small) * _all_channels(params, msg_bytes, group_size)
    peers = group_size - 1.0
    busy = peers / channel_rounds(params, msg_bytes, group_size)
    cap = peers * params.sendrecv_peer_max_share
    return share * smooth.smin2(busy, cap, CAP_SOFTNESS * temperature)


def _pow2_up(n):
    """The least power of two at least ``n`` (``n`` a static group size, > 0)."""
    return jnp.exp2(jnp.ceil(jnp.log2(n) - 1e-9))


def channel_rounds(params, msg_bytes, group_size):
    """Peers' sends the busiest channel carries, in units of one peer's send on every channel
    a group of ``group_size`` gives it: ``pow2_up(n)`` while each peer's send takes its fewest
    channels (``n - 1`` peers on ``1 / pow2_up(n)`` of the channels each), falling to ``n - 1``
    as each peer's send takes more channels in proportion to its bytes ``msg / n``:
    ``n - 1 + (pow2_up(n) - n + 1) / (1 + peer / sendrecv_balance_bytes)``. So
    ``(n - 1) / channel_rounds`` is the share of the channels busy: ``(n - 1) / n`` for a power
    of two, about half for 18, 36 or 72 ranks, for small sends."""
    peer = jnp.maximum(msg_bytes / group_size, 1.0)
    spread = 1.0 + peer / params.sendrecv_balance_bytes
    return group_size - 1.0 + (_pow2_up(group_size) - group_size + 1.0) / spread


def peers_in_flight(params, msg_bytes, group_size):
    """Peers whose sends run at once, ``sendrecv_concurrency ** (1 - step)``: all of
    ``sendrecv_concurrency`` while each peer's send takes few channels, one once each takes
    all (the step of ``peer_share``). The pairwise sends' ``n - 1`` path latencies are divided
    by it."""
    return params.sendrecv_concurrency ** (1.0 - _all_channels(params, msg_bytes, group_size))
