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

``busy_levels`` and ``channel_share`` are how evenly the sends fill NCCL's p2p channels
(``src/enqueue.cc``, ``scheduleP2pTasksToPlan`` and ``addP2pToPlan``; ``src/include/channel.h``).
The communicator has ``P2P_CHANNELS`` p2p channels (``p2pnChannels``, a power of two). A group
of ``n`` ranks first gives each peer's send ``c0`` channels, the most (a power of two) with
``c0 * n <= P2P_CHANNELS`` (``nChannelsMin``; at least one), and doubles a send's channels while
each channel's part would exceed NCCL's largest part within a node (``maxPartSize``: 32 p2p
chunks of 512 KiB, 16 MiB; ``sendrecv_balance_bytes``), up to all of them. The send of round
``r`` (the ``n - 1`` rounds of one rank's peers) takes channel ``(r + bitreverse(part)) mod
P2P_CHANNELS`` for each of its ``c`` parts (``ncclP2pChannelForPart``), so rounds equal modulo
``P2P_CHANNELS / c`` share channels; a channel carries the parts of every round of its class,
and the busiest channel sets the time. ``busy_levels`` (numpy, outside jit) gives, for each
``c = 2**j``, the share of the channels' capacity the ``n - 1`` sends keep busy, ``(n - 1) /
(P2P_CHANNELS * L)`` with ``L`` the busiest channel's load in sends: ``(n - 1) / n`` for a
power of two, ``17 / 32`` over 18 ranks on one channel each, ``71 / 96`` over 72 (rounds 1-7
modulo 32 carry three sends, the others two), rising to 1 as each send spreads over every
channel. ``channel_share`` (JAX) reads the level from ``log(msg / n)``: one logistic step
``STEP_WIDTH`` wide at each doubling, ``2**j * sendrecv_balance_bytes`` per peer. Each channel
(one thread block) moves its parts at its own rate, so the busy channels fill the links once
they are ``sendrecv_channel_need`` of all (the links' bandwidth over the channels' summed
rates): the links run at ``min(1, busy / sendrecv_channel_need)`` of their bandwidth. Chosen after
looking at XLA's NVL72 all-to-all rows (the tables it is fitted and reported on) beside NCCL's
rules: with the same bytes per peer, groups of 72, 36 and 18 ranks run at 0.80, 0.65 and 0.72
of the bandwidth of 64, 32 and 16 up to 8 MiB per peer and catch up at 32, 64 and 128 MiB per
peer, where one send first takes 2, 4 and 8 channels and the levels reach 0.89-0.97 (32 p2p
channels give those steps; 64 would put them an octave later).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from diffcost import smooth

STEP_WIDTH = 0.25  # e-folds of per-peer size over which the step turns (a factor ~1.3)
# NCCL's p2p channels (``p2pnChannels``: the communicator's channels rounded up to a power of
# two); 32 gives the steps of XLA's NVL72 all-to-all tables (``busy_levels``).
P2P_CHANNELS = 32
# The channel cap's softness, in units of the caller's temperature (0.1 at the default 1e-3):
# channels fill the links gradually, and a hard minimum would give its constant no gradient
# wherever the other term is the smaller one.
CAP_SOFTNESS = 100.0


def _all_channels(params, msg_bytes, group_size):
    """The step: ~0 well below ``sendrecv_peer_bytes`` per peer (few channels each), ~1 well
    above (each peer's send on all its channels), a logistic in ``log(msg / group_size)``."""
    peer = jnp.maximum(msg_bytes / group_size, 1.0)
    return jax.nn.sigmoid((jnp.log(peer) - params.sendrecv_peer_log_bytes) / STEP_WIDTH)


def peer_share(params, msg_bytes, group_size, temperature=smooth.DEFAULT_TEMPERATURE, busy=None):
    """Share of the links' bandwidth grouped sends reach with ``msg_bytes / group_size`` bytes
    per peer: ``s + (1 - s) * sigmoid(log(peer / sendrecv_peer_bytes) / STEP_WIDTH)``,
    ``s = sendrecv_small_share``, times the share of the channels the ``n - 1`` peers' sends
    keep busy over the share that fills the links, at most all of it,
    ``smin(smin(channel_share / sendrecv_channel_need, 1), (n - 1) * sendrecv_peer_max_share)``
    (``CAP_SOFTNESS * temperature`` the minima's softness). ``busy``:
    ``busy_levels(group_size)``, computed here from a static ``group_size`` when not given."""
    small = params.sendrecv_small_share
    share = small + (1.0 - small) * _all_channels(params, msg_bytes, group_size)
    if busy is None:
        busy = jnp.asarray(busy_levels(int(round(group_size))))
    soft = CAP_SOFTNESS * temperature
    need = params.sendrecv_channel_need
    used = smooth.smin2(channel_share(params, msg_bytes, group_size, busy) / need, 1.0, soft)
    cap = (group_size - 1.0) * params.sendrecv_peer_max_share
    return share * smooth.smin2(used, cap, soft)


def _bit_reverse(x: int, bits: int) -> int:
    return int(format(x, f"0{bits}b")[::-1], 2) if bits else 0


def busy_levels(group_size: int, p2p_channels: int = P2P_CHANNELS) -> np.ndarray:
    """``[log2(p2p_channels) + 1]`` shares of the p2p channels' capacity the sends of one rank
    to its ``n - 1`` peers keep busy when each send takes ``2**j`` channels (numpy, outside
    jit): ``(n - 1) / (p2p_channels * L)``, ``L`` the busiest channel's load in sends (a send
    on ``c`` channels puts ``1 / c`` on each), round ``r`` on channels ``(r + bitreverse(part))
    mod p2p_channels``; below NCCL's first count ``c0`` (the most, a power of two, with
    ``c0 * n <= p2p_channels``), ``c0``'s level.

    Raises:
        ValueError: a group of fewer than 2 ranks, or a channel count not a power of two.
    """
    bits = int(np.log2(p2p_channels)) if p2p_channels > 0 else -1
    if group_size < 2 or bits < 0 or 2**bits != p2p_channels:
        raise ValueError(
            f"group_size={group_size}, p2p_channels={p2p_channels}: expected at least 2 ranks "
            "and a power of two"
        )
    first = p2p_channels
    while first * group_size > p2p_channels and first > 1:
        first //= 2
    out = []
    for j in range(bits + 1):
        c = max(2**j, first)
        parts = np.array([_bit_reverse(p, bits) for p in range(c)])
        channels = (np.arange(1, group_size)[:, None] + parts[None, :]) % p2p_channels
        load = np.bincount(channels.ravel(), minlength=p2p_channels) / c
        out.append((group_size - 1.0) / (p2p_channels * load.max()))
    return np.asarray(out)


def channel_share(params, msg_bytes, group_size, busy):
    """The busy share of ``busy`` (``[J]``, ``busy_levels(group_size)``) for ``msg / group_size``
    bytes per peer: level ``j + 1`` past ``2**j * sendrecv_balance_bytes`` (NCCL doubles a
    send's channels while each part would exceed that), each step a logistic ``STEP_WIDTH``
    wide in ``log(peer)``."""
    peer = jnp.log(jnp.maximum(msg_bytes / group_size, 1.0))
    doublings = jnp.arange(busy.shape[0] - 1, dtype=busy.dtype) * np.log(2.0)
    steps = doublings + params.sendrecv_balance_log_bytes
    rise = jax.nn.sigmoid((peer - steps) / STEP_WIDTH)
    return busy[0] + jnp.sum(rise * jnp.diff(busy))


def peers_in_flight(params, msg_bytes, group_size):
    """Peers whose sends run at once, ``sendrecv_concurrency ** (1 - step)``: all of
    ``sendrecv_concurrency`` while each peer's send takes few channels, one once each takes
    all (the step of ``peer_share``). The pairwise sends' ``n - 1`` path latencies are divided
    by it."""
    return params.sendrecv_concurrency ** (1.0 - _all_channels(params, msg_bytes, group_size))
