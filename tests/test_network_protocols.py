"""NCCL's protocol choice by size on the graph (``diffcost.network.cost``, ``protocols``): the
LL128 curve is in force for small messages and Simple's for large ones, the switch moves with
the constants, pricings without ``protocols`` ignore them, and the gradients are finite."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffcost.network import cost
from diffcost.network.generators import switch_domain
from diffcost.network.graph import LinkSpec
from diffcost.params import default_params

MiB = 2.0**20
SIZES = 2.0 ** np.arange(16, 33)
TOPO = switch_domain(8, LinkSpec(450e9, 1e-6))
NVLS_TOPO = switch_domain(8, LinkSpec(450e9, 1e-6), switch_reduction=True)


def _times(
    protocols, params, algorithms=("ring",), temperature=0.0, collective="all_gather", topo=TOPO
):
    pricing = cost.collective_pricing(
        topo, collective, 8, algorithms=algorithms, xla=True, protocols=protocols
    )
    cap = jnp.asarray(topo.capacity_Bps)
    one = lambda m: cost.collective_time_s(pricing, m, cap, params, temperature)  # noqa: E731
    return np.asarray(jax.vmap(one)(jnp.asarray(SIZES)))


def _params(share=0.92, half_bw=128 * 1024.0):
    p = default_params(jnp.float64)
    return p.replace(
        ll128_bw_share_logit=jnp.log(share / (1.0 - share)),
        ll128_half_bw_log_bytes=jnp.log(half_bw),
        half_bw_log_bytes=jnp.log(4 * MiB),
    )


def _switch_size(params) -> float:
    """The smallest size at which the Simple curve is in force again (exact minimum)."""
    simple = _times(False, params)
    both = _times(True, params)
    ll128 = ~np.isclose(both, simple, rtol=1e-12)
    assert ll128[0] and not ll128[-1]  # LL128 for the smallest sizes, Simple for the largest
    return float(SIZES[np.flatnonzero(ll128)[-1] + 1])


def test_ll128_is_in_force_for_small_messages_and_simple_for_large():
    params = _params()
    simple, both = _times(False, params), _times(True, params)
    small, large = SIZES <= MiB, SIZES >= 1024 * MiB
    assert np.all(both[small] < 0.95 * simple[small])  # LL128's smaller curve and latency
    np.testing.assert_allclose(both[large], simple[large], rtol=1e-12)
    # the large sizes are Simple's: LL128 alone would be 1 / 0.92 slower on the links
    assert np.all(both <= simple * (1.0 + 1e-12))


def test_the_switch_moves_up_as_ll128_nears_simple_bandwidth():
    """NCCL's crossover is where LL128's bandwidth loss outweighs its smaller fixed cost:
    a larger ``ll128_bw_share`` keeps LL128 to larger sizes."""
    low, high = _switch_size(_params(share=0.85)), _switch_size(_params(share=0.97))
    assert high > low


def test_without_protocols_the_ll128_constants_are_unread():
    a, b = _params(share=0.5, half_bw=1.0), _params(share=0.99, half_bw=64 * MiB)
    np.testing.assert_array_equal(_times(False, a), _times(False, b))


def test_nvls_and_pairwise_run_simple_only():
    params = _params(share=0.99, half_bw=1.0)
    pairwise = dict(algorithms=("pairwise",), collective="all_to_all")
    np.testing.assert_array_equal(
        _times(True, params, **pairwise), _times(False, params, **pairwise)
    )
    nvls = dict(algorithms=("nvls",), collective="all_reduce", topo=NVLS_TOPO)
    np.testing.assert_array_equal(_times(True, params, **nvls), _times(False, params, **nvls))


def test_gradients_are_finite_and_ll128_constants_act_on_small_messages():
    params = _params()
    pricing = cost.collective_pricing(
        TOPO, "all_reduce", 8, algorithms=("ring", "tree"), xla=True, protocols=True
    )
    cap = jnp.asarray(TOPO.capacity_Bps)

    def grad_at(msg):
        return jax.grad(lambda p: cost.collective_time_s(pricing, msg, cap, p, 1e-3))(params)

    small, large = grad_at(1 * MiB), grad_at(2048 * MiB)
    for g in (small, large):
        assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(g))
    assert float(small.ll128_bw_share_logit) < 0.0  # more LL128 bandwidth: faster small calls
    assert float(small.ll128_half_bw_log_bytes) > 0.0
    assert abs(float(large.ll128_bw_share_logit)) < 1e-6 * abs(float(large.nvlink_eff_logit))


@pytest.mark.parametrize("temperature", [1e-3, 1e-2])
def test_the_smooth_minimum_stays_below_both_curves(temperature):
    params = _params()
    simple = _times(False, params, temperature=temperature)
    both = _times(True, params, temperature=temperature)
    assert np.all(both <= simple * (1.0 + 1e-9))
