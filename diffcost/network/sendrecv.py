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
constants are fitted per GPU family (``calibration.network_fit``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

STEP_WIDTH = 0.25  # e-folds of per-peer size over which the step turns (a factor ~1.3)


def peer_share(params, msg_bytes, group_size):
    """Share of the links' bandwidth grouped sends reach with ``msg_bytes / group_size`` bytes
    per peer: ``s + (1 - s) * sigmoid(log(peer / sendrecv_peer_bytes) / STEP_WIDTH)``,
    ``s = sendrecv_small_share``."""
    peer = jnp.maximum(msg_bytes / group_size, 1.0)
    full = jax.nn.sigmoid((jnp.log(peer) - params.sendrecv_peer_log_bytes) / STEP_WIDTH)
    small = params.sendrecv_small_share
    return small + (1.0 - small) * full
