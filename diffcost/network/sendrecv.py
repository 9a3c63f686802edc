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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from diffcost import smooth

STEP_WIDTH = 0.25  # e-folds of per-peer size over which the step turns (a factor ~1.3)


def _all_channels(params, msg_bytes, group_size):
    """The step: ~0 well below ``sendrecv_peer_bytes`` per peer (few channels each), ~1 well
    above (each peer's send on all its channels), a logistic in ``log(msg / group_size)``."""
    peer = jnp.maximum(msg_bytes / group_size, 1.0)
    return jax.nn.sigmoid((jnp.log(peer) - params.sendrecv_peer_log_bytes) / STEP_WIDTH)


def peer_share(params, msg_bytes, group_size, temperature=smooth.DEFAULT_TEMPERATURE):
    """Share of the links' bandwidth grouped sends reach with ``msg_bytes / group_size`` bytes
    per peer: ``s + (1 - s) * sigmoid(log(peer / sendrecv_peer_bytes) / STEP_WIDTH)``,
    ``s = sendrecv_small_share``, times ``smin(1, (group_size - 1) * sendrecv_peer_max_share)``
    (the channels the ``n - 1`` peers' sends take at once; ``temperature`` its softness)."""
    small = params.sendrecv_small_share
    share = small + (1.0 - small) * _all_channels(params, msg_bytes, group_size)
    peers = (group_size - 1.0) * params.sendrecv_peer_max_share
    return share * smooth.smin2(1.0, peers, temperature)


def peers_in_flight(params, msg_bytes, group_size):
    """Peers whose sends run at once, ``sendrecv_concurrency ** (1 - step)``: all of
    ``sendrecv_concurrency`` while each peer's send takes few channels, one once each takes
    all (the step of ``peer_share``). The pairwise sends' ``n - 1`` path latencies are divided
    by it."""
    return params.sendrecv_concurrency ** (1.0 - _all_channels(params, msg_bytes, group_size))
