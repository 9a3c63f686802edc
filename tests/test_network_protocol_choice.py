"""NCCL's choice of the ring's protocol by its own cost model (``diffcost.network.protocols``):
LL for small buffers, Simple for large ones, LL128 between only where the ring has enough steps;
the priced time is the chosen protocol's, not the fastest one's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffcost.network import cost, protocols
from diffcost.network.generators import switch_domain
from diffcost.network.graph import LinkSpec
from diffcost.params import default_params

MiB = 2.0**20
BLACKWELL = 900e9  # NVLink 5 per direction
LL_MAX = protocols.ll_max_Bps("b200")
SIZES = 2.0 ** np.arange(16, 35)


def _weights(msg, n, collective="all_gather"):
    w = protocols.choice_weights(msg, n, collective, BLACKWELL, LL_MAX)
    return {p: float(v) for p, v in w.items()}


def test_known_families_only():
    assert protocols.ll_max_Bps("h100") == 141e9
    assert protocols.ll_max_Bps("gb200") == 282e9
    assert protocols.ll_max_Bps("mi350") == 0.0  # RCCL's model: not here


@pytest.mark.parametrize("n", [2, 4])
def test_two_and_four_ranks_never_run_ll128(n):
    """Simple's modelled latency is already below LL128's, and its bandwidth above."""
    for msg in SIZES:
        assert _weights(msg, n)["ll128"] < 0.05
    assert _weights(64 * 1024, n)["ll"] > 0.95
    assert _weights(1024 * MiB, n)["simple"] > 0.95


def test_ll_to_simple_switch_over_two_blackwell_ranks_by_hand():
    # LL: 6.6 + 0.6 us, 282 GB/s bus -> 564 algorithmic; Simple: 8.4 + 3.4 us, 1800 algorithmic
    switch = 4.6e-6 / (1.0 / 564e9 - 1.0 / 1800e9)
    assert _weights(0.8 * switch, 2)["ll"] > 0.5 > _weights(1.25 * switch, 2)["ll"]


def test_eight_ranks_run_ll128_between():
    assert _weights(20 * MiB, 8)["ll128"] > 0.9
    assert _weights(1024 * MiB, 8)["simple"] > 0.9


def _price(ll_max, params, n=2, collective="all_gather"):
    topo = switch_domain(8, LinkSpec(BLACKWELL, 1e-6))
    pricing = cost.collective_pricing(
        topo, collective, n, 8 // n, ("ring",), xla=True, protocols=True, ll_max_Bps=ll_max
    )
    cap = jnp.asarray(topo.capacity_Bps)
    return lambda p, m: cost.collective_time_s(pricing, m, cap, p, 1e-4)


def test_the_time_is_the_chosen_protocols():
    """With LL made slow, a buffer NCCL's model sends under LL still takes LL's time (the
    protocols' smooth minimum would run Simple or LL128); a large one is Simple's either way;
    without ``ll_max_Bps`` the LL share is never read."""
    params = default_params(jnp.float64).replace(ll_bw_share_logit=jnp.asarray(-3.0))
    chosen, fastest = _price(LL_MAX, params), _price(0.0, params)
    small, large = 1.0 * MiB, 4096 * MiB
    assert float(chosen(params, small)) > 2.0 * float(fastest(params, small))
    assert float(chosen(params, large)) == pytest.approx(float(fastest(params, large)), rel=0.01)

    def d_ll(price, m):
        return float(jax.grad(price)(params, m).ll_bw_share_logit)

    assert d_ll(chosen, small) < 0.0  # more LL bandwidth: faster
    assert d_ll(fastest, small) == 0.0


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_the_chosen_time_has_finite_gradients(collective):
    params = default_params(jnp.float64)
    price = _price(LL_MAX, params, n=4, collective=collective)
    for msg in (MiB, 8 * MiB, 512 * MiB):
        leaves = jax.tree_util.tree_leaves(jax.grad(price)(params, msg))
        assert all(np.all(np.isfinite(np.asarray(g))) for g in leaves)
