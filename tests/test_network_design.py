"""The job-time seam (``diffcost.network.job``), network design (``network.design``), its YAML
(``network.design_config``) and ``diffcost design`` / ``explain --topology``."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffcost import api, comm, smooth, stages, workload
from diffcost.cli import main
from diffcost.config import ConfigError, load_experiment
from diffcost.network import design, design_config, job
from diffcost.network import generators as gen
from diffcost.network.graph import LinkSpec

FD_RTOL = 1e-4  # central differences against the reverse pass
EXACT = 1e-12
EXAMPLES = "configs/examples"


def _topology():
    """4 DGX-like nodes of 8 GPUs; nodes 0-1 under leaf 0, 2-3 under leaf 1, 2:1 taper."""
    node = gen.switch_domain(8, LinkSpec(450e9, 1.5e-6))
    fabric = gen.leaf_spine(2, 16, LinkSpec(50e9, 0.5e-6), oversubscription=2, spines=2)
    return gen.hierarchical(node, 4, fabric)


TOPOLOGY = _topology()


def _job(gpus):
    exp = load_experiment(f"{EXAMPLES}/llama3-8b-fsdp.yaml", [f"gpus={gpus}", f"plan.dp={gpus}"])
    params = api.params_for(exp)[0]
    return job.make_job(TOPOLOGY, exp.plan, *api.experiment_arrays(exp)), params


@pytest.fixture(scope="module")
def job32():
    return _job(32)


@pytest.mark.parametrize(
    "config, overrides",
    [
        ("mixtral-8x7b.yaml", []),
        ("llama3-8b-fsdp.yaml", []),
        ("llama3-70b-h100.yaml", []),
        ("llama3-70b-h100.yaml", ["plan.sequence_parallel=false", "plan.zero=0"]),
    ],
)
def test_comm_requests_are_what_comm_times_costs(config, overrides):
    exp = load_experiment(f"{EXAMPLES}/{config}", overrides)
    model, plan, cluster = api.experiment_arrays(exp)
    params, tau = api.params_for(exp)[0], smooth.DEFAULT_TEMPERATURE
    work = workload.layer_work(model, plan)
    groups = stages.place_groups(plan, cluster, params, tau)
    expected = stages.comm_times(work, model, plan, groups, cluster, params, tau)
    requests = job.comm_requests(work, model, plan)
    times = []
    for _, collective, dim, msg in requests:
        links = getattr(groups, dim)
        if collective == job.SEND:
            inter = smooth.safe_div(links.group.nodes - 1.0, plan.pp - 1.0)
            times.append(comm.send_recv_s(msg, inter, cluster, params))
        elif collective == "all_to_all":
            times.append(comm.all_to_all_links_s(msg, links, params))
        else:
            times.append(comm.collective_links_s(collective, msg, links, params, tau))
    got = job.assemble_comm_times(requests, times)
    for field in expected.__dataclass_fields__:
        np.testing.assert_allclose(getattr(got, field), getattr(expected, field), rtol=EXACT)


def test_graph_time_near_the_model_in_one_node():
    """One DGX H100 node: the graph prices what ``comm`` prices (same constants)."""
    exp = load_experiment(f"{EXAMPLES}/llama3-8b-fsdp.yaml")
    params = api.params_for(exp)[0]
    netjob = job.make_job(gen.from_cluster(exp.cluster, 1), exp.plan, *api.experiment_arrays(exp))
    graph = float(job.job_time_s(jnp.ones(len(job.CLASSES)), netjob, params))
    model = float(api.predict(exp, params=params).iteration_s)
    assert graph == pytest.approx(model, rel=5e-3)


def test_link_classes_follow_node_kinds():
    names = [job.CLASSES[c] for c in job.link_classes(TOPOLOGY)]
    pairs = {
        (TOPOLOGY.kinds[a], TOPOLOGY.kinds[b]): n
        for a, b, n in zip(TOPOLOGY.src, TOPOLOGY.dst, names)
    }
    assert pairs[("gpu", "nvswitch")] == "nvlink"
    assert pairs[("gpu", "nic")] == pairs[("nic", "leaf")] == "nic"
    assert pairs[("leaf", "spine")] == pairs[("spine", "leaf")] == "leaf_spine"


def test_gradient_matches_finite_differences(job32):
    netjob, params = job32

    def log_time(u):
        return jnp.log(job.job_time_s(jnp.exp(u), netjob, params))

    u0 = jnp.array([0.1, -0.2, 0.3, 0.0])
    grad = np.asarray(jax.jit(jax.grad(log_time))(u0))
    f = jax.jit(log_time)
    h = 1e-4
    for c in range(3):  # the classes the topology has
        e = np.zeros(4)
        e[c] = h
        fd = (float(f(u0 + e)) - float(f(u0 - e))) / (2 * h)
        assert grad[c] == pytest.approx(fd, rel=FD_RTOL, abs=1e-9)
    assert np.all(grad[:3] < 0.0)  # every class this job uses slows it when narrower
    assert grad[3] == 0.0  # no spine-core links


def test_a_class_the_job_does_not_use_changes_nothing():
    netjob, params = _job(16)  # two nodes under one leaf: no leaf-spine link carries a flow
    f = jax.jit(lambda s: job.job_time_s(s, netjob, params))
    base = float(f(jnp.ones(4)))
    for scale in ([1.0, 1.0, 2.0, 1.0], [1.0, 1.0, 1.0, 2.0], [1.0, 1.0, 0.5, 2.0]):
        assert float(f(jnp.asarray(scale))) == base
    assert float(f(jnp.asarray([1.0, 2.0, 1.0, 1.0]))) < base  # the NICs do carry it


@pytest.mark.parametrize("kind, learning_rate", [("time", 0.05), ("cost_time", 5.0)])
def test_design_is_never_worse_than_its_start(job32, kind, learning_rate):
    netjob, params = job32
    prices = design.Prices.per_class(TOPOLOGY, {"nvlink": 20.0}, {"nic": 1500, "leaf_spine": 2500})
    spend = prices.class_spend(TOPOLOGY)
    optimize = (1.0, 1.0, 1.0, 0.0)
    objective = (
        design.Objective("time", optimize, budget_usd=1.1 * spend.sum())
        if kind == "time"
        else design.Objective("cost_time", optimize, fixed_usd=10 * spend.sum())
    )
    start, best, history = design.optimize(
        netjob, params, spend, objective, steps=8, learning_rate=learning_rate
    )
    assert np.isfinite(history).all()
    assert best.objective <= start.objective
    np.testing.assert_allclose(start.scale, 1.0)
    if kind == "time":
        assert best.cost_usd <= objective.budget_usd * (1 + design.BUDGET_RTOL)
        assert best.time_s < start.time_s  # 10% more money buys some time


def test_marginals_are_the_gradient_per_dollar(job32):
    netjob, params = job32
    spend = np.array([1e6, 4e5, 2e5, 0.0])
    scale = np.array([1.0, 1.5, 0.7, 1.0])
    m = design.marginals(scale, netjob, params, spend)
    f = jax.jit(lambda u: job.job_time_s(jnp.exp(u), netjob, params))
    grad = np.asarray(jax.grad(f)(jnp.log(jnp.asarray(scale))))
    np.testing.assert_allclose(m["s_saved_per_usd"][:3], -grad[:3] / (spend * scale)[:3])
    assert np.isnan(m["s_saved_per_usd"][3])


# --- design files ---------------------------------------------------------------------------

GOOD = {
    "experiment": "EXP",
    "overrides": ["gpus=16", "plan.dp=16"],
    "prices": {"nvlink": {"usd_per_GBps": 20}, "nic": {"usd_per_link": 1500}},
    "objective": {"minimize": "time", "budget_usd": 2000000},
    "steps": 3,
}


def _write(tmp_path, tree, name="d.yaml"):
    import yaml

    tree = json.loads(json.dumps(tree).replace("EXP", f"{_root()}/{EXAMPLES}/llama3-8b-fsdp.yaml"))
    path = tmp_path / name
    path.write_text(yaml.safe_dump(tree))
    return path


def _root():
    from pathlib import Path

    return Path(__file__).resolve().parent.parent


def _with(**changes):
    tree = json.loads(json.dumps(GOOD))
    for key, value in changes.items():
        if value is None:
            tree.pop(key)
        else:
            tree[key] = value
    return tree


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"prices": {"nvlnk": {"usd_per_GBps": 2}}}, ["prices", "nvlnk", "nvlink, nic"]),
        ({"prices": {"nic": {"usd_per_GBps": -3}}}, ["prices.nic.usd_per_GBps", "-3", "> 0"]),
        ({"prices": {"nic": {"usd_per_cable": 3}}}, ["prices.nic.usd_per_cable", "usd_per_link"]),
        ({"prices": {"nic": {"usd_per_GBps": 1, "usd_per_link": 2}}}, ["prices.nic", "one of"]),
        ({"prices": {"spine_core": {"usd_per_GBps": 1}}}, ["prices.spine_core", "nvlink, nic"]),
        ({"prices": []}, ["prices", "a mapping"]),
        ({"objective": {"minimize": "speed"}}, ["objective.minimize", "speed", "cost_time"]),
        ({"objective": {"minimize": "time"}}, ["objective.budget_usd", "missing"]),
        (
            {"objective": {"minimize": "time", "budget_usd": 1, "fixed_usd": 2}},
            ["objective.fixed_usd", "budget_usd"],
        ),
        (
            {"objective": {"minimize": "time", "budget_usd": 10}, "optimize": ["nic"]},
            ["objective.budget_usd", "10", "more than"],
        ),
        ({"optimize": ["leaf_spine"]}, ["optimize[0]", "leaf_spine", "nvlink, nic"]),
        ({"budget": 3}, ["'budget'", "d.yaml"]),
        ({"steps": 0}, ["steps", "0", "positive integer"]),
        ({"topology": "no-such-net"}, ["topology", "no-such-net"]),
        ({"experiment": None}, ["experiment", "None"]),
    ],
)
def test_bad_design_files_say_what_is_wrong(tmp_path, changes, words):
    path = _write(tmp_path, _with(**changes))
    with pytest.raises(ConfigError) as err:
        design_config.load_design(path)
    message = str(err.value)
    assert "d.yaml" in message
    for word in words:
        assert word in message


def test_design_command_json(tmp_path, capsys):
    path = _write(tmp_path, _with())
    assert main(["design", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["best"]["objective"] <= out["start"]["objective"]
    assert out["best"]["cost_usd"] <= 2000000 * (1 + design.BUDGET_RTOL)
    assert set(out["optimized"]) == {"nvlink", "nic"}
    assert out["start"]["oversubscription"]  # from_cluster's leaves taper (or not) by 1x


def test_a_cluster_without_profile_is_designed_at_the_members_median(tmp_path):
    """On a cluster that takes the population's median (dgx-h200: no profile of its own) the
    design times the job as the members' mean log time, as ``predict`` times the experiment,
    not at the population's mean constants (faster: time is convex in them)."""
    from diffcost import profiles

    spec = design_config.load_design(
        _write(tmp_path, _with(overrides=["gpus=16", "plan.dp=16", "cluster=dgx-h200"]))
    )
    exp = spec.experiment
    members = profiles.population_members(exp.cluster, stack=exp.stack)
    assert len(members) > 1
    out = design_config.run_design(spec)
    assert out["predict_iteration_s"] == pytest.approx(float(api.predict(exp).iteration_s))
    netjob = job.experiment_job(spec.topology, exp)
    ones = np.ones(len(job.CLASSES))
    each = [float(job.job_time_s(ones, netjob, p)) for p in members]
    assert out["start"]["time_s"] == pytest.approx(np.exp(np.mean(np.log(each))), rel=1e-5)
    at_mean = float(job.job_time_s(ones, netjob, api.params_for(exp)[0]))
    assert at_mean < out["start"]["time_s"]
    # explain --topology reports the same median on the graph
    from diffcost.explain import explain

    graph_s = explain(exp, topology=spec.topology)["graph_iteration_s"]
    assert graph_s == pytest.approx(out["start"]["time_s"], rel=1e-5)


