"""Independent check of the workload's FLOP and activation counts against XLA.

One dense transformer block is written in flax exactly as ``diffcost.workload`` describes it
(pre-norm; QKV projection with grouped-query attention; ``QK^T / sqrt(d)``, causal mask,
softmax, ``@ V``; output projection; GELU or SwiGLU MLP; LayerNorm or RMSNorm; biases per
``bias``), plus the LM head alone. Then:

* FLOPs: XLA's ``cost_analysis()`` of the compiled forward on the CPU against
  ``layer_forward_flops`` / ``head_forward_flops`` (tp = cp = 1). The workload counts GEMMs
  only (attention as the full square, which is also what a masked dense implementation
  executes); XLA also counts elementwise work (softmax, norms, activation, adds), so the
  shapes are chosen where GEMMs dominate and the comparison allows ``FLOP_TOLERANCE``.
* Forward + backward: XLA's count of one training step of the block (output and the
  gradients w.r.t. parameters and input, for an arbitrary output cotangent) against 3x the
  workload's forward, the convention of ``model_flops_per_iteration``. The step must return
  the output: a VJP whose output is discarded lets XLA drop the last forward GEMM (FC2), which
  measures ~2.7x instead of 3x.
* Activations: the residuals JAX saves for the backward pass (``print_saved_residuals``), in
  bf16, against ``layer_activation_bytes`` (Korthikanti et al.). The comparable block uses
  "fused kernel" versions of the norm, softmax and activation function that keep what
  Megatron's kernels keep (norm and activation inputs, softmax output) instead of every
  elementwise intermediate of plain autodiff. The block has no dropout, so the model's two
  ``s b h`` dropout masks (1 B each) and, without flash attention, the attention-dropout mask
  (1 B) and output (2 B) per score are subtracted from the model's count. (Plain autodiff of
  the same block keeps about 2x more: fp32 norm intermediates, both the exponentials and the
  normalized softmax, and every tanh-GELU / SiLU intermediate.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math
import re
from typing import Any

import flax.linen as nn
import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest

from diffcost import workload
from diffcost.arrays import model_arrays, plan_arrays
from diffcost.specs import ModelSpec, PlanSpec

FLOP_TOLERANCE = 0.02  # XLA's elementwise FLOPs on top of the GEMMs, relative
BACKWARD_TOLERANCE = 0.05  # forward + backward vs 3x the workload's forward, relative
# Activation bytes: both sides are sums of exact tensor sizes and agree to the byte; 1% (rather
# than a loose 10%) still catches a missing 2 s b h term (~4-6% of a layer's activations).
ACTIVATION_TOLERANCE = 0.01


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    mlp: str  # "gelu" | "swiglu"
    norm: str  # "layernorm" | "rmsnorm"
    bias: bool
    batch: int
    seq: int
    vocab: int = 32000

    def spec(self, flash: bool = True) -> ModelSpec:
        return ModelSpec(
            name=self.name, n_layers=1, hidden=self.hidden, ffn_hidden=self.ffn,
            heads=self.heads, kv_heads=self.kv_heads, seq_len=self.seq, vocab=self.vocab,
            mlp=self.mlp, norm=self.norm, bias=self.bias, tied_embeddings=False,
            attention="flash" if flash else "unfused",
        )  # fmt: skip

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


CASES = [
    Case("gpt-h1024", 1024, 16, 16, 4096, "gelu", "layernorm", True, batch=2, seq=512),
    Case("llama-gqa-h1024", 1024, 16, 4, 2816, "swiglu", "rmsnorm", False, batch=2, seq=512),
    Case("llama-gqa-h2048", 2048, 32, 8, 5632, "swiglu", "rmsnorm", False, batch=1, seq=512),
    Case("gpt2-h768-s1024", 768, 12, 12, 3072, "gelu", "layernorm", True, batch=1, seq=1024),
    Case("mqa-swiglu-ln-bias", 1024, 8, 1, 2816, "swiglu", "layernorm", True, batch=2, seq=256),
]
CASE_IDS = [c.name for c in CASES]


# --- the block --------------------------------------------------------------------------------


def _saving_inputs(fn):
    """``fn`` as a fused kernel: backward keeps only the inputs and recomputes the rest."""

    @jax.custom_vjp
    def fused(*args):
        return fn(*args)

    def fwd(*args):
        return fn(*args), args

    def bwd(args, ct):
        return jax.vjp(fn, *args)[1](ct)

    fused.defvjp(fwd, bwd)
    return fused


def _norm_fn(rms: bool):
    def norm(x, scale, bias):
        x32 = x.astype(jnp.float32)
        if not rms:
            x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
        y = y * scale.astype(jnp.float32)
        if bias is not None:
            y = y + bias.astype(jnp.float32)
        return y.astype(x.dtype)

    return norm


@jax.custom_vjp
def _softmax_saving_output(x):
    return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)


def _softmax_fwd(x):
    p = _softmax_saving_output(x)
    return p, p


def _softmax_bwd(p, ct):
    p32, c = p.astype(jnp.float32), ct.astype(jnp.float32)
    return ((p32 * (c - jnp.sum(c * p32, axis=-1, keepdims=True))).astype(p.dtype),)


_softmax_saving_output.defvjp(_softmax_fwd, _softmax_bwd)


def _gelu(z):
    return jax.nn.gelu(z, approximate=True)


def _swiglu(g, u):
    return jax.nn.silu(g) * u


class Norm(nn.Module):
    kind: str
    bias: bool
    dtype: Any
    fused: bool

    @nn.compact
    def __call__(self, x):
        h = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (h,), self.dtype)
        has_bias = self.bias and self.kind == "layernorm"
        bias = self.param("bias", nn.initializers.zeros, (h,), self.dtype) if has_bias else None
        fn = _norm_fn(self.kind == "rmsnorm")
        return (_saving_inputs(fn) if self.fused else fn)(x, scale, bias)


def attention_core(q, k, v, fused: bool):
    """``softmax(QK^T / sqrt(d) + causal) V`` with q [b,s,g,r,d] and k, v [b,s,g,d]."""
    b, s, g, r, d = q.shape
    scores = jnp.einsum("bqgrd,bkgd->bgrqk", q, k) / jnp.asarray(math.sqrt(d), q.dtype)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    scores = scores + jnp.where(causal, 0.0, -1e9).astype(scores.dtype)  # additive: no residual
    p = _softmax_saving_output(scores) if fused else jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bgrqk,bkgd->bqgrd", p, v).reshape(b, s, g * r * d)


class Block(nn.Module):
    case: Case
    dtype: Any = jnp.float32
    fused: bool = False  # norm/softmax/activation keep only what Megatron's kernels keep
    remat_attention: bool = False  # selective recompute of the attention core

    @nn.compact
    def __call__(self, x):
        c = self.case
        b, s, h = x.shape
        d = h // c.heads
        groups, rep = c.kv_heads, c.heads // c.kv_heads

        def dense(features, name):
            return nn.Dense(
                features, use_bias=c.bias, dtype=self.dtype, param_dtype=self.dtype, name=name
            )

        def norm(name):
            return Norm(c.norm, c.bias, self.dtype, self.fused, name=name)

        y = norm("norm1")(x)
        qkv = dense((c.heads + 2 * c.kv_heads) * d, "qkv")(y)
        q, k, v = jnp.split(qkv, [c.heads * d, (c.heads + c.kv_heads) * d], axis=-1)
        q = q.reshape(b, s, groups, rep, d)
        k = k.reshape(b, s, groups, d)
        v = v.reshape(b, s, groups, d)
        core = attention_core
        if self.remat_attention:
            core = jax.checkpoint(attention_core, static_argnums=(3,))
        x = x + dense(h, "proj")(core(q, k, v, self.fused))

        y = norm("norm2")(x)
        if c.mlp == "swiglu":
            act = _saving_inputs(_swiglu) if self.fused else _swiglu
            u = act(dense(c.ffn, "gate")(y), dense(c.ffn, "up")(y))
        else:
            act = _saving_inputs(_gelu) if self.fused else _gelu
            u = act(dense(c.ffn, "fc1")(y))
        return x + dense(h, "fc2")(u)


# --- measurement helpers ----------------------------------------------------------------------


def xla_flops(fn, *args) -> float:
    with jax.default_device(jax.devices("cpu")[0]):  # the CPU's count, whatever else is here
        cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost["flops"])


def abstract_block(case: Case, dtype, **kw):
    block = Block(case, dtype=dtype, **kw)
    x = jax.ShapeDtypeStruct((case.batch, case.seq, case.hidden), dtype)
    params = jax.eval_shape(block.init, jax.random.PRNGKey(0), x)
    return block, params, x


_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "bool": 1, "i8": 1, "u8": 1, "i32": 4,
             "u32": 4, "i64": 8, "u64": 8}  # fmt: skip
_RESIDUAL_LINE = re.compile(r"^~?(\w+)\[([\d,]*)\]\s+(.*)$")


def saved_residuals(fn, *args) -> list[tuple[int, str]]:
    """(bytes, source) of every residual JAX saves for the backward of ``fn`` (public API)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    out = []
    for line in buf.getvalue().splitlines():
        m = _RESIDUAL_LINE.match(line.strip())
        assert m, f"unparsed residual line: {line!r}"
        dtype, dims, src = m.groups()
        size = math.prod(int(n) for n in dims.split(",") if n)
        out.append((size * _ITEMSIZE[dtype], src))
    return out


