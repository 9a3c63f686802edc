"""Graph models end to end: the step time by part under an SBP assignment, the data-parallel
assignment, graph models by name, and the ``predict --graph`` / ``search --sbp`` commands."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffcost
from diffcost import cli, population, profiles
from diffcost.cli.graph import GraphRun
from diffcost.opgraph import sbp, sbp_search, step
from diffcost.opgraph.models import load_graph_model
from diffcost.opgraph.sbp import B, S


@pytest.fixture(scope="module")
def cluster():
    return diffcost.arrays.cluster_arrays(diffcost.config.load_cluster("dgx-h100"))


def _setup(name, batch, n, cluster, params=None):
    model = load_graph_model(name, batch)
    problem = sbp.sbp_problem(model.graph, n)
    parts = sbp.sbp_parts(problem, cluster, params or diffcost.default_params())
    return model, problem, parts


def test_step_parts_and_the_search_cost(cluster):
    """Without collectives the step is the search's serial cost plus the host steps; with the
    data-parallel gradient all-reduces, bucketed, the sync costs no more than the search's
    per-tensor all-reduces, and hiding it behind the backward only shortens the step."""
    params = diffcost.default_params()
    model, problem, parts = _setup("transformer_block", 8, 4, cluster, params)
    costs = parts.costs()
    one = step.replicated_choice(problem)
    st = step.step_time(problem, parts, one, cluster, params)
    serial = sbp_search.assignment_cost_s(problem, costs, one)
    assert float(st.grad_sync_s) == 0.0 and float(st.relayout_s) == 0.0
    assert float(st.iteration_s - st.overhead_s) == pytest.approx(serial, rel=1e-9)
    dp = step.data_parallel_choice(problem, model.batch_inputs)
    st = step.step_time(problem, parts, dp, cluster, params)
    serial = sbp_search.assignment_cost_s(problem, costs, dp)
    unbucketed = serial - float(st.compute_s + st.relayout_s + st.optimizer_s)
    assert 0.0 < float(st.grad_sync_s) <= unbucketed
    assert float(st.exposed_grad_sync_s) < float(st.grad_sync_s)
    assert float(st.iteration_s - st.overhead_s) < serial
    parts_sum = sum(float(getattr(st, k)) for k in step.PARTS)
    assert float(st.iteration_s) == pytest.approx(parts_sum, rel=1e-12)


def test_data_parallel_splits_the_batch_and_syncs_gradients(cluster):
    model, problem, parts = _setup("mlp", 512, 8, cluster)
    choice = step.data_parallel_choice(problem, model.batch_inputs)
    for node, s in zip(problem.nodes, choice):
        sig = node.signatures[s]
        if node.op < 0:
            assert sig.outputs[0] == (S(0) if node.tensor in model.batch_inputs else B)
        elif problem.graph.operators[node.op].primitive == "dot_general":
            assert sig.inputs == (S(0), B)  # batch-split activations, replicated weights
    st = step.step_time(problem, parts, choice, cluster, diffcost.default_params())
    assert float(st.relayout_s) == 0.0  # nothing but the weight gradients moves
    assert float(st.grad_sync_s) > 0.0
    one = _setup("mlp", 512, 1, cluster)
    single = step.step_time(
        one[1], one[2], step.replicated_choice(one[1]), cluster, diffcost.default_params()
    )
    assert float(st.compute_s) < float(single.compute_s) / 2
    assert float(single.grad_sync_s) == 0.0 and float(single.relayout_s) == 0.0


def test_data_parallel_resnet_splits_every_convolution(cluster):
    model, problem, _ = _setup("resnet50", 16, 8, cluster)
    choice = step.data_parallel_choice(problem, model.batch_inputs)
    convs = [
        node.signatures[s].inputs
        for node, s in zip(problem.nodes, choice)
        if node.op >= 0 and problem.graph.operators[node.op].kind == "convolution"
    ]
    assert len(convs) == 53 and all(ins == (S(0), B) for ins in convs)


def test_step_time_is_differentiable(cluster):
    model, problem, _ = _setup("mlp", 256, 4, cluster)
    choice = step.data_parallel_choice(problem, model.batch_inputs)

    def total(params):
        parts = sbp.sbp_parts(problem, cluster, params)
        return step.step_time(problem, parts, choice, cluster, params).iteration_s

    grads = jax.grad(total)(diffcost.default_params())
    leaves = jax.tree_util.tree_leaves(grads)
    assert all(np.all(np.isfinite(x)) for x in leaves) and any(np.any(x != 0) for x in leaves)


def test_layouts_round_trip_and_bad_plans_are_named(cluster):
    model, problem, _ = _setup("mlp", 64, 2, cluster)
    choice = step.data_parallel_choice(problem, model.batch_inputs)
    plan = step.layouts(problem, choice)
    assert step.choice_from_layouts(problem, plan) == choice
    node = next(iter(plan))
    with pytest.raises(ValueError, match="valid on a mesh of 2"):
        step.choice_from_layouts(problem, {**plan, node: "S7"}, "p.json")
    with pytest.raises(ValueError, match="not in this graph"):
        step.choice_from_layouts(problem, {**plan, "nope": "B"}, "p.json")


def test_graph_models_by_name(tmp_path):
    with pytest.raises(ValueError, match="unknown zoo name; valid: resnet50"):
        load_graph_model("resnet5")
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg.models'"):
        load_graph_model("no_such_pkg.models:make")
    with pytest.raises(ValueError, match="batch 0"):
        load_graph_model("mlp", 0)
    src = tmp_path / "mine.py"
    src.write_text(
        "import jax, jax.numpy as jnp\n"
        "def make(batch=4):\n"
        "    f = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)\n"
        "    return (lambda w, x: jnp.tanh(x @ w)), (f(16, 8), f(batch, 16))\n"
        "def bad():\n"
        "    return 3\n"
    )
    m = load_graph_model(f"{src}:make", 12)
    assert m.batch == 12 and len(m.batch_inputs) == 1
    assert m.graph.flops("forward", kinds=["matmul"]) == 2 * 12 * 16 * 8
    with pytest.raises(ValueError, match="the factory returned int"):
        load_graph_model(f"{src}:bad")
    with pytest.raises(ValueError, match="has no function 'gone'"):
        load_graph_model(f"{src}:gone")


def test_predict_graph_json_and_trace(tmp_path, capsys):
    path = tmp_path / "t.json"
    argv = ["predict", "--graph", "mlp", "--cluster", "dgx-h100", "--mesh", "4", "--batch", "64"]
    assert cli.main([*argv, "--json", "--trace", str(path), "--profile", "none"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["mesh"] == 4 and d["sharding"] == "data parallel"
    assert d["iteration_s"] == pytest.approx(sum(d["breakdown"].values()), rel=1e-12)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in events} >= {"compute", "grad sync", "optimizer", "host"}
    critical = sum(e["dur"] for e in events if e["cat"] != "grad sync")
    assert critical * 1e-6 == pytest.approx(d["iteration_s"], rel=1e-6)
    end = max(e["ts"] + e["dur"] for e in events)
    assert end * 1e-6 == pytest.approx(d["iteration_s"], rel=1e-6)


def test_predict_graph_from_yaml(tmp_path, capsys):
    cfg = tmp_path / "g.yaml"
    cfg.write_text("model: {graph: mlp, batch: 32}\ncluster: dgx-h100\nplan: {mesh: 2}\n")
    assert cli.main(["predict", str(cfg), "--json", "--profile", "none"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["model"], d["batch"], d["mesh"]) == ("mlp", 32, 2)
    cfg.write_text("model: {graph: mlp}\ncluster: dgx-h100\nplan: {mesh: 2, tp: 2}\n")
    assert cli.main(["predict", str(cfg)]) == 2
    assert "valid keys: ['mesh', 'sharding']" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--graph", "resnet5", "--mesh", "2"], "unknown zoo name"),
        (["--graph", "mlp", "--mesh", "0"], "--mesh 0: must be at least 1"),
        (["--graph", "mlp", "--mesh", "3", "--batch", "64"], "not divisible by the mesh size 3"),
        (["--graph", "mlp", "--mesh", "2", "--sharding", "fsdp"], "not one of data, replicated"),
        (["--graph", "mlp"], "--mesh N"),
    ],
)
def test_predict_graph_errors_are_one_line(args, message, capsys):
    assert cli.main(["predict", *args, "--cluster", "dgx-h100"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_search_sbp_beats_or_matches_data_parallel(tmp_path, capsys):
    argv = ["search", "mlp", "--sbp", "--cluster", "dgx-h100", "--gpus", "4"]
    argv += ["--global-batch", "64", "--steps", "100", "--json", "--profile", "none"]
    assert cli.main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["iteration_s"] <= d["data_parallel"]["iteration_s"] * (1 + 1e-9)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layouts": d["layouts"]}))
    argv = ["predict", "--graph", "mlp", "--cluster", "dgx-h100", "--mesh", "4", "--batch", "64"]
    assert cli.main([*argv, "--sharding", str(plan), "--json", "--profile", "none"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["iteration_s"] == pytest.approx(d["iteration_s"], rel=1e-9)


def test_search_needs_a_batch_for_transformers(capsys):
    assert cli.main(["search", "gpt3-175b", "--cluster", "dgx-h100", "--gpus", "8"]) == 2
    assert "--global-batch" in capsys.readouterr().err


def test_pooling_windows_split_on_batch_and_channels():
    f = jax.ShapeDtypeStruct
    x = f((8, 16, 16, 4), jnp.float32)

    def pool(x):
        return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

    g = diffcost.from_jax(pool, x, argnums=())
    problem = sbp.sbp_problem(g, 2)
    (node,) = [n for n in problem.nodes if n.op >= 0]
    assert {s.name for s in node.signatures} == {"S0 -> S0", "S3 -> S3", "B"}


def _member_times(run: GraphRun, choice) -> tuple[list[float], list[float]]:
    """Each population member's step time and serial search cost of ``choice``."""
    steps, serial = [], []
    for p in profiles.population_members(run.cluster):
        parts = sbp.sbp_parts(run.problem, run.arrays, p)
        steps.append(float(step.step_time(run.problem, parts, choice, run.arrays, p).iteration_s))
        serial.append(sbp_search.assignment_cost_s(run.problem, parts.costs(), choice))
    return steps, serial


