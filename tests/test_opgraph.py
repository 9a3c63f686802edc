"""The operator graph IR and ``from_jax``: FLOPs against XLA, the backward pass, saved tensors,
loops, errors, and the per-operator pricing (``diffcost.opgraph.pricing``)."""

from __future__ import annotations

import doctest
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffcost import workload, zoo
from diffcost.arrays import cluster_arrays, model_arrays, plan_arrays
from diffcost.config import load_cluster
from diffcost.kernels import gemm_s
from diffcost.opgraph import Sbp, UnsupportedPrimitiveError, from_jax, graph_arrays, graph_time_s
from diffcost.opgraph.pricing import on_chip
from diffcost.opgraph.xla import xla_flops
from diffcost.params import default_params
from diffcost.specs import ModelSpec, PlanSpec

FLOP_TOLERANCE = 0.02  # the bar: within 2% of XLA's cost analysis
# Against the lowered module (before XLA's passes) the counts agree to rounding: what is left is
# XLA counting an index computation or two.
HLO_TOLERANCE = 0.001
F32 = jnp.float32


def spec(*shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def mlp(w1, w2, x):
    return nn.relu(x @ w1) @ w2


MLP_ARGS = (spec(64, 128), spec(128, 32), spec(16, 64))


def test_matmul_flops_and_backward_doubles_them():
    """Forward: 2 m n k per product. Backward with every argument differentiated: dgrad and
    wgrad of each product, exactly 2x the forward matmul FLOPs; without the input's gradient
    the first product's dgrad is skipped."""
    fwd = 2.0 * 16 * 64 * 128 + 2.0 * 16 * 128 * 32
    g = from_jax(mlp, *MLP_ARGS)
    assert g.flops("forward", ["matmul"]) == fwd
    assert g.flops("backward", ["matmul"]) == 2.0 * fwd
    weights_only = from_jax(mlp, *MLP_ARGS, argnums=(0, 1))
    assert weights_only.flops("backward", ["matmul"]) == 2.0 * fwd - 2.0 * 16 * 64 * 128
    assert len(g.gradients) == 3 and len(weights_only.gradients) == 2


def test_docstring_examples_run():
    from diffcost.opgraph import trace

    assert doctest.testmod(trace).failed == 0
    assert doctest.testmod(zoo).failed == 0


def test_a_traced_training_step_has_its_own_backward():
    """``fn`` that takes its own gradients, traced with ``backward=False``: its reverse-mode
    operations are the backward phase, the same products as ``from_jax`` adds to the loss."""

    def loss(w1, w2, x):
        return jnp.mean(mlp(w1, w2, x) ** 2)

    def train_step(w1, w2, x):
        g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2, x)
        return w1 - 0.1 * g1, w2 - 0.1 * g2

    step = from_jax(train_step, *MLP_ARGS, backward=False)
    reference = from_jax(loss, *MLP_ARGS, argnums=(0, 1))
    for phase in ("forward", "backward"):
        assert step.flops(phase, ["matmul"]) == reference.flops(phase, ["matmul"])
    assert step.flops("backward", ["matmul"]) > 0


def test_forward_only_graph_has_no_backward():
    g = from_jax(mlp, *MLP_ARGS, backward=False)
    assert not g.select("backward") and not g.saved and g.flops() > 0