def activation_residual_bytes(fn, params, x) -> int:
    """Residual bytes of ``fn(params, x)`` that are activations: not parameters, not literals."""
    res = saved_residuals(lambda params, x: fn(params, x), params, jnp.zeros_like(x))
    assert any(src.startswith("from the argument x") for _, src in res)  # the layer input
    return sum(n for n, src in res if not src.startswith(("from the argument params", "from a")))


def workload_arrays(case: Case, flash: bool = True):
    return model_arrays(case.spec(flash)), plan_arrays(PlanSpec(microbatch=case.batch))


def rel(measured, expected) -> float:
    return abs(measured - expected) / abs(measured)


# --- FLOPs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_layer_forward_flops_match_xla(case):
    block, params, x = abstract_block(case, jnp.float32)
    measured = xla_flops(block.apply, params, x)
    expected = float(workload.layer_forward_flops(*workload_arrays(case)))
    assert measured >= expected  # XLA counts every GEMM FLOP plus elementwise work
    assert rel(measured, expected) <= FLOP_TOLERANCE, (measured, expected)


HEAD_CASES = [
    Case("head-h1024-v32000", 1024, 16, 16, 4096, "gelu", "layernorm", True, 2, 512),
    Case("head-h2048-v50257", 2048, 16, 16, 8192, "gelu", "layernorm", False, 1, 256, 50257),
]


