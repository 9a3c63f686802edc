"""In-switch reduction (NVLink SHARP, ``nvls``) on the graph path: its closed form on one node,
its absence where the topology declares no reducing switch, finite gradients, and the fit of its
constants (``calibration.network_fit``) recovering known values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from calibration.network_fit import PROTOCOL_CLUSTER_CONSTANTS, PricedTable, fit_switch_constants
from diffcost.config import ConfigError, load_cluster
from diffcost.network import cost, nvls
from diffcost.network.generators import from_cluster, switch_domain
from diffcost.network.graph import LinkSpec
from diffcost.network.load import load_topology
from diffcost.params import default_params

MiB = 2.0**20
SHARES = {"all_reduce": (1.125, 1.125), "reduce_scatter": (1.0, 0.125), "all_gather": (0.125, 1.0)}


@pytest.mark.parametrize("collective", sorted(SHARES))
@pytest.mark.parametrize("switches", [1, 4])
def test_nvls_on_one_node_is_its_closed_form(collective, switches):
    n, bw, lat = 8, 450e9, 1e-6
    topo = switch_domain(n, LinkSpec(bw, lat), switches, switch_reduction=True)
    params = default_params(jnp.float64)
    pricing = cost.collective_pricing(topo, collective, n, algorithms=("nvls",))
    msg = 256 * MiB
    got = cost.collective_time_s(pricing, msg, topo.capacity_Bps, params, temperature=0.0)
    present = msg / (msg + 1.0)
    step = msg  # NVLS's small-message curve is its chunks', not the Simple buffers'
    eff = float(params.nvls_ratio) * float(params.nvlink_eff)  # relative to the ring's
    eff *= float(nvls.chunk_efficiency(params, msg, nvls.DEFAULT_NVLS_CHANNELS * n))
    band = max(SHARES[collective]) * step / (bw * eff)
    passes = 2 if collective == "all_reduce" else 1  # each up and down one GPU-switch hop
    latency = passes * 2 * lat * float(params.nvlink_latency_scale) * present
    fixed = (float(params.nvls_latency_s) + float(params.collective_overhead_s)) * present
    assert float(got) == pytest.approx(band + latency + fixed, rel=1e-9)  # no GPU reduce pass


def test_nvls_is_offered_only_where_switches_reduce():
    plain = switch_domain(8, LinkSpec(450e9, 1e-6))
    reducing = switch_domain(8, LinkSpec(450e9, 1e-6), switch_reduction=True)
    assert "nvls" not in cost.default_algorithms(plain, "all_reduce")
    assert "nvls" in cost.default_algorithms(reducing, "all_reduce")
    assert "nvls" not in cost.default_algorithms(reducing, "all_to_all")
    assert plain.fingerprint != reducing.fingerprint
    with pytest.raises(ValueError, match="nvls"):
        cost.collective_pricing(plain, "all_reduce", 8, algorithms=("nvls",))
    a100 = from_cluster(load_cluster("vtrain-a100"), 1)  # second-generation NVSwitch
    h100 = from_cluster(load_cluster("dgx-h100"), 1)
    assert "nvls" not in cost.collective_pricing(a100, "all_reduce", 8).names
    assert "nvls" in cost.collective_pricing(h100, "all_reduce", 8).names
    mi350 = from_cluster(load_cluster("generic-mi350"), 1)  # a mesh: no switch
    assert "nvls" not in cost.collective_pricing(mi350, "all_reduce", 8).names


def test_nvls_is_left_out_for_a_group_across_nodes():
    topo = from_cluster(load_cluster("dgx-h100"), 2)
    assert len(topo.reducing_nodes()) == 2  # one switch per node, both reducing
    assert "nvls" not in cost.collective_pricing(topo, "all_reduce", 16).names
    assert "nvls" in cost.collective_pricing(topo, "all_reduce", 8, n_groups=2).names
    with pytest.raises(ValueError, match="same reducing switches"):
        cost.collective_pricing(topo, "all_reduce", 16, algorithms=("nvls",))


def test_switch_reduction_in_yaml(tmp_path):
    assert len(load_topology("gb200-nvl72-racks").reducing_nodes()) > 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "generator: switch_domain\ngpus: 8\nswitch_reduction: yes please\n"
        "link: {bandwidth_GBps: 450, latency_us: 1}\n"
    )
    with pytest.raises(ConfigError, match="switch_reduction"):
        load_topology(bad)


def test_nvls_gradients_are_finite_and_reach_its_constants():
    topo = from_cluster(load_cluster("dgx-h100"), 1)
    pricing = cost.collective_pricing(topo, "all_reduce", 8)
    params = default_params(jnp.float64)
    cap = jnp.asarray(topo.capacity_Bps)

    def time(p, c):
        return cost.collective_time_s(pricing, 1024 * MiB, c, p, temperature=1e-3)

    g_params, g_cap = jax.grad(time, argnums=(0, 1))(params, cap)
    for leaf in jax.tree_util.tree_leaves(g_params) + [g_cap]:
        assert np.all(np.isfinite(np.asarray(leaf)))
    assert float(g_params.nvls_ratio_logit) < 0.0  # a faster switch shortens the large message
    assert float(g_params.nvls_latency_log_s) > 0.0
    assert float(g_params.reduce_log_Bps) == pytest.approx(0.0, abs=1e-12)  # NVLS chosen


def test_fit_recovers_known_switch_constants():
    topo = switch_domain(8, LinkSpec(450e9, 1e-6), switch_reduction=True)
    pricing = cost.collective_pricing(topo, "all_reduce", 8, algorithms=("nvls",))
    cap = jnp.asarray(topo.capacity_Bps)
    price = jax.jit(
        jax.vmap(lambda p, m: cost.collective_time_s(pricing, m, cap, p, 0.0), in_axes=(None, 0))
    )
    params = default_params(jnp.float64)
    truth = params.replace(
        nvls_ratio_logit=jnp.log(0.6 / 0.4), nvls_latency_log_s=jnp.log(jnp.asarray(15e-6))
    )
    sizes = 2.0 ** np.arange(14, 34)
    table = PricedTable("t", "h100", price, sizes, np.asarray(price(truth, sizes)), params)
    fitted = fit_switch_constants([table], steps=400)["t"]
    assert fitted["nvls_ratio"] == pytest.approx(0.6, rel=0.02)
    assert fitted["nvls_latency_s"] == pytest.approx(15e-6, rel=0.05)


def test_nvls_chunk_follows_nccls_steps_per_operation():
    ops = 24 * 8
    sizes = ops * np.array([8e3, 2e5, 2e6, 1e8])  # bytes per operation between NCCL's steps
    chunks = np.asarray(nvls.chunk_bytes(jnp.asarray(sizes), ops))
    np.testing.assert_allclose(chunks / 1024, [16, 32, 64, 128], rtol=0.02)
    # the same bytes per rank give the same chunk over 8 and 64 ranks (ops = channels x ranks)
    assert float(nvls.chunk_bytes(24 * 64 * 2e6, 24 * 64)) == pytest.approx(float(chunks[2]))
    params = default_params(jnp.float64)
    eff = np.asarray(nvls.chunk_efficiency(params, jnp.asarray(sizes), ops))
    assert eff[-1] == pytest.approx(1.0, abs=1e-3) and np.all(np.diff(eff) > 0)
    assert nvls.nvls_channels("gb200") == 24 and nvls.nvls_channels("h100") == 16


def test_nvls_runs_slower_per_byte_on_small_chunks():
    """NCCL's NVLS moves a small message in small chunks, each paying its fixed cost: without
    ``chunk_efficiency`` the bandwidth term per byte would not depend on the size."""
    n, bw = 8, 450e9
    topo = switch_domain(n, LinkSpec(bw, 0.0), switch_reduction=True)
    params = default_params(jnp.float64).replace(
        half_bw_log_bytes=jnp.log(1.0), nvls_latency_log_s=jnp.log(1e-12),
        collective_overhead_log_s=jnp.log(1e-12),
    )  # fmt: skip
    pricing = cost.collective_pricing(topo, "all_reduce", n, algorithms=("nvls",))
    per_byte = [
        float(cost.collective_time_s(pricing, m, topo.capacity_Bps, params, 0.0)) / m
        for m in (16 * n * 4e3, 16 * n * 64e6)  # chunks of 16 and 128 KiB
    ]
    cost_bytes = float(params.nvls_chunk_bytes)
    expected = (16384 + cost_bytes) / 16384 * 131072 / (131072 + cost_bytes)
    assert per_byte[0] / per_byte[1] == pytest.approx(expected, rel=0.01)
    assert expected > 1.5


def test_nvls_all_gather_and_reduce_scatter_over_at_most_32_ranks():
    topo = from_cluster(load_cluster("generic-gb200-nvl72"), 1)
    assert "nvls" in cost.collective_pricing(topo, "all_reduce", 64).names
    for collective in ("all_gather", "reduce_scatter"):
        assert "nvls" in cost.collective_pricing(topo, collective, 32, n_groups=2).names
        assert "nvls" not in cost.collective_pricing(topo, collective, 36, n_groups=2).names


def test_fit_recovers_an_xla_clusters_own_curve_latency_and_call_cost():
    """``PROTOCOL_CLUSTER_CONSTANTS`` (fitted per cluster on XLA's tables) are identified
    together by tables over two group sizes: the call cost is paid once, the hop latency once per
    ring step."""
    topo = switch_domain(8, LinkSpec(450e9, 1e-6), switch_reduction=True)
    cap = jnp.asarray(topo.capacity_Bps)
    params = default_params(jnp.float64)
    truth = params.replace(
        collective_overhead_log_s=jnp.log(jnp.asarray(15e-6)),
        nvlink_latency_log_scale=jnp.log(jnp.asarray(3.0)),
        half_bw_log_bytes=jnp.log(jnp.asarray(8.0 * MiB)),
    )
    sizes = 2.0 ** np.arange(16, 32)
    tables = []
    for n in (2, 8):
        pricing = cost.collective_pricing(
            topo, "all_gather", n, 8 // n, algorithms=("ring",), xla=True, protocols=True
        )
        price = jax.jit(
            jax.vmap(
                lambda p, m, pr=pricing: cost.collective_time_s(pr, m, cap, p, 0.0),
                in_axes=(None, 0),
            )
        )
        tables.append(
            PricedTable("t", "h100", price, sizes, np.asarray(price(truth, sizes)), params)
        )
    fitted = fit_switch_constants(
        tables, names=(), cluster_extra={"t": PROTOCOL_CLUSTER_CONSTANTS}, steps=600
    )["t"]
    assert fitted["collective_overhead_s"] == pytest.approx(15e-6, rel=0.1)
    assert fitted["nvlink_latency_scale"] == pytest.approx(3.0, rel=0.1)
    assert fitted["half_bw_bytes"] == pytest.approx(8.0 * MiB, rel=0.25)  # prior pulls to 1 MiB


def test_a_job_prices_nvls_with_its_gpu_family_channels():
    """``make_job(family=)``: NVLS's concurrent operations are NCCL's NVLS channels of the GPU
    family (24 on Blackwell) times the group's ranks; without a family, Hopper's 16."""
    from diffcost import api
    from diffcost.network import job

    exp = api.load(
        "configs/examples/llama3-70b-slice-simumax-b200.yaml", ["plan.tp=8", "plan.pp=1"]
    )
    topo = from_cluster(exp.cluster, 1)
    arrays = api.experiment_arrays(exp)
    b200 = job.make_job(topo, exp.plan, *arrays, family="b200")
    hopper = job.make_job(topo, exp.plan, *arrays)
    tp = [k for k in b200.pricings if k.endswith(":tp") and not k.startswith("send")]
    assert tp
    for key in tp:
        assert float(b200.pricings[key].nvls_ops) == 24 * 8
        assert float(hopper.pricings[key].nvls_ops) == 16 * 8