def _conv(stride, padding, dilation, groups):
    def f(k, x):
        return jax.lax.conv_general_dilated(
            x, k, (stride,) * 2, padding, rhs_dilation=(dilation,) * 2,
            dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=groups,
        )  # fmt: skip

    return f, (spec(3, 3, 16 // groups, 32), spec(2, 17, 17, 16))


def _block():
    block = zoo.model("transformer_block", batch=2)
    return block.fn, block.args


CASES = {
    "mlp": (mlp, MLP_ARGS),
    "conv_same": _conv(1, "SAME", 1, 1),
    "conv_strided_valid": _conv(2, "VALID", 1, 1),
    "conv_dilated": _conv(1, ((2, 2), (2, 2)), 2, 1),
    "conv_depthwise": _conv(1, "SAME", 1, 16),
    "softmax_layernorm": (
        lambda w, x: jax.nn.softmax(jax.nn.standardize(x, axis=-1) @ w),
        (spec(64, 64), spec(32, 64)),
    ),
    "transformer_block": _block(),
    "embedding_bag": (
        lambda t, ids: jnp.sum(jnp.take(t, ids, axis=0), axis=1),
        (spec(1000, 128), spec(256, 20, dtype=jnp.int32)),
    ),
    "advanced_indexing": (
        lambda t, ids: t[ids[:, 0], ids[:, 1]],
        (spec(100, 50, 16), spec(64, 2, dtype=jnp.int32)),
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_flops_match_xla(name):
    """Forward and training-step FLOPs within 2% of ``compile().cost_analysis()``."""
    fn, args = CASES[name]
    argnums = (0, 1) if name == "mlp" else (0,)
    g = from_jax(fn, *args, argnums=argnums)
    forward = xla_flops(fn, *args, argnums=argnums, backward=False)
    step = xla_flops(fn, *args, argnums=argnums)
    assert g.flops("forward") == pytest.approx(forward, rel=FLOP_TOLERANCE)
    assert g.flops() == pytest.approx(step, rel=FLOP_TOLERANCE)
    lowered = xla_flops(fn, *args, argnums=argnums, optimized=False)
    assert g.flops() == pytest.approx(lowered, rel=HLO_TOLERANCE)


def test_transformer_block_attention_products_are_attention():
    fn, args = _block()
    g = from_jax(fn, *args, argnums=(0,))
    forward = g.select("forward", ["attention"])
    assert len(forward) == 2  # scores and the weighted sum of values
    # 2 x batch x heads x seq^2 x head_dim, twice
    assert sum(op.flops for op in forward) == 2 * 2.0 * 2 * 8 * 128 * 128 * 64
    backward = g.select("backward", ["attention"])
    assert len(backward) == 4  # both operands' gradients of both products
    assert g.flops("backward", ["attention"]) == 2 * g.flops("forward", ["attention"])


def test_transformer_block_gemms_equal_the_closed_form_workload():
    """The graph's matrix-product FLOPs of the zoo's encoder block equal what
    ``workload.layer_forward_flops`` says for the same shape (the transformer path's GEMMs and
    full-square attention), to the FLOP."""
    block = zoo.model("transformer_block", batch=4)
    g = from_jax(block.fn, *block.args, argnums=block.argnums)
    model = ModelSpec(
        name="block", n_layers=1, hidden=512, ffn_hidden=2048, heads=8, kv_heads=8, seq_len=128,
        vocab=32000, mlp="gelu", norm="layernorm", bias=True, tied_embeddings=False,
        attention="unfused",
    )  # fmt: skip
    arrays = model_arrays(model), plan_arrays(PlanSpec(microbatch=4))
    expected = float(workload.layer_forward_flops(*arrays))
    assert g.flops("forward", ["matmul", "attention"]) == expected


def test_saved_tensors_and_remat():
    """Without remat the backward reads the hidden activation the forward computed; with
    ``jax.checkpoint`` only the arguments are saved, and the backward recomputes the forward
    products whose outputs it needs."""
    g = from_jax(mlp, *MLP_ARGS)
    saved_shapes = {g.tensors[t].shape for t in g.saved if g.tensors[t].producer >= 0}
    assert (16, 128) in saved_shapes
    by_op = g.saved_by()
    assert sum(g.tensors[t].bytes for ts in by_op.values() for t in ts) == g.saved_bytes
    assert all(g.operators[i].phase == "forward" for i in by_op)
    assert g.saved_bytes >= 16 * 128 * 4
    for t in g.saved:  # every saved tensor is read by the backward pass
        assert any(t in op.inputs for op in g.select("backward"))
    remat = from_jax(jax.checkpoint(mlp), *MLP_ARGS)
    assert remat.saved_bytes == 0
    first = 2.0 * 16 * 64 * 128  # x @ w1: its output is needed again, the last product's not
    fwd = remat.flops("forward", ["matmul"])
    assert remat.flops("backward", ["matmul"]) == 2.0 * fwd + first


def test_scan_counts_its_trip_count_and_while_is_noted():
    """A scan body counts ``length`` times. XLA's cost analysis counts a loop body once, so
    the reference is the same scan unrolled (the jaxpr is the same scan either way)."""

    def rnn(w, h, unroll=1):
        def body(h, _):
            return jnp.tanh(h @ w), None

        return jax.lax.scan(body, h, None, length=7, unroll=unroll)[0]

    args = (spec(32, 32), spec(4, 32))
    g = from_jax(rnn, *args)
    assert g.flops("forward", ["matmul"]) == 7 * 2.0 * 4 * 32 * 32
    assert g.flops("backward", ["matmul"]) == 2 * 7 * 2.0 * 4 * 32 * 32
    unrolled = xla_flops(lambda w, h: rnn(w, h, unroll=True), *args)
    assert g.flops() == pytest.approx(unrolled, rel=FLOP_TOLERANCE)

    def loop(w, h):
        return jax.lax.while_loop(lambda c: c[1] < 5, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1),
                                  (h, 0))[0]  # fmt: skip

    g = from_jax(loop, *args, backward=False)
    assert any("while loop" in note and "counted once" in note for note in g.notes)
    assert g.flops("forward", ["matmul"]) == 2.0 * 4 * 32 * 32


def test_custom_vjp_and_cond_are_walked_into():
    """A ``custom_vjp`` function's primal body is counted in the forward, its own backward
    rule in the backward; a ``cond`` counts its costliest branch and says so."""

    @jax.custom_vjp
    def square_matmul(w, x):
        return x @ w @ w

    square_matmul.defvjp(
        lambda w, x: (square_matmul(w, x), (w, x)),
        lambda res, g: (res[1].T @ g @ res[0].T, g @ res[0].T @ res[0].T),
    )
    args = (spec(32, 32), spec(8, 32))
    g = from_jax(square_matmul, *args)
    assert g.flops("forward", ["matmul"]) == 2 * 2.0 * 8 * 32 * 32
    backward = xla_flops(square_matmul, *args) - g.flops("forward")
    assert g.flops("backward", ["matmul"]) == pytest.approx(backward, rel=FLOP_TOLERANCE)

    def branchy(w, x):
        return jax.lax.cond(x[0, 0] > 0, lambda: x @ w @ w, lambda: x @ w)

    g = from_jax(branchy, *args, backward=False)
    assert g.flops("forward", ["matmul"]) == 2 * 2.0 * 8 * 32 * 32
    assert any("cond" in note and "costliest" in note for note in g.notes)


def test_shard_map_collectives_become_collective_operators():
    """Inside ``shard_map`` the walk sees per-device shapes; ``psum`` is a collective operator
    in the forward and (transposed) in the backward."""
    mesh = jax.make_mesh((1,), ("x",))
    spec_none = jax.sharding.PartitionSpec()

    def body(w, x):
        return jax.lax.psum(x @ w, "x")

    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec_none, spec_none), out_specs=spec_none,
                       check_vma=False)  # fmt: skip
    g = from_jax(fn, spec(64, 32), spec(16, 64))
    assert g.select("forward", ["collective"]) and g.select("backward", ["collective"])
    assert g.flops("forward", ["matmul"]) == 2.0 * 16 * 64 * 32


def test_graph_edges_are_topological():
    fn, args = _block()
    g = from_jax(fn, *args, argnums=(0,))
    edges = g.edges()
    assert edges.shape[1] == 2 and len(edges) > len(g.operators) // 2
    assert np.all(edges[:, 0] < edges[:, 1])
    for op_index, op in enumerate(g.operators):
        for t in op.outputs:
            assert g.tensors[t].producer == op_index


def test_unsupported_primitive_names_it_and_the_supported_ones():
    with pytest.raises(UnsupportedPrimitiveError, match=r"'sort'.*dot_general.*scan"):
        from_jax(lambda x: jnp.sort(x), spec(8))


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match=r"example argument 1 .*str"):
        from_jax(lambda x, y: x, spec(3), "not an array")
    with pytest.raises(ValueError, match="argument 1 .*not floating point"):
        from_jax(lambda x, i: x[i], spec(3), spec(2, dtype=jnp.int32), argnums=(1,))
    with pytest.raises(ValueError, match=r"output \[1\] has dtype int32.*backward=False"):
        from_jax(lambda x: (x * 2.0, jnp.argmax(x).astype(jnp.int32)), spec(3))
    with pytest.raises(ValueError, match="valid: 'S', 'B', 'P'"):
        Sbp("X")
    with pytest.raises(ValueError, match="split needs a tensor axis"):
        Sbp("S")


