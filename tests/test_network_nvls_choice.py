"""NCCL's choice between the ring and NVLS for all-gather and reduce-scatter (``nvls.ring_share``,
``nvls.nccl_choice``): by NCCL's own cost model, not by which is faster."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffcost.config import load_cluster
from diffcost.network import cost, nvls
from diffcost.network.generators import from_cluster
from diffcost.params import default_params

MiB = 2.0**20
BLACKWELL_BUS_BPS = 900e9  # NVLink 5 per direction
CHANNELS = nvls.nvls_channels("gb200")
EFFICIENCY = nvls.nvls_efficiency("gb200")


def _share(msg, n):
    return float(nvls.ring_share(msg, n, BLACKWELL_BUS_BPS, CHANNELS, EFFICIENCY))


def _crossover(n):
    sizes = 2.0 ** np.arange(16.0, 36.0, 0.05)
    shares = np.array([_share(m, n) for m in sizes])
    return sizes[np.argmax(shares > 0.5)]


def test_nccls_model_runs_the_ring_over_two_and_four_ranks():
    """Over 2 and 4 ranks the ring has both the lower modelled latency and the higher modelled
    bandwidth: NCCL never runs NVLS for them."""
    for n in (2, 4):
        assert all(_share(m, n) > 0.5 for m in 2.0 ** np.arange(16, 36))


@pytest.mark.parametrize("n", [8, 16, 32])
def test_nccls_model_runs_nvls_for_small_buffers_and_the_ring_for_large(n):
    assert _share(64 * 1024, n) < 0.05
    assert _share(32 * 2.0**30, n) > 0.95


def test_the_switch_to_the_ring_moves_later_with_more_ranks():
    """The ring's modelled latency grows with its ``n - 1`` steps, NVLS's does not."""
    cross = [_crossover(n) for n in (8, 16, 32)]
    assert cross[0] < cross[1] < cross[2]
    # by hand from NCCL's constants: 16 ranks, 34.4 us of latency against 0.376 / B s per byte
    assert cross[1] / MiB == pytest.approx(52, rel=0.1)


def _pricings(collective, n, groups):
    topo = from_cluster(load_cluster("generic-gb200-nvl72"), 1)
    kw = dict(nvls_channels=CHANNELS, nvls_efficiency=EFFICIENCY)
    both = cost.collective_pricing(topo, collective, n, groups, ("ring", "nvls"), **kw)
    ring = cost.collective_pricing(topo, collective, n, groups, ("ring",), **kw)
    switch = cost.collective_pricing(topo, collective, n, groups, ("nvls",), **kw)
    return topo, both, ring, switch


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_the_time_is_the_chosen_algorithms_not_the_faster(collective):
    """A large buffer takes the ring's time (NCCL's model prefers the ring there) and a small one
    NVLS's, whichever is faster."""
    topo, both, ring, switch = _pricings(collective, 16, 4)
    assert both.nccl_bus_Bps == pytest.approx(BLACKWELL_BUS_BPS)
    params = default_params(jnp.float64).replace(nvls_ratio_logit=jnp.asarray(6.0))
    cap = jnp.asarray(topo.capacity_Bps)

    def price(pricing, msg):
        return float(cost.collective_time_s(pricing, msg, cap, params, temperature=1e-4))

    for msg, follows in ((4 * MiB, switch), (4096 * MiB, ring)):
        other = ring if follows is switch else switch
        assert price(both, msg) == pytest.approx(price(follows, msg), rel=0.01)
        assert price(both, msg) != pytest.approx(price(other, msg), rel=0.05)


def test_all_reduce_and_ring_only_pricings_keep_the_smooth_minimum():
    topo = from_cluster(load_cluster("generic-gb200-nvl72"), 1)
    assert cost.collective_pricing(topo, "all_reduce", 16, 4).nccl_bus_Bps == 0.0
    assert cost.collective_pricing(topo, "all_gather", 36, 2).nccl_bus_Bps == 0.0  # no NVLS
    assert cost.collective_pricing(topo, "all_gather", 16, 4).nccl_bus_Bps > 0.0


def test_the_chosen_time_has_finite_gradients():
    topo, both, _, _ = _pricings("reduce_scatter", 8, 8)
    cap = jnp.asarray(topo.capacity_Bps)
    params = default_params(jnp.float64)
    for msg in (MiB, 16 * MiB, 1024 * MiB):
        grad = jax.grad(lambda p, m=msg: cost.collective_time_s(both, m, cap, p))(params)
        leaves = jax.tree_util.tree_leaves(grad)
        assert all(np.all(np.isfinite(np.asarray(g))) for g in leaves)
        assert float(jnp.abs(grad.nvls_ratio_logit)) + float(jnp.abs(grad.nvlink_eff_logit)) > 0