@pytest.mark.parametrize("case", HEAD_CASES, ids=[c.name for c in HEAD_CASES])
def test_head_forward_flops_match_xla(case):
    head = nn.Dense(case.vocab, use_bias=False)
    x = jax.ShapeDtypeStruct((case.batch, case.seq, case.hidden), jnp.float32)
    params = jax.eval_shape(head.init, jax.random.PRNGKey(0), x)
    measured = xla_flops(head.apply, params, x)
    expected = float(workload.head_forward_flops(*workload_arrays(case)))
    assert rel(measured, expected) <= FLOP_TOLERANCE, (measured, expected)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_layer_forward_backward_flops_are_3x_forward(case):
    block, params, x = abstract_block(case, jnp.float32)

    def train_step(params, x, cotangent):
        y, vjp = jax.vjp(block.apply, params, x)
        return y, vjp(cotangent)  # grads w.r.t. params and input; y is the loss's input

    measured = xla_flops(train_step, params, x, x)
    expected = 3.0 * float(workload.layer_forward_flops(*workload_arrays(case)))
    assert rel(measured, expected) <= BACKWARD_TOLERANCE, (measured, expected)


# --- activations ------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(3, 4))
def _block_vjp(params, x, ct, case, fused):
    return jax.vjp(Block(case, fused=fused).apply, params, x)[1](ct)


def test_fused_block_has_the_reference_gradients():
    """The memory tests' custom-VJP kernels compute the same gradients as plain autodiff."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 8, 64)).astype(np.float32)
    ct = rng.normal(size=x.shape).astype(np.float32)
    for case, kv_heads in ((CASES[0], 4), (CASES[1], 2), (CASES[4], 1)):
        small = dataclasses.replace(case, hidden=64, heads=4, kv_heads=kv_heads, ffn=96)
        shapes = jax.eval_shape(Block(small).init, jax.random.PRNGKey(0), x)
        params = jax.tree_util.tree_map(
            lambda s: (
                (1.0 + 0.1 * rng.normal(size=s.shape)).astype(np.float32)
                if s.ndim == 1
                else (rng.normal(size=s.shape) / np.sqrt(s.shape[0])).astype(np.float32)
            ),
            shapes,
        )
        ref = _block_vjp(params, x, ct, small, False)
        got = _block_vjp(params, x, ct, small, True)
        for r, g in zip(
            jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got), strict=True
        ):
            np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-5)


def _dropout_bytes(case: Case, scores_kept: bool) -> float:
    """Bytes of dropout state in the workload's count that a dropout-free block lacks."""
    masks = 2 * case.tokens * case.hidden  # two s*b*h masks, 1 B each
    scores = 3 * case.heads * case.tokens * case.seq if scores_kept else 0  # mask 1 B + out 2 B
    return masks + scores


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_activation_bytes_no_recompute(case):
    block, params, x = abstract_block(case, jnp.bfloat16, fused=True)
    measured = activation_residual_bytes(block.apply, params, x)
    none = float(workload.layer_activation_bytes(*workload_arrays(case, flash=False))[0])
    expected = none - _dropout_bytes(case, scores_kept=True)
    assert rel(measured, expected) <= ACTIVATION_TOLERANCE, (measured, expected)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_activation_bytes_selective_recompute(case):
    block, params, x = abstract_block(case, jnp.bfloat16, fused=True, remat_attention=True)
    measured = activation_residual_bytes(block.apply, params, x)
    selective = float(workload.layer_activation_bytes(*workload_arrays(case, flash=False))[1])
    expected = selective - _dropout_bytes(case, scores_kept=False)
    assert rel(measured, expected) <= ACTIVATION_TOLERANCE, (measured, expected)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_activation_bytes_full_recompute(case):
    block, params, x = abstract_block(case, jnp.bfloat16)
    measured = activation_residual_bytes(jax.checkpoint(block.apply), params, x)
    full = float(workload.layer_activation_bytes(*workload_arrays(case))[2])
    assert measured == full == 2 * case.tokens * case.hidden, (measured, full)