def test_explain_topology_rows(capsys):
    args = ["explain", f"{EXAMPLES}/llama3-8b-fsdp.yaml", "gpus=16", "plan.dp=16"]
    assert main([*args, "--topology", "cluster", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = [r["key"] for r in out["link_classes"]]
    assert "nvlink" in keys and "nic" in keys
    nic = next(r for r in out["link_classes"] if r["key"] == "nic")
    model_nic = next(r for r in out["elasticities"] if r["key"] == "nic_Bps")
    assert nic["elasticity"] < 0.0 and model_nic["elasticity"] < 0.0


def test_searched_cluster_follows_the_design():
    from diffcost.network import design_search

    cluster = load_experiment(f"{EXAMPLES}/llama3-8b-fsdp.yaml").cluster
    built = design_search.searched_cluster(cluster, TOPOLOGY, np.ones(4))
    assert built.oversubscription == pytest.approx(2.0)  # the topology's 2:1 leaves
    assert built.nvlink_GBps == cluster.nvlink_GBps and built.nic_Gbps == cluster.nic_Gbps
    moved = design_search.searched_cluster(cluster, TOPOLOGY, np.array([2.0, 0.5, 2.0, 1.0]))
    assert moved.nvlink_GBps == pytest.approx(2 * cluster.nvlink_GBps)
    assert moved.nic_Gbps == pytest.approx(0.5 * cluster.nic_Gbps)
    assert moved.oversubscription == 1.0  # 0.5 x 2 / 2 = 0.5: no taper left, never below 1


@pytest.mark.parametrize("path", sorted((_root() / "configs" / "designs").glob("*.yaml")))
def test_shipped_design_files_load(path):
    spec = design_config.load_design(path)
    assert spec.spend.sum() > 0 and spec.steps >= 1
    assert spec.experiment.plan.n_gpus <= len(spec.topology.endpoints)