def test_a_cluster_without_profile_takes_the_members_median():
    """On dgx-h200 (no profile of its own) a graph's step time is the population members'
    median, ``exp(mean log t(member))``, slower than at their mean constants, its parts adding
    up to it; the search's costs equal the members' median serial cost at data parallel. A
    cluster with a profile, or ``--profile none``, prices its constants alone, as before."""
    run = GraphRun("mlp", "dgx-h200", 4, 64, None)
    dp = run.data_parallel()
    steps, serial = _member_times(run, dp)
    st = run.step_time(dp)
    assert float(st.iteration_s) == pytest.approx(np.exp(np.mean(np.log(steps))), rel=1e-9)
    parts = sum(float(getattr(st, k)) for k in step.PARTS)
    assert float(st.iteration_s) == pytest.approx(parts, rel=1e-12)
    mean_parts = sbp.sbp_parts(run.problem, run.arrays, run.params)
    plug_in = step.step_time(run.problem, mean_parts, dp, run.arrays, run.params)
    assert float(st.iteration_s) > float(plug_in.iteration_s) * (1 + 1e-4)
    at_dp = sbp_search.assignment_cost_s(run.problem, run.costs, dp)
    assert at_dp == pytest.approx(np.exp(np.mean(np.log(serial))), rel=1e-9)
    note = run.result(dp, "data parallel")["profile"]
    assert population.median_note(len(steps)) in note
    for cluster, profile in (("dgx-h100", None), ("dgx-h200", "none")):
        own = GraphRun("mlp", cluster, 4, 64, profile)
        assert own.members is None and "median" not in own.note
        alone = step.step_time(own.problem, own.parts, dp, own.arrays, own.params)
        assert float(own.step_time(dp).iteration_s) == float(alone.iteration_s)


def test_search_sbp_on_a_cluster_without_profile_reports_the_members_median(capsys):
    argv = ["search", "mlp", "--sbp", "--cluster", "dgx-h200", "--gpus", "4"]
    assert cli.main([*argv, "--global-batch", "64", "--steps", "50", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "median over the population's" in d["profile"]
    assert "the search minimizes their median to first order" in d["profile"]
    assert d["iteration_s"] <= d["data_parallel"]["iteration_s"] * (1 + 1e-9)
    run = GraphRun("mlp", "dgx-h200", 4, 64, None)
    steps, _ = _member_times(run, run.data_parallel())
    dp = d["data_parallel"]["iteration_s"]
    assert dp == pytest.approx(np.exp(np.mean(np.log(steps))), rel=1e-9)
