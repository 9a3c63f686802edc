"""The layer and LM head shape grids: interpolation, what they scale in a prediction, profiles,
summaries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import GPT, arrays

from calibration import fit as F
from calibration.command import moved as calibrate_moved
from calibration.command import moved_cells
from diffcost import kernels
from diffcost import profiles as prof
from diffcost.params import (
    HEAD_GRID,
    HEAD_GRID_LOG2_LO,
    LAYER_GRID,
    LAYER_GRID_LOG2_LO,
    default_params,
)
from diffcost.simulate import simulate, stage_times
from diffcost.specs import PlanSpec

NODES = [[2 ** (lo + i) for i in range(n)] for lo, n in zip(LAYER_GRID_LOG2_LO, LAYER_GRID)]


def _grid_with(node, value):
    return jnp.zeros(LAYER_GRID).at[node].set(value)


def _node_of(tokens, width, tp):
    return tuple(NODES[d].index(v) for d, v in enumerate((tokens, width, tp)))


def _iteration_grad(leaf, model, plan, cluster):
    """Gradient of the iteration time with respect to the grid ``leaf`` of the default Params."""
    p0 = default_params(jnp.float64)
    time_of = lambda table: (
        simulate(  # noqa: E731
            model, plan, cluster, p0.replace(**{leaf: table}), 1e-3
        ).iteration_s
    )
    return np.asarray(jax.grad(time_of)(getattr(p0, leaf)))


def test_layer_grid_interpolates_between_octave_nodes_and_clamps():
    grid = _grid_with((2, 3, 1), 0.4)
    t, w, tp = NODES[0][2], NODES[1][3], NODES[2][1]
    at = lambda *s: float(kernels.layer_log_time(grid, *s))  # noqa: E731
    assert at(t, w, tp) == pytest.approx(0.4)
    # halfway (in log2) to the next node along tp, and along all three
    assert at(t, w, tp * 2**0.5) == pytest.approx(0.2, abs=1e-6)
    assert at(t * 2**0.5, w * 2**0.5, tp * 2**0.5) == pytest.approx(0.05, abs=1e-6)
    assert at(t, w, tp * 2) == pytest.approx(0.0, abs=1e-9)
    # shapes past the edge nodes read the edge: tp 64 reads tp 8, 100 tokens the first node
    edge = _grid_with((0, 3, LAYER_GRID[2] - 1), -0.3)
    assert float(kernels.layer_log_time(edge, 100.0, w, 64.0)) == pytest.approx(-0.3)


def test_layer_grid_scales_every_part_of_the_layer_and_nothing_else():
    """A node at the layer's shape set to 1.5x: every per-layer part (compute, exposed TP
    communication) grows 1.5x, the embedding, LM head, pipeline sends and optimizer do not;
    the default grid changes nothing."""
    plan = PlanSpec(tp=4, microbatch=2, global_batch=16, recompute="full")
    model, plan_a, cluster = arrays(GPT, plan)
    p0 = default_params(jnp.float64)
    node = _node_of(plan.microbatch * GPT.seq_len, GPT.hidden // plan.tp, plan.tp)
    slow = p0.replace(layer_shape_log_time=_grid_with(node, np.log(1.5)))
    base, moved = (stage_times(model, plan_a, cluster, p, 1e-3) for p in (p0, slow))
    layers = GPT.n_layers
    per_layer = lambda st: np.asarray(st.parts[1]) / layers  # noqa: E731  (a middle stage)
    np.testing.assert_allclose(per_layer(moved)[:4], 1.5 * per_layer(base)[:4], rtol=1e-9)
    assert per_layer(base)[1] > 0  # the TP communication part is there to scale
    # the first stage's extras (embedding, LM head with pp = 1) are outside the layers
    extras = lambda st: np.asarray(st.parts[0, 0] - st.parts[1, 0])  # noqa: E731
    np.testing.assert_allclose(extras(moved), extras(base), rtol=1e-9)
    assert float(moved.optimizer_s) == float(base.optimizer_s)
    assert float(moved.p2p_s) == float(base.p2p_s)
    # zero everywhere is no factor at all; a node of another tp is not read
    other = p0.replace(layer_shape_log_time=_grid_with(node[:2] + (0,), np.log(1.5)))
    t0, t1 = (float(simulate(model, plan_a, cluster, p, 1e-3).iteration_s) for p in (p0, other))
    assert t1 == t0


def test_layer_grid_gradients_are_finite_and_reach_the_node_read():
    plan = PlanSpec(tp=2, microbatch=1, global_batch=8)
    model, plan_a, cluster = arrays(GPT, plan)
    g = _iteration_grad("layer_shape_log_time", model, plan_a, cluster)
    assert np.all(np.isfinite(g))
    node = _node_of(plan.microbatch * GPT.seq_len, GPT.hidden // plan.tp, plan.tp)
    assert g[node] > 0 and np.count_nonzero(g) == 1  # an exact node shape reads one node


def test_layer_grid_profile_round_trip_and_errors(tmp_path):
    p0 = default_params()
    moved = p0.replace(layer_shape_log_time=_grid_with((1, 2, 3), np.log(1.2)))
    values = prof.to_values(moved, ("layer_shape_time",))
    assert values == {"layer_shape_time": {"1024x512x8": pytest.approx(1.2)}}
    back = prof.apply_values(p0, values)
    np.testing.assert_allclose(back.layer_shape_log_time, moved.layer_shape_log_time, atol=1e-6)
    bad = tmp_path / "bad.yaml"
    for text, error in [
        ("{'1024x500x8': 1.1}", r"layer_shape_time\.1024x500x8: expected 'TxWxP' with .*W one of"),
        ("{'1024x512x16': 1.1}", r"P one of 1, 2, 4, 8"),
        ("{'1024x512x8': -1}", "must be a number above 0"),
        ("[1.1]", r"layer_shape_time must map 'TxWxP' layer shapes to factors"),
    ]:
        bad.write_text(f"constants: {{layer_shape_time: {text}}}\n")
        with pytest.raises(prof.ProfileError, match=error):
            prof.apply_values(p0, prof._read(bad)["constants"], str(bad))


def test_moved_summarises_the_layer_grid():
    before = prof.to_values(default_params())
    after = dict(before, layer_shape_time={"1024x512x8": 1.2, "2048x512x8": 1.01})
    rows = calibrate_moved(before, after)
    assert rows == [("layer shape grid: 1 nodes moved > 5%", 0.0, 0.0)]
    # the printed table leaves a grid's before/after blank, as for the GEMM grid
    assert moved_cells(*rows[0]) == ("", "")
    assert moved_cells("GEMM shape grid: 3 nodes moved > 5%", 0.0, 0.0) == ("", "")
    assert moved_cells("nic_eff", 0.85, 0.5) == ("0.85", "0.5")


def test_layer_grid_reads_the_same_nodes_compiled_as_eager():
    """As the GEMM grid (``tests/test_calibration.py``): shapes on the nodes read their node
    under jit too."""
    layer = jnp.asarray(np.random.default_rng(0).standard_normal(LAYER_GRID))
    t, w, tp = jnp.array([2048.0, 4096, 3000]), jnp.array([256.0, 512, 300]), jnp.array([8.0, 2, 3])
    read = jax.vmap(kernels.layer_log_time, in_axes=(None, 0, 0, 0))
    np.testing.assert_allclose(jax.jit(read)(layer, t, w, tp), read(layer, t, w, tp), atol=1e-5)
    assert float(read(layer, t, w, tp)[0]) == pytest.approx(float(layer[2, 1, 3]))


HEAD_NODES = [[2 ** (lo + i) for i in range(n)] for lo, n in zip(HEAD_GRID_LOG2_LO, HEAD_GRID)]


def _head_node(tokens, hidden, tp):
    return tuple(HEAD_NODES[d].index(v) for d, v in enumerate((tokens, hidden, tp)))


def test_head_grid_scales_the_lm_head_and_loss_and_nothing_else():
    """A node at the head's shape (tokens, hidden, tp) set to 2x: the last stage's extras (LM
    head GEMMs, cross entropy and its all-reduces) double, the layers, the first stage's
    embedding, the pipeline sends and the optimizer do not."""
    plan = PlanSpec(tp=2, pp=2, microbatch=2, global_batch=16)
    model, plan_a, cluster = arrays(GPT, plan)
    p0 = default_params(jnp.float64)
    node = _head_node(plan.microbatch * GPT.seq_len, GPT.hidden, plan.tp)
    slow = p0.replace(head_shape_log_time=jnp.zeros(HEAD_GRID).at[node].set(np.log(2.0)))
    base, moved = (stage_times(model, plan_a, cluster, p, 1e-3) for p in (p0, slow))
    extra = lambda st, s: float(st.parts[s, 0] - st.parts[1, 0])  # noqa: E731
    assert extra(base, 2) > 0
    assert extra(moved, 2) == pytest.approx(2.0 * extra(base, 2), rel=1e-9)
    assert extra(moved, 0) == pytest.approx(extra(base, 0), rel=1e-12)  # embedding only
    np.testing.assert_allclose(moved.parts[1], base.parts[1], rtol=1e-12)
    # the last stage's forward grows by the head's and loss's forward time, the first does not
    assert float(moved.fwd_s[2]) > float(base.fwd_s[2])
    assert float(moved.fwd_s[0]) == pytest.approx(float(base.fwd_s[0]), rel=1e-12)
    assert float(moved.optimizer_s) == float(base.optimizer_s)
    assert float(moved.p2p_s) == float(base.p2p_s)
    g = _iteration_grad("head_shape_log_time", model, plan_a, cluster)
    assert np.all(np.isfinite(g)) and g[node] > 0 and np.count_nonzero(g) == 1


def test_head_grid_profile_round_trip_errors_and_summary(tmp_path):
    p0 = default_params()
    moved = p0.replace(head_shape_log_time=jnp.zeros(HEAD_GRID).at[2, 4, 0].set(np.log(2.5)))
    values = prof.to_values(moved, ("head_shape_time",))
    assert values == {"head_shape_time": {"2048x2048x1": pytest.approx(2.5)}}
    back = prof.apply_values(p0, values)
    np.testing.assert_allclose(back.head_shape_log_time, moved.head_shape_log_time, atol=1e-6)
    bad = tmp_path / "bad.yaml"
    bad.write_text("constants: {head_shape_time: {'2048x2000x1': 1.1}}\n")
    with pytest.raises(prof.ProfileError, match=r"head_shape_time\.2048x2000x1: expected 'TxHxP'"):
        prof.apply_values(p0, prof._read(bad)["constants"], str(bad))
    before = prof.to_values(default_params())
    rows = calibrate_moved(before, dict(before, head_shape_time={"2048x2048x1": 2.5}))
    assert rows == [("LM head shape grid: 1 nodes moved > 5%", 0.0, 0.0)]
    assert moved_cells(*rows[0]) == ("", "")


def test_cluster_layer_grid_adds_to_the_device_grid():
    """A cluster's own layer grid multiplies the device grid's factor at the same node."""
    plan = PlanSpec(tp=2, microbatch=1, global_batch=8)
    model, plan_a, cluster = arrays(GPT, plan)
    p0 = default_params(jnp.float64)
    node = _node_of(plan.microbatch * GPT.seq_len, GPT.hidden // plan.tp, plan.tp)
    grid = _grid_with(node, np.log(1.2))
    per_layer = lambda p: float(stage_times(model, plan_a, cluster, p, 1e-3).parts[1, 0])  # noqa: E731
    base = per_layer(p0)
    on_device = per_layer(p0.replace(layer_shape_log_time=grid))
    on_cluster = per_layer(p0.replace(cluster_layer_log_time=grid))
    both = per_layer(p0.replace(layer_shape_log_time=grid, cluster_layer_log_time=grid))
    assert on_device == pytest.approx(on_cluster, rel=1e-12)
    assert both == pytest.approx(1.2 * 1.2 * base, rel=1e-9)
    assert base < on_device


def test_cluster_grids_are_fitted_only_for_clusters_with_many_rows():
    """Clusters with fewer e2e rows (of positive weight) than the threshold keep their cluster
    layer and head grids: no gradient reaches them; every other constant is free."""
    shape = (3,) + LAYER_GRID
    clu = {F.CLUSTER_LAYER_LEAF: jnp.ones(shape), F.HEAD_LEAF: jnp.ones(shape), "x": jnp.ones(3)}
    e2e = {
        "log_meas": jnp.zeros(6),
        "c": jnp.array([0, 0, 0, 1, 1, 2]),
        "weight": jnp.array([1.0, 1, 1, 1, 0, 1]),  # cluster 1's second row is held out
    }
    total = lambda c: sum(  # noqa: E731
        jnp.sum(v) for v in F._freeze_small_cluster_grids(c, e2e, 2).values()
    )
    g = jax.grad(total)(clu)
    for leaf in (F.CLUSTER_LAYER_LEAF, F.HEAD_LEAF):
        assert g[leaf][:, 0, 0, 0].tolist() == [1.0, 0.0, 0.0]
    assert g["x"].tolist() == [1.0, 1.0, 1.0]
