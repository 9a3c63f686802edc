"""Collectives priced as XLA's table times them (``diffcost.network.cost``, ``xla``) and the
per-cluster constants of ``calibration.network_fit``: the chunk pass's closed form, the grouped
sends' small-message curve, and the fit recovering known device and cluster constants
together."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from calibration.network_fit import PricedTable, SwitchFit, fit_switch_constants
from diffcost.network import cost
from diffcost.network.generators import switch_domain
from diffcost.network.graph import LinkSpec
from diffcost.params import default_params

MiB = 2.0**20
REL = 1e-9


def _time(topo, collective, n, msg, xla, algorithms=("ring",), params=None):
    """Seconds of one collective over the first ``n`` GPUs of ``topo`` (exact minima)."""
    params = default_params(jnp.float64) if params is None else params
    pricing = cost.collective_pricing(topo, collective, n, algorithms=algorithms, xla=xla)
    return float(cost.collective_time_s(pricing, msg, topo.capacity_Bps, params, 0.0))


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_chunk_pass_adds_the_rank_chunk_at_its_rate(collective, n):
    topo = switch_domain(8, LinkSpec(100e9, 1e-6))
    params = default_params(jnp.float64).replace(chunk_reduce_log_Bps=jnp.log(4e11))
    msg = 256 * MiB
    args = (topo, collective, n, msg)
    extra = _time(*args, True, params=params) - _time(*args, False, params=params)
    rate = params.chunk_pass_Bps if collective == "all_gather" else params.chunk_reduce_Bps
    assert extra == pytest.approx(msg / n / float(rate), rel=REL)


def test_xla_all_to_all_moves_its_small_message_curve_and_nvls_is_unchanged():
    """XLA's all-to-all is the pairwise sends with ``sendrecv_half_bw_bytes`` in place of
    ``half_bw_bytes`` (each peer's share far above ``sendrecv_peer_bytes`` and
    ``sendrecv_balance_bytes``: all its channels, every channel busy,
    ``test_network_sendrecv``); NVLS (in the switch) pays no chunk pass."""
    topo = switch_domain(8, LinkSpec(100e9, 1e-6), switch_reduction=True)
    params = default_params(jnp.float64).replace(
        sendrecv_peer_log_bytes=jnp.log(1.0), sendrecv_balance_log_bytes=jnp.log(1e-12)
    )
    msg = 64 * MiB
    params = params.replace(sendrecv_half_bw_log_bytes=jnp.log(3 * MiB))
    later = params.replace(half_bw_log_bytes=params.sendrecv_half_bw_log_bytes)
    xla = _time(topo, "all_to_all", 8, msg, True, algorithms=("pairwise",), params=params)
    plain = _time(topo, "all_to_all", 8, msg, False, algorithms=("pairwise",), params=later)
    assert xla == pytest.approx(plain, rel=REL)
    args = (topo, "all_reduce", 8, msg)
    nvls = _time(*args, True, algorithms=("nvls",))
    assert nvls == pytest.approx(_time(*args, False, algorithms=("nvls",)), rel=REL)


def test_chunk_pass_has_a_finite_gradient():
    topo = switch_domain(4, LinkSpec(100e9, 1e-6))
    pricing = cost.collective_pricing(topo, "all_gather", 4, xla=True)
    grad = jax.grad(lambda p: cost.collective_time_s(pricing, 8 * MiB, topo.capacity_Bps, p))
    g = grad(default_params(jnp.float64))
    assert float(g.chunk_pass_log_Bps) < 0.0  # a faster pass shortens the collective
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(g))


def test_fit_recovers_a_device_and_a_cluster_constant_together():
    """Two group sizes separate the chunk pass (``1/n``) from the ring's bandwidth."""
    topo = switch_domain(8, LinkSpec(450e9, 1e-6))
    params = default_params(jnp.float64)
    truth = params.replace(
        chunk_pass_log_Bps=jnp.log(jnp.asarray(600e9)), nvlink_eff_logit=jnp.log(0.85 / 0.15)
    )
    sizes = 2.0 ** np.arange(24, 32)
    tables = []
    for n in (2, 8):
        pricing = cost.collective_pricing(topo, "all_gather", n, algorithms=("ring",), xla=True)
        cap = jnp.asarray(topo.capacity_Bps)
        one = lambda p, m, pricing=pricing: cost.collective_time_s(pricing, m, cap, p, 0.0)  # noqa: E731
        price = jax.jit(jax.vmap(one, in_axes=(None, 0)))
        measured = np.asarray(price(truth, sizes))
        tables.append(PricedTable("t", "h100", price, sizes, measured, params))
    fitted = fit_switch_constants(
        tables, names=("chunk_pass_Bps",), cluster_names=("nvlink_eff",), steps=600
    )["t"]
    assert fitted["nvlink_eff"] == pytest.approx(0.85, rel=0.02)
    assert fitted["chunk_pass_Bps"] == pytest.approx(600e9, rel=0.05)


def test_fit_rejects_a_constant_of_the_wrong_level():
    with pytest.raises(ValueError, match="not cluster constants"):
        SwitchFit([], names=(), cluster_names=("reduce_Bps",))
    with pytest.raises(ValueError, match="not device constants"):
        SwitchFit([], names=("nvlink_eff",))