# Pricing ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def priced():
    g = from_jax(mlp, *MLP_ARGS)
    return g, graph_arrays(g), cluster_arrays(load_cluster("dgx-h100")), default_params()


def test_elementwise_chain_stays_on_chip():
    """``tanh(exp(x) * 2)``: the two intermediates are fused away, the output is not."""
    g = from_jax(lambda x: jnp.tanh(jnp.exp(x) * 2.0), spec(1024), backward=False)
    fused = on_chip(g)
    assert not fused[g.outputs[0]]
    assert fused.sum() >= 2


def test_graph_time_is_positive_jittable_and_differentiable(priced):
    g, arrays, cluster, params = priced
    eager = graph_time_s(g, cluster, params)
    jitted = jax.jit(graph_time_s)(arrays, cluster, params)
    np.testing.assert_allclose(eager, jitted, rtol=1e-12)
    assert eager.shape == (2,) and np.all(eager > 0) and eager[1] > eager[0]
    grad = jax.grad(lambda p: jnp.sum(graph_time_s(arrays, cluster, p)))(params)
    leaves = jax.tree_util.tree_leaves(grad)
    assert all(np.all(np.isfinite(leaf)) for leaf in leaves)
    assert np.sum(np.abs(grad.gemm_eff_logit)) > 0 and np.abs(grad.mem_eff_logit) > 0


