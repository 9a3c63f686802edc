"""XLA's all-to-all on fewer channels when each peer's share is small
(``diffcost.network.sendrecv``), and device constants fitted per cluster
(``calibration.network_fit.SwitchFit(cluster_device=)``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from calibration.network_fit import PricedTable, SwitchFit
from diffcost.network import cost, sendrecv
from diffcost.network.generators import switch_domain
from diffcost.network.graph import LinkSpec
from diffcost.params import default_params

MiB = 2.0**20


def _a2a_s(topo, n, msg, xla, params):
    pricing = cost.collective_pricing(topo, "all_to_all", n, algorithms=("pairwise",), xla=xla)
    return float(cost.collective_time_s(pricing, msg, topo.capacity_Bps, params, 0.0))


@pytest.mark.parametrize("small", [True, False])
def test_xla_all_to_all_runs_at_the_small_share_below_the_peer_size(small):
    """Far below ``sendrecv_peer_bytes`` per peer the grouped sends run at
    ``sendrecv_small_share`` of the NVLink bandwidth, far above at all of it (their own
    small-message curve, ``sendrecv_half_bw_bytes``, in both)."""
    topo = switch_domain(8, LinkSpec(100e9, 0.0))
    params = default_params(jnp.float64)
    params = params.replace(
        sendrecv_peer_log_bytes=jnp.log(1e12 if small else 1.0),
        sendrecv_small_share_logit=jnp.log(0.3 / 0.7),
        sendrecv_half_bw_log_bytes=jnp.log(3 * MiB),
        sendrecv_balance_log_bytes=jnp.log(1e-12),  # every channel busy at any size
    )
    eff = float(params.nvlink_eff) * (0.3 if small else 1.0)
    plain = params.replace(
        nvlink_eff_logit=jnp.log(eff / (1.0 - eff)),
        half_bw_log_bytes=params.sendrecv_half_bw_log_bytes,
    )
    msg = 64 * MiB
    assert _a2a_s(topo, 8, msg, True, params) == pytest.approx(
        _a2a_s(topo, 8, msg, False, plain), rel=1e-9
    )


def test_peer_share_is_a_step_in_the_bytes_per_peer():
    params = default_params(jnp.float64).replace(
        sendrecv_peer_log_bytes=jnp.log(MiB),
        sendrecv_small_share_logit=jnp.log(0.2 / 0.8),
        sendrecv_balance_log_bytes=jnp.log(1e-12),  # every channel busy at any size
    )
    # the same bytes per peer over 8 and 64 ranks: the same share
    assert float(sendrecv.peer_share(params, 8 * MiB, 8, 0.0)) == pytest.approx(
        float(sendrecv.peer_share(params, 64 * MiB, 64, 0.0)), rel=1e-12
    )
    shares = [float(sendrecv.peer_share(params, 64 * MiB * 2.0**k, 64, 0.0)) for k in range(-3, 4)]
    assert np.all(np.diff(shares) > 0.0)
    assert shares[0] == pytest.approx(0.2, abs=0.01) and shares[-1] == pytest.approx(1.0, abs=0.01)
    assert shares[3] == pytest.approx(0.6, rel=1e-9)  # halfway at the threshold


@pytest.mark.parametrize("n", [2, 4, 8, 16, 64])
def test_power_of_two_groups_keep_all_but_ones_share_busy_until_every_channel(n):
    """Rounds 1..n-1 on ``c0 = P / pow2_up(n)`` channels each fill all classes but round 0's:
    ``(n - 1) / pow2_up(n)`` busy until each send takes every channel, then all."""
    busy = sendrecv.busy_levels(n)
    pow2 = 2 ** int(np.ceil(np.log2(n)))
    assert busy.shape == (int(np.log2(sendrecv.P2P_CHANNELS)) + 1,)
    assert np.allclose(busy[:-1], (n - 1) / pow2) and busy[-1] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        # 18 ranks: one channel each, rounds 1..17 apart modulo 32; from 4 channels rounds
        # 1 and 17 share theirs (modulo 8), from 8 channels three classes of 3 ...
        (18, [17 / 32, 17 / 32, 17 / 24, 17 / 20, 17 / 18, 1.0]),
        # 36: rounds 1..35 modulo 32 put two sends on channels 1, 2, 3; with two channels
        # each, classes 1..3 modulo 16 hold three sends on two channels ...
        (36, [35 / 64, 35 / 48, 35 / 40, 35 / 36, 35 / 36, 1.0]),
        # 72: rounds 1..71 modulo 32: classes 1..7 hold three sends, the others two
        (72, [71 / 96, 71 / 80, 71 / 72, 71 / 72, 71 / 72, 1.0]),
    ],
)
def test_busy_levels_follow_nccls_round_to_channel_mapping(n, expected):
    assert sendrecv.busy_levels(n) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="power of two"):
        sendrecv.busy_levels(n, p2p_channels=24)


def test_channel_share_steps_where_a_send_doubles_its_channels(monkeypatch):
    """The level of ``c = 2**j`` channels per send holds between ``2**(j-1)`` and ``2**j``
    times ``sendrecv_balance_bytes`` per peer (NCCL's largest part per channel); sharp steps
    (at the default width neighbouring levels blend in: the steps are an octave apart)."""
    monkeypatch.setattr(sendrecv, "STEP_WIDTH", 0.01)
    params = default_params(jnp.float64)
    balance = float(params.sendrecv_balance_bytes)
    busy = jnp.asarray(sendrecv.busy_levels(72))
    for j, level in enumerate(np.asarray(busy)):
        peer = balance * 2.0 ** (j - 1) * np.sqrt(2.0) if j else balance / 64.0
        share = float(sendrecv.channel_share(params, 72 * peer, 72, busy))
        assert share == pytest.approx(level, rel=1e-6)


def test_all_to_all_over_72_runs_at_its_busiest_channels_share(monkeypatch):
    """Small sends over 72 ranks (1 MiB per peer) keep ``71 / 96`` of NCCL's 32 p2p channels'
    capacity busy (three sends on the busiest channel), not the ``71 / 128`` of spreading
    the 71 sends over the next power of two; past 16 MiB per peer each send takes two
    channels (``71 / 80``; sharp steps)."""
    monkeypatch.setattr(sendrecv, "STEP_WIDTH", 0.01)
    topo = switch_domain(72, LinkSpec(100e9, 0.0))
    params = default_params(jnp.float64).replace(
        sendrecv_peer_log_bytes=jnp.log(1.0),  # every send past the small-share step
        sendrecv_peer_max_share_logit=jnp.log(0.99 / 0.01),
        sendrecv_channel_need_logit=jnp.log(1e8),  # the links need every channel busy
    )
    for peer, busy in ((1 * MiB, 71 / 96), (2**0.5 * 16 * MiB, 71 / 80)):
        eff = float(params.nvlink_eff) * busy
        plain = params.replace(
            nvlink_eff_logit=jnp.log(eff / (1.0 - eff)),
            half_bw_log_bytes=params.sendrecv_half_bw_log_bytes,
        )
        grouped = _a2a_s(topo, 72, 72 * peer, True, params)
        assert grouped == pytest.approx(_a2a_s(topo, 72, 72 * peer, False, plain), rel=1e-6)


def test_busy_channels_past_the_need_fill_the_links():
    """Small sends over 18 ranks keep ``17 / 32`` of the channels busy: at the default
    ``sendrecv_channel_need`` (0.75) they run at ``17 / 24`` of the links' bandwidth, slower
    per byte than 16 ranks' (``15 / 16`` busy: all of it); where half the channels fill the
    links, as fast."""
    topo = switch_domain(32, LinkSpec(100e9, 0.0))
    params = default_params(jnp.float64)
    for need, ratio in ((0.75, 0.75 / (17 / 32)), (0.5, 1.0)):
        p = params.replace(sendrecv_channel_need_logit=jnp.log(need / (1.0 - need)))
        per_byte = {
            n: _a2a_s(topo, n, n * 2 * MiB, True, p) / ((n - 1) * 2 * MiB) for n in (16, 18)
        }
        assert per_byte[18] / per_byte[16] == pytest.approx(ratio, rel=0.02)


def test_all_to_all_over_a_group_not_a_power_of_two_is_slower_per_peer():
    """With the same bytes per peer and every peer's latency hidden, 18 ranks keep fewer
    channels busy than 16 or 32 do: their sends take longer per byte sent, and more bytes per
    peer (``sendrecv_balance_bytes`` smaller) narrow the gap."""
    topo = switch_domain(32, LinkSpec(100e9, 0.0))
    params = default_params(jnp.float64)
    per_byte = {}
    for balance in (16 * MiB, 1e-3 * MiB):
        p = params.replace(sendrecv_balance_log_bytes=jnp.log(balance))
        per_byte[balance] = {
            n: _a2a_s(topo, n, n * 2 * MiB, True, p) / ((n - 1) * 2 * MiB) for n in (16, 18, 32)
        }
    uneven = per_byte[16 * MiB]  # 17 / 32 of the channels busy, 0.75 fill the links
    assert uneven[18] > 1.3 * uneven[16] and uneven[18] > 1.3 * uneven[32]
    even = per_byte[1e-3 * MiB]
    assert even[18] == pytest.approx(even[16], rel=1e-3)


def test_channel_cap_has_a_gradient_where_it_does_not_bind():
    """Over 4 ranks the default cap ``3 * sendrecv_peer_max_share`` exceeds the busy share,
    yet the fit still sees it (``CAP_SOFTNESS``); at temperature 0 it is the exact minimum."""
    params = default_params(jnp.float64)
    msg = 4 * 64 * MiB
    grad = jax.grad(lambda p: sendrecv.peer_share(p, msg, 4))(params)
    assert float(grad.sendrecv_peer_max_share_logit) > 0.0  # a larger cap: a larger share
    exact = sendrecv.peer_share(params, msg, 4, 0.0)
    soft = [float(sendrecv.peer_share(params, msg, 4, t)) for t in (1e-3, 1e-5, 1e-7)]
    assert soft[0] < float(exact) and soft[-1] == pytest.approx(float(exact), rel=1e-6)


def test_peer_share_gradient_reaches_its_constants():
    topo = switch_domain(8, LinkSpec(100e9, 1e-6))
    pricing = cost.collective_pricing(topo, "all_to_all", 8, xla=True)
    grad = jax.grad(lambda p: cost.collective_time_s(pricing, 8 * MiB, topo.capacity_Bps, p))
    g = grad(default_params(jnp.float64))  # 1 MiB per peer: at the default threshold
    assert float(g.sendrecv_peer_log_bytes) > 0.0  # a larger threshold slows it
    assert float(g.sendrecv_small_share_logit) < 0.0  # a larger share speeds it
    assert float(g.sendrecv_balance_log_bytes) > 0.0  # channels filled later: slower
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(g))


def test_fit_recovers_a_device_constant_per_cluster():
    """``cluster_device``: two clusters of one family, each with its own NVLS efficiency."""
    topo = switch_domain(8, LinkSpec(450e9, 1e-6), switch_reduction=True)
    params = default_params(jnp.float64)
    pricing = cost.collective_pricing(topo, "all_reduce", 8, algorithms=("nvls",))
    cap = jnp.asarray(topo.capacity_Bps)
    price = jax.jit(
        jax.vmap(lambda p, m: cost.collective_time_s(pricing, m, cap, p, 0.0), in_axes=(None, 0))
    )
    sizes = 2.0 ** np.arange(20, 32)
    truth = {"a": 0.7, "b": 0.9}
    tables = [
        PricedTable(
            name,
            "h100",
            price,
            sizes,
            np.asarray(price(params.replace(nvls_ratio_logit=jnp.log(r / (1 - r))), sizes)),
            params,
        )
        for name, r in truth.items()
    ]
    fitted = SwitchFit(tables, names=(), cluster_device=("nvls_ratio",), steps=600).fit()
    for name, r in truth.items():
        assert fitted[name]["nvls_ratio"] == pytest.approx(r, rel=0.02)
    with pytest.raises(ValueError, match="not device constants"):
        SwitchFit([], names=(), cluster_device=("nvlink_eff",))


def _latency_s(n, msg, params, xla=True):
    """The pairwise sends' latency part: the time with path latencies less without them."""
    args = (n, msg, xla, params)
    return _a2a_s(switch_domain(n, LinkSpec(100e9, 1e-6)), *args) - _a2a_s(
        switch_domain(n, LinkSpec(100e9, 0.0)), *args
    )


@pytest.mark.parametrize("small", [True, False])
def test_peers_in_flight_divide_the_latencies_below_the_step_only(small):
    """Each peer's send on few channels (far below ``sendrecv_peer_bytes``): the ``n - 1``
    path latencies are paid ``sendrecv_concurrency`` at a time; on all its channels (far
    above): one after another, as without ``xla``."""
    params = default_params(jnp.float64).replace(
        sendrecv_peer_log_bytes=jnp.log(1e12 if small else 1.0),
        sendrecv_concurrency_log=jnp.log(5.0),
    )
    n, msg = 8, 64 * MiB
    serial = _latency_s(n, msg, params, xla=False)
    assert serial == pytest.approx((n - 1) * 2 * 1e-6, rel=1e-6)  # GPU-switch-GPU per peer
    expected = serial / 5.0 if small else serial
    assert _latency_s(n, msg, params) == pytest.approx(expected, rel=1e-6)
    flight = float(sendrecv.peers_in_flight(params, msg, n))
    assert flight == pytest.approx(5.0 if small else 1.0, rel=1e-6)


def test_concurrency_and_peer_share_gradients_are_finite_and_shorten():
    topo = switch_domain(64, LinkSpec(900e9, 1e-6))
    pricing = cost.collective_pricing(topo, "all_to_all", 64, xla=True)
    grad = jax.grad(lambda p: cost.collective_time_s(pricing, 4 * MiB, topo.capacity_Bps, p))
    g = grad(default_params(jnp.float64))  # 64 KiB per peer: below the default step
    assert float(g.sendrecv_concurrency_log) < 0.0  # more peers at once: faster
    two = cost.collective_pricing(topo, "all_to_all", 2, xla=True)
    g2 = jax.grad(lambda p: cost.collective_time_s(two, 64 * MiB, topo.capacity_Bps, p))(
        default_params(jnp.float64)
    )
    assert float(g2.sendrecv_peer_max_share_logit) < 0.0  # one peer at a larger share: faster
    leaves = jax.tree_util.tree_leaves((g, g2))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in leaves)


