"""A cluster's network transport (``ClusterSpec.transport``) on the graph path: the YAML field,
the ``tcp`` pricing's closed form (``diffcost.network.cost``), and ``calibration.network_fit``
fitting the transport's constants per cluster (``TRANSPORT_CONSTANTS``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from calibration.network_fit import TRANSPORT_CONSTANTS, PricedTable, SwitchFit
from diffcost.config import ConfigError, load_cluster
from diffcost.network import cost
from diffcost.network.generators import from_cluster
from diffcost.params import default_params

MiB = 2.0**20
REL = 1e-9
SIZES = 2.0 ** np.arange(20, 34)  # 1 MiB to 8 GiB, as the A3 Mega table


def _two_nodes():
    return from_cluster(load_cluster("gcp-a3-mega"), 2)


def _time(topo, n, msg, params, algorithms, transport):
    pricing = cost.collective_pricing(
        topo, "all_reduce", n, algorithms=algorithms, transport=transport
    )
    return float(cost.collective_time_s(pricing, msg, topo.capacity_Bps, params, 0.0))


def test_transport_field_is_checked(tmp_path):
    assert load_cluster("gcp-a3-mega").transport == "tcp"
    assert load_cluster("dgx-h100").transport == "rdma"
    path = tmp_path / "c.yaml"
    path.write_text("base: gcp-a3-mega\ntransport: udp\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: transport='udp' is invalid: expected one of "
                       r"'rdma', 'tcp'"):  # fmt: skip
        load_cluster(path)
    with pytest.raises(ValueError, match=r"transport='udp': expected one of rdma, tcp"):
        cost.collective_pricing(_two_nodes(), "all_reduce", 16, transport="udp")


def test_tcp_ring_runs_its_network_links_at_the_ring_share():
    """Over TCP the ring is the RDMA ring with ``nic_eff`` times ``tcp_ring_share``."""
    topo, params = _two_nodes(), default_params(jnp.float64)
    share = float(params.tcp_ring_share)
    slower = params.replace(nic_eff_logit=jnp.log(0.85 * share / (1.0 - 0.85 * share)))
    for msg in (MiB, 256 * MiB):
        tcp = _time(topo, 16, msg, params, ("ring",), "tcp")
        assert tcp == pytest.approx(_time(topo, 16, msg, slower, ("ring",), "rdma"), rel=REL)


def test_tcp_all_nic_algorithm_pays_the_fill_once_per_call():
    topo, params = _two_nodes(), default_params(jnp.float64)
    for msg in (MiB, 256 * MiB):
        extra = _time(topo, 16, msg, params, ("hierarchical",), "tcp") - _time(
            topo, 16, msg, params, ("hierarchical",), "rdma"
        )
        present = msg / (msg + 1.0)
        assert extra == pytest.approx(float(params.tcp_fill_s) * present, rel=1e-6)


def test_tcp_changes_nothing_inside_one_node():
    topo, params = _two_nodes(), default_params(jnp.float64)
    for algorithms in (("ring",), ("ring", "tree", "hierarchical")):
        tcp = _time(topo, 8, 64 * MiB, params, algorithms, "tcp")
        assert tcp == pytest.approx(_time(topo, 8, 64 * MiB, params, algorithms, "rdma"), rel=REL)


def test_tcp_gradients_are_finite_and_signed():
    topo = _two_nodes()
    pricing = cost.collective_pricing(topo, "all_reduce", 16, transport="tcp")
    cap = jnp.asarray(topo.capacity_Bps)

    def total(p):
        return sum(cost.collective_time_s(pricing, m, cap, p) for m in (MiB, 4 * MiB, 1024 * MiB))

    g = jax.grad(total)(default_params(jnp.float64))
    assert float(g.tcp_ring_share_logit) < 0.0  # a faster ring shortens the small messages
    assert float(g.tcp_fill_log_s) > 0.0  # a larger fill lengthens the large ones
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(g))


def test_fit_reproduces_a_synthetic_tcp_table():
    """The transport's constants, fitted on a table the tcp pricing made from known values
    (near the A3 Mega fit: the ring on a fifth of the NICs, 0.8 ms fill), reproduce it and
    recover the two regimes' constants."""
    topo = _two_nodes()
    params = default_params(jnp.float64)
    truth = {"nic_eff": 0.9, "tcp_ring_share": 0.2, "tcp_fill_s": 800e-6}
    true_params = params.replace(
        nic_eff_logit=jnp.log(0.9 / 0.1),
        tcp_ring_share_logit=jnp.log(0.2 / 0.8),
        tcp_fill_log_s=jnp.log(800e-6),
    )
    pricing = cost.collective_pricing(topo, "all_reduce", 16, transport="tcp")
    cap = jnp.asarray(topo.capacity_Bps)
    one = lambda p, m: cost.collective_time_s(pricing, m, cap, p, 1e-3)  # noqa: E731
    price = jax.jit(jax.vmap(one, in_axes=(None, 0)))
    measured = np.asarray(price(true_params, SIZES))
    table = PricedTable("a3", "h100", price, SIZES, measured, params)
    fit = SwitchFit([table], names=(), cluster_extra={"a3": TRANSPORT_CONSTANTS["tcp"]})
    fitted = fit.fit()["a3"]
    assert set(fitted) == set(TRANSPORT_CONSTANTS["tcp"])
    refit = params.replace(
        **{
            "nic_eff_logit": jnp.log(fitted["nic_eff"] / (1.0 - fitted["nic_eff"])),
            "nic_latency_log_scale": jnp.log(fitted["nic_latency_scale"]),
            "half_bw_log_bytes": jnp.log(fitted["half_bw_bytes"]),
            "tcp_ring_share_logit": jnp.log(
                fitted["tcp_ring_share"] / (1.0 - fitted["tcp_ring_share"])
            ),
            "tcp_fill_log_s": jnp.log(fitted["tcp_fill_s"]),
        }
    )
    err = np.abs(np.asarray(price(refit, SIZES)) / measured - 1.0)
    assert float(np.max(err)) < 0.02
    for name, value in truth.items():
        assert fitted[name] == pytest.approx(value, rel=0.1), name


def test_fit_rejects_a_transport_constant_of_the_wrong_level():
    with pytest.raises(ValueError, match="not cluster constants"):
        SwitchFit([], names=(), cluster_extra={"a3": ("reduce_Bps",)})
    with pytest.raises(ValueError, match="unknown constants"):
        SwitchFit([], names=(), cluster_extra={"a3": ("tcp_speed",)})