def test_a_matmul_costs_what_the_kernel_model_says(priced):
    """One fp32 product: the graph's forward time is ``kernels.gemm_s`` of its shape plus one
    launch; nothing else in the graph costs anything (the arguments are not copied)."""
    _, _, cluster, params = priced
    g = from_jax(lambda w, x: x @ w, spec(256, 512), spec(1024, 256), backward=False)
    rate = cluster.peak_flops[0] * params.gemm_eff[0]
    expected = gemm_s(1024.0, 512.0, 256.0, rate, cluster, params, 1e-3)
    forward, backward = graph_time_s(g, cluster, params, 1e-3)
    np.testing.assert_allclose(forward, expected + params.kernel_overhead_s, rtol=1e-12)
    assert backward == 0.0


def test_a_convolution_moves_its_tensors_not_its_implicit_gemm_operand(priced):
    """A 3x3x3 convolution at 32 channels: its implicit GEMM's ``m x k`` operand repeats every
    input element 27 times, but the kernel reads the input tensor, the weights and writes the
    output: the GEMM model gets those bytes as its traffic."""
    _, _, cluster, params = priced
    conv = lambda w, x: jax.lax.conv_general_dilated(  # noqa: E731
        x, w, (1, 1, 1), "SAME", dimension_numbers=("NDHWC", "DHWIO", "NDHWC")
    )
    x, w = spec(2, 32, 32, 32, 32, dtype=jnp.float16), spec(3, 3, 3, 32, 32, dtype=jnp.float16)
    g = from_jax(conv, w, x, backward=False)
    (op,) = g.select("forward", ["convolution"])
    groups, m, n, k = op.gemm
    tensors = 2.0 * (x.size + w.size + m * n)  # fp16 input, kernel and output
    assert op.bytes_read + op.bytes_written == pytest.approx(tensors)
    assert 2.0 * m * k > 20 * 2.0 * x.size  # the m x k operand (padding taps excluded)
    rate = cluster.peak_flops[1] * params.gemm_eff[1]
    want = gemm_s(m, n, k, rate, cluster, params, 1e-3, io_bytes=tensors)
    implicit = gemm_s(m, n, k, rate, cluster, params, 1e-3)
    forward, _ = graph_time_s(g, cluster, params, 1e-3)
    np.testing.assert_allclose(forward, want + params.kernel_overhead_s, rtol=1e-12)
    assert forward < 0.5 * implicit


def test_a_scan_costs_its_trip_count(priced):
    _, _, cluster, params = priced

    def rnn(w, h, length):
        return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), h, None, length=length)[0]

    args = (spec(64, 64), spec(8, 64))
    graphs = [from_jax(functools.partial(rnn, length=n), *args) for n in (3, 6)]
    times = [graph_time_s(g, cluster, params) for g in graphs]
    np.testing.assert_allclose(times[1], 2.0 * times[0], rtol=1e-12)


def test_graph_time_compiles_once(priced):
    _, arrays, cluster, params = priced
    step = jax.jit(graph_time_s)
    step(arrays, cluster, params)
    other = params.replace(mem_eff_logit=params.mem_eff_logit + 0.5)
    step(arrays, cluster, other)
    assert step._cache_size() == 1


def test_more_bandwidth_or_flops_never_slower(priced):
    _, arrays, cluster, params = priced
    base = np.sum(graph_time_s(arrays, cluster, params))
    faster_hbm = cluster.replace(hbm_Bps=cluster.hbm_Bps * 2.0)
    faster_gemm = cluster.replace(peak_flops=cluster.peak_flops * 2.0)
    assert np.sum(graph_time_s(arrays, faster_hbm, params)) < base
    assert np.sum(graph_time_s(arrays, faster_gemm, params)) < base


def test_bfloat16_arguments_are_differentiated():
    from diffcost.opgraph.trace import differentiated

    bf16 = jax.ShapeDtypeStruct((4, 4), jnp.bfloat16)
    ints = jax.ShapeDtypeStruct((4,), jnp.int32)
    assert differentiated((bf16, ints), None) == (0,)
    with pytest.raises(ValueError, match="argument 1 .* not floating point"):
        differentiated((bf16, ints), (0, 1))