@pytest.mark.parametrize(("n", "expected"), [(2, 0.3), (3, 0.6), (8, 1.0)])
def test_sends_to_few_peers_reach_their_share_of_the_bandwidth(n, expected):
    """``n - 1`` peers' sends at once reach ``min(1, (n - 1) * sendrecv_peer_max_share)`` of
    the links' bandwidth (each peer's share far above ``sendrecv_peer_bytes`` and
    ``sendrecv_balance_bytes``: all its channels, every channel busy)."""
    topo = switch_domain(n, LinkSpec(100e9, 0.0))
    params = default_params(jnp.float64).replace(
        sendrecv_peer_log_bytes=jnp.log(1.0),
        sendrecv_peer_max_share_logit=jnp.log(0.3 / 0.7),
        sendrecv_half_bw_log_bytes=jnp.log(3 * MiB),
        sendrecv_balance_log_bytes=jnp.log(1e-12),
    )
    eff = float(params.nvlink_eff) * expected
    plain = params.replace(
        nvlink_eff_logit=jnp.log(eff / (1.0 - eff)),
        half_bw_log_bytes=params.sendrecv_half_bw_log_bytes,
    )
    msg = 64 * MiB
    assert _a2a_s(topo, n, msg, True, params) == pytest.approx(
        _a2a_s(topo, n, msg, False, plain), rel=1e-9
    )
    assert float(sendrecv.peer_share(params, msg, n, 0.0)) == pytest.approx(expected, rel=1e-9)
