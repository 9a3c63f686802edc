"""Measure one GPU's kernels and JAX training steps, in the project's data formats.

    python benchmarks/gpu_measure.py --out DIR [--cluster generic-h100] [--budget-s 420]

Runs on a machine with one GPU and JAX (nothing of diffcost is imported, so it runs where only
jax, optax and numpy are installed). Writes, under ``--out``:

* ``kernels.csv``: bf16 GEMMs ``x @ w.T`` (``TN``), fused causal attention forward and
  backward (``jax.nn.dot_product_attention``, cuDNN where the platform has it) and elementwise
  memory-bound kernels, in the SimuMax kernel-table format (``shared/data/README.md`` section
  3b; ``calibration.simumax`` reads it): ``efficiency`` against the cluster's dense bf16 peak
  (``--peak-tflops``) or, for memory rows, against ``--hbm-GBps`` counted in GiB/s as SimuMax
  counts it. ``load`` is ``sustained``: the kernels run back to back, and a GPU at its power
  limit settles at its training-step clock within a second of load
  (``benchmarks/results/h200/overlap/clocks.csv``). Attention FLOPs follow SimuMax's
  full-square count; the backward time is the forward-plus-backward program's time minus the
  forward's.
* ``e2e.csv``: GPT training steps (pre-LayerNorm, GELU MLP of 4 x hidden, tied embeddings,
  fp32 master weights and AdamW state, bf16 matrix products, layers under ``lax.scan``), in
  the ``calibration.csv`` format with ``measured_peak_mem_gib`` added (``--e2e-set`` picks one
  of ``e2e_sets()``): XLA's buffer assignment of the compiled step (arguments + outputs +
  temporaries - aliased), which is what the program allocates on the device beside the
  allocator's own slack.
* ``meta.json``: device, software versions, the command line, the date.

``--only attention --attn-set long``: the attention rows alone, at 16,384 to 131,072 tokens
(``ATTN_LONG_SHAPES``) instead of 1,024 to 8,192 (``ATTN_SHAPES``).

Times are the median of three batches of back-to-back calls after warm-up, each batch at least
``MIN_BATCH_S`` long. A kernel shorter than the host's time to dispatch one call would read the
dispatch: the run first times a trivial call (``dispatch_s`` in ``meta.json``) and leaves out
every kernel row under ``DISPATCH_MARGIN`` times it. A configuration that fails (out of memory,
unsupported shape) is skipped; both are listed under ``failures`` in ``meta.json``. Once
``--budget-s`` has passed, the remaining configurations are skipped so that the files come
back.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import json
import os
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax

MIN_BATCH_S = 0.05
DISPATCH_MARGIN = 2.0
KERNEL_COLUMNS = (
    "source,gpu,cluster,op,batch,groups,m,n,k,layout,accumulate,dtype,out_dtype,stage,seq_len,"
    "heads,kv_heads,qk_head_dim,v_head_dim,qkv_contiguous,peak_tflops,efficiency,tflops,"
    "bandwidth_GBps,derived_fields,notes,source_ref,load"
).split(",")
E2E_COLUMNS = (
    "source,model,n_layers,hidden,ffn_hidden,heads,kv_heads,seq_len,vocab,n_gpus,gpus_per_node,"
    "cluster,precision,framework,tp,pp,dp,cp,ep,sp,zero,recompute,microbatch,global_batch,"
    "interleave_chunks,measured_iter_s,measured_tflops_per_gpu,measured_peak_mem_gib,"
    "peer_name,peer_predicted_iter_s,derived_fields,notes,source_ref"
).split(",")
SOURCE = "diffcost_gpu_measure"
REF = "diffcost benchmarks/gpu_measure.py"

# (tokens, hidden) pairs give the four GEMMs of a transformer layer: QKV, attention output,
# MLP up and down; every product is >= 8.6 GFLOP.
GEMM_TOKENS = (8192, 16384, 32768)
GEMM_HIDDEN = (1024, 2048, 4096, 8192)
# (seq, heads, kv_heads, head_dim); batch * seq = ATTN_TOKENS.
ATTN_SHAPES = tuple(
    (s, h, kv, d)
    for s in (1024, 2048, 4096, 8192)
    for (h, kv, d) in ((16, 16, 64), (16, 16, 128), (32, 32, 128), (64, 8, 128))
)
ATTN_TOKENS = 32768
# ``--attn-set long``: grouped heads per GPU as Llama 3 70B's at tp 8, 4 and 1, and ungrouped ones
# (SimuMax's B200 table peaks at 32,768 tokens for the former, falls at 131,072 for the latter).
ATTN_LONG_SHAPES = tuple(
    (s, h, kv, d)
    for s in (16384, 32768, 65536, 131072)
    for (h, kv, d) in ((8, 1, 128), (16, 2, 128), (64, 8, 128), (32, 32, 128))
)
MEM_BYTES = (1 << 26, 1 << 28, 1 << 30)
# (name, layers, hidden, heads, seq, microbatch, recompute)
E2E_CONFIGS = (
    ("GPT-h1024-L24", 24, 1024, 16, 2048, 4, "none"),
    ("GPT-h1024-L24", 24, 1024, 16, 2048, 16, "none"),
    ("GPT-h1024-L24", 24, 1024, 16, 4096, 4, "none"),
    ("GPT-h2048-L24", 24, 2048, 16, 2048, 2, "none"),
    ("GPT-h2048-L24", 24, 2048, 16, 2048, 8, "none"),
    ("GPT-h2048-L24", 24, 2048, 16, 2048, 8, "full"),
    ("GPT-h2560-L32", 32, 2560, 32, 2048, 2, "none"),
    ("GPT-h4096-L12", 12, 4096, 32, 2048, 2, "none"),
)
# A second set (``--e2e-set more``): other shapes, sequence lengths and recompute.
E2E_MORE = (
    ("GPT-h512-L8", 8, 512, 8, 1024, 32, "none"),
    ("GPT-h768-L12", 12, 768, 12, 1024, 16, "none"),
    ("GPT-h1024-L24", 24, 1024, 16, 2048, 8, "none"),
    ("GPT-h1024-L24", 24, 1024, 16, 8192, 1, "none"),
    ("GPT-h1536-L24", 24, 1536, 16, 2048, 4, "none"),
    ("GPT-h2048-L24", 24, 2048, 16, 2048, 4, "none"),
    ("GPT-h2048-L24", 24, 2048, 16, 4096, 2, "none"),
    ("GPT-h2048-L24", 24, 2048, 16, 2048, 16, "full"),
    ("GPT-h2560-L32", 32, 2560, 32, 2048, 4, "full"),
    ("GPT-h3072-L16", 16, 3072, 24, 2048, 2, "none"),
    ("GPT-h4096-L12", 12, 4096, 32, 2048, 4, "full"),
)
# A third set (``--e2e-set recompute``): full recompute at the microbatches of runs without.
E2E_RECOMPUTE = (
    ("GPT-h1024-L24", 24, 1024, 16, 2048, 4, "full"),
    ("GPT-h1024-L24", 24, 1024, 16, 2048, 16, "full"),
    ("GPT-h2048-L24", 24, 2048, 16, 2048, 2, "full"),
    ("GPT-h2048-L24", 24, 2048, 16, 2048, 4, "full"),
    ("GPT-h2560-L32", 32, 2560, 32, 2048, 2, "full"),
    ("GPT-h4096-L12", 12, 4096, 32, 2048, 2, "full"),
)


def e2e_sets() -> dict:
    """``--e2e-set`` name -> configs, read when called (tests patch the tuples)."""
    return {"base": E2E_CONFIGS, "more": E2E_MORE, "recompute": E2E_RECOMPUTE}


VOCAB = 51200
QUICK_SCALE = 16  # --quick divides sizes by this (a CPU smoke run)


def timed(fn, *args) -> float:
    """Median seconds of one call of ``fn(*args)`` (compiled, warmed up)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = max(time.perf_counter() - t0, 1e-6)
    n = max(2, min(500, int(MIN_BATCH_S / once)))
    batches = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        batches.append((time.perf_counter() - t0) / n)
    return float(np.median(batches))


class Run:
    """Budget, failure log and the platform facts every row repeats."""

    def __init__(self, args):
        self.args = args
        self.start = time.perf_counter()
        self.failures: list[str] = []
        self.skipped = 0
        dev = jax.devices()[0]
        self.gpu = args.gpu or getattr(dev, "device_kind", dev.platform)
        self.impl = "cudnn" if dev.platform == "gpu" else None

        tiny = jnp.ones((4,), jnp.float32)
        self.dispatch_s = timed(jax.jit(lambda x: x + 1), tiny)

    def long_enough(self, what: str, t: float) -> bool:
        """Whether a kernel of ``t`` seconds is timed, not the dispatch (else logged)."""
        if t >= DISPATCH_MARGIN * self.dispatch_s:
            return True
        self.failures.append(f"{what}: {t * 1e6:.1f} us, under {DISPATCH_MARGIN} x dispatch")
        return False

    def over_budget(self) -> bool:
        return time.perf_counter() - self.start > self.args.budget_s

    def attempt(self, what: str, fn):
        if self.over_budget():
            self.skipped += 1
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - any failure of one shape is logged and skipped
            self.failures.append(f"{what}: {type(e).__name__}: {e}".splitlines()[0][:400])
            traceback.print_exc(limit=2)
            return None


def _kernel_row(run, **kw) -> dict:
    row = dict.fromkeys(KERNEL_COLUMNS, "")
    row.update(source=SOURCE, gpu=run.gpu, cluster=run.args.cluster, dtype="bf16")
    row.update(source_ref=REF, load="sustained", **kw)
    return row


def gemm_rows(run, scale: int):
    peak = run.args.peak_tflops
    key = jax.random.PRNGKey(0)
    f = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.bfloat16))
    for m in GEMM_TOKENS:
        for h in GEMM_HIDDEN:
            for n, k in ((3 * h, h), (h, h), (4 * h, h), (h, 4 * h)):
                m_, n_, k_ = m // scale, n // scale, k // scale

                def one(m_=m_, n_=n_, k_=k_):
                    x = jax.random.normal(key, (m_, k_), jnp.bfloat16)
                    w = jax.random.normal(key, (n_, k_), jnp.bfloat16)
                    t = timed(f, x, w)
                    if not run.long_enough(f"gemm m={m_} n={n_} k={k_}", t):
                        return None
                    tf = 2.0 * m_ * n_ * k_ / t / 1e12
                    return _kernel_row(
                        run,
                        op="gemm",
                        batch=1,
                        m=m_,
                        n=n_,
                        k=k_,
                        layout="TN",
                        accumulate=False,
                        out_dtype="bf16",
                        peak_tflops=peak,
                        efficiency=tf / peak,
                        tflops=round(tf, 3),
                        derived_fields="efficiency (= tflops / peak_tflops)",
                        notes=f"jnp.dot(x[m,k], w[n,k].T) under jax.jit; {t * 1e6:.1f} us",
                    )

                row = run.attempt(f"gemm m={m_} n={n_} k={k_}", one)
                if row:
                    yield row


def attention_rows(run, scale: int):
    """Fused causal attention rows (forward and backward) of ``--attn-set``'s shapes."""
    peak = run.args.peak_tflops
    key = jax.random.PRNGKey(1)
    impl = run.impl

    def attn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

    fwd = jax.jit(attn)
    both = jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))
    for s, h, kv, d in ATTN_LONG_SHAPES if run.args.attn_set == "long" else ATTN_SHAPES:
        s_ = max(64, s // scale)
        b = max(1, ATTN_TOKENS // scale // s_)

        def one(s_=s_, h=h, kv=kv, d=d, b=b):
            q = jax.random.normal(key, (b, s_, h, d), jnp.bfloat16)
            kk = jax.random.normal(key, (b, s_, kv, d), jnp.bfloat16)
            v = jax.random.normal(key, (b, s_, kv, d), jnp.bfloat16)
            t_f = timed(fwd, q, kk, v)
            t_fb = timed(both, q, kk, v, q)
            what = f"attention s={s_} h={h} kv={kv} d={d}"
            if not (run.long_enough(what, t_f) and run.long_enough(what + " bwd", t_fb - t_f)):
                return None
            out = []
            for stage, t, mult in (("fwd", t_f, 2.0), ("bwd", t_fb - t_f, 5.0)):
                flops = mult * b * s_**2 * max(h, kv) * (d + d)
                tf = flops / t / 1e12
                out.append(
                    _kernel_row(
                        run,
                        op=f"attention_{stage}",
                        batch=b,
                        seq_len=s_,
                        heads=h,
                        kv_heads=kv,
                        qk_head_dim=d,
                        v_head_dim=d,
                        qkv_contiguous=False,
                        peak_tflops=peak,
                        efficiency=tf / peak,
                        tflops=round(tf, 3),
                        derived_fields="efficiency (= tflops / peak_tflops); tflops from "
                        "SimuMax's full-square FLOP count"
                        + ("; bwd time = (fwd + bwd program) - fwd" if stage == "bwd" else ""),
                        notes=f"jax.nn.dot_product_attention(is_causal=True, "
                        f"implementation={impl!r}); {t * 1e6:.1f} us",
                    )
                )
            return out

        rows = run.attempt(f"attention s={s_} h={h} kv={kv} d={d}", one)
        yield from rows or []


def memory_rows(run, scale: int):
    bw = run.args.hbm_GBps
    ops = {
        "x + 1 (1 read, 1 write)": (jax.jit(lambda x, y: x + 1), 2),
        "x + y (2 reads, 1 write)": (jax.jit(lambda x, y: x + y), 3),
    }
    for nbytes in MEM_BYTES:
        for name, (f, passes) in ops.items():

            def one(nbytes=nbytes // scale, f=f, passes=passes, name=name):
                x = jnp.ones((nbytes // 2,), jnp.bfloat16)
                t = timed(f, x, jnp.full_like(x, 2))
                if not run.long_enough(f"memory {name} {nbytes}", t):
                    return None
                rate = passes * nbytes / t
                return _kernel_row(
                    run,
                    op="memory_default",
                    bandwidth_GBps=bw,
                    efficiency=rate / (bw * 2**30),
                    derived_fields="efficiency (= bytes moved / time / (bandwidth_GBps * 2^30))",
                    notes=f"elementwise bf16 {name} over {nbytes} B per operand; "
                    f"{t * 1e6:.1f} us, {rate / 1e9:.0f} GB/s",
                )

            row = run.attempt(f"memory {name} {nbytes}", one)
            if row:
                yield row


def gpt_init(key, layers, hidden, seq, vocab):
    ks = jax.random.split(key, 6)

    def w(k, *shape):
        return jax.random.normal(k, shape, jnp.float32) * 0.02

    def zeros(*shape):
        return jnp.zeros(shape, jnp.float32)

    h, f = hidden, 4 * hidden
    return {
        "wte": w(ks[0], vocab, h),
        "wpe": w(ks[1], seq, h),
        "lnf": (jnp.ones(h, jnp.float32), zeros(h)),
        "layers": {
            "ln1": (jnp.ones((layers, h), jnp.float32), zeros(layers, h)),
            "ln2": (jnp.ones((layers, h), jnp.float32), zeros(layers, h)),
            "qkv": (w(ks[2], layers, h, 3 * h), zeros(layers, 3 * h)),
            "proj": (w(ks[3], layers, h, h), zeros(layers, h)),
            "fc1": (w(ks[4], layers, h, f), zeros(layers, f)),
            "fc2": (w(ks[5], layers, f, h), zeros(layers, h)),
        },
    }


def _ln(x, g, b):
    x32 = x.astype(jnp.float32)
    mu = x32.mean(-1, keepdims=True)
    var = ((x32 - mu) ** 2).mean(-1, keepdims=True)
    return ((x32 - mu) * jax.lax.rsqrt(var + 1e-5) * g + b).astype(jnp.bfloat16)


def _dense(x, wb):
    w, b = wb
    return x @ w.astype(jnp.bfloat16) + b.astype(jnp.bfloat16)


# What the backward pass of a layer keeps (``gpt_loss``'s ``recompute``): everything (none),
# only its input, the whole layer recomputed (full), or the matrix products' outputs, the rest
# recomputed (dots: ``jax.checkpoint_policies.dots_saveable``).
RECOMPUTE_POLICIES = {"full": None, "dots": jax.checkpoint_policies.dots_saveable}


def gpt_loss(params, tokens, heads, impl, recompute, unroll=False):
    """Mean next-token loss; ``recompute`` one of "none" and ``RECOMPUTE_POLICIES``; the layers
    under ``lax.scan``, or one after another in Python with ``unroll``."""
    bf = jnp.bfloat16
    b, s = tokens.shape
    x = (params["wte"][tokens] + params["wpe"][:s]).astype(bf)

    def layer(x, p):
        h = x.shape[-1]
        qkv = _dense(_ln(x, *p["ln1"]), p["qkv"]).reshape(b, s, 3, heads, h // heads)
        a = jax.nn.dot_product_attention(
            qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True, implementation=impl
        )
        x = x + _dense(a.reshape(b, s, h), p["proj"])
        y = jax.nn.gelu(_dense(_ln(x, *p["ln2"]), p["fc1"]))
        return x + _dense(y, p["fc2"]), None

    if recompute != "none":
        layer = jax.checkpoint(layer, policy=RECOMPUTE_POLICIES[recompute])
    if unroll:
        n = jax.tree_util.tree_leaves(params["layers"])[0].shape[0]
        for i in range(n):
            x, _ = layer(x, jax.tree_util.tree_map(lambda w, i=i: w[i], params["layers"]))
    else:
        x, _ = jax.lax.scan(layer, x, params["layers"])
    logits = (_ln(x, *params["lnf"]) @ params["wte"].astype(bf).T).astype(jnp.float32)
    labels = jnp.roll(tokens, -1, axis=1)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _model_flops(layers, h, s, vocab, tokens):
    """Megatron's model FLOPs of one iteration without recompute (Narayanan et al. 2021)."""
    return 72.0 * tokens * layers * h * h * (1 + s / (6 * h) + vocab / (12 * h * layers))


def compile_step(layers, h, s, vocab, mb, heads, impl, recompute, unroll=False):
    """(the compiled AdamW training step of one GPT configuration, its parameters, optimizer
    state and tokens): ``step(params, state, tokens) -> (params, state, loss)``, the first two
    donated."""
    params = gpt_init(jax.random.PRNGKey(2), layers, h, s, vocab)
    opt = optax.adamw(1e-4)
    state = opt.init(params)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (mb, s), 0, vocab)
    loss = functools.partial(gpt_loss, heads=heads, impl=impl, recompute=recompute, unroll=unroll)

    def step(params, state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, tokens).compile()
    return compiled, params, state, tokens


def assigned_bytes(compiled) -> int | None:
    """XLA's buffer assignment of a compiled program: arguments + outputs + temporaries -
    aliased (None where the backend does not say)."""
    mem = compiled.memory_analysis()
    if mem is None:
        return None
    return (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes
    )


def step_times(compiled, params, state, tokens, steps: int):
    """(every timed step's seconds, params, state) of ``steps`` calls of a ``compile_step``
    program after 3 warm-up calls.

    Raises:
        FloatingPointError: the loss is not finite.
    """
    for _ in range(3):
        params, state, value = compiled(params, state, tokens)
    jax.block_until_ready(value)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        params, state, value = compiled(params, state, tokens)
        jax.block_until_ready(value)
        times.append(time.perf_counter() - t0)
    if not np.isfinite(float(value)):
        raise FloatingPointError(f"loss {float(value)}")
    return times, params, state


def _train_step_times(run, layers, h, s, vocab, mb, heads, recompute):
    """(median step seconds, every timed step's seconds, XLA's assigned peak bytes or None) of
    one GPT configuration: 3 warm-up steps, then ``--steps`` timed ones."""
    compiled, params, state, tokens = compile_step(
        layers, h, s, vocab, mb, heads, run.impl, recompute
    )
    times, _, _ = step_times(compiled, params, state, tokens, run.args.steps)
    return float(np.median(times)), times, assigned_bytes(compiled)


def _e2e_row(run, model, layers, h, s, vocab, mb, heads, recompute, measured) -> dict:
    """One ``e2e.csv`` row of a configuration and its ``_train_step_times``."""
    t, times, peak = measured
    row = dict.fromkeys(E2E_COLUMNS, "")
    row.update(
        source=SOURCE,
        model=model,
        n_layers=layers,
        hidden=h,
        ffn_hidden=4 * h,
        heads=heads,
        kv_heads=heads,
        seq_len=s,
        vocab=vocab,
        n_gpus=1,
        gpus_per_node=1,
        cluster=run.args.cluster,
        precision="bf16",
        framework="JAX (XLA; fp32 master weights, optax AdamW)",
        **dict.fromkeys(("tp", "pp", "dp", "cp", "ep", "interleave_chunks"), 1),
        sp=0,
        zero=0,
        recompute=recompute,
        microbatch=mb,
        global_batch=mb,
        measured_iter_s=t,
        measured_tflops_per_gpu=_model_flops(layers, h, s, vocab, mb * s) / t / 1e12,
        measured_peak_mem_gib="" if peak is None else peak / 2**30,
        derived_fields="measured_tflops_per_gpu (Megatron's 72-FLOP formula / time); "
        "measured_peak_mem_gib (XLA buffer assignment: arguments + outputs + "
        "temporaries - aliased)",
        notes=f"{run.gpu}; one GPU; median of {run.args.steps} steps after 3 warm-up; "
        f"step times {min(times):.4f}-{max(times):.4f} s; pre-LN GPT, GELU, tied "
        f"embeddings, layers under lax.scan, attention implementation={run.impl!r}",
        source_ref=REF,
    )
    return row


def e2e_rows(run, scale: int):
    """``e2e.csv`` rows of the ``--e2e-set`` configurations after the first
    ``--skip-configs``."""
    configs = e2e_sets()[run.args.e2e_set][run.args.skip_configs :]
    for name, layers, hidden, heads, seq, mb, recompute in configs:
        h, s = hidden // scale, max(64, seq // scale)
        layers_ = max(2, layers // scale)
        vocab = VOCAB // scale
        model = name if scale == 1 else f"{name}/{scale}"
        config = (layers_, h, s, vocab, mb, heads, recompute)

        def one(config=config, model=model):
            return _e2e_row(run, model, *config, _train_step_times(run, *config))

        row = run.attempt(f"e2e {name} s={s} mb={mb} {recompute}", one)
        if row:
            print(
                f"e2e {row['model']} s={s} mb={mb} {recompute}: {row['measured_iter_s']:.4f} s",
                flush=True,
            )
            yield row


def write_csv(path, columns, rows) -> int:
    n = 0
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, columns)
        w.writeheader()
        for r in rows:
            w.writerow(r)
            fh.flush()
            n += 1
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the CSV files")
    p.add_argument("--cluster", default="generic-h100", help="cluster column of every row")
    p.add_argument("--gpu", default=None, help="gpu column (default: JAX's device kind)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak")
    p.add_argument("--hbm-GBps", type=float, default=3350.0, help="nominal HBM bandwidth")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip what starts later")
    p.add_argument("--steps", type=int, default=10, help="timed training steps per config")
    p.add_argument("--only", default="kernels,e2e", help="list of kernels, attention, e2e")
    p.add_argument("--attn-set", choices=("base", "long"), default="base", help="attention shapes")
    p.add_argument("--e2e-set", choices=tuple(e2e_sets()), default="base", help="e2e configs")
    p.add_argument("--skip-configs", type=int, default=0, help="leave out the set's first N")
    p.add_argument("--quick", action="store_true", help="sizes / 16: a CPU smoke run")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    run = Run(args)
    scale = QUICK_SCALE if args.quick else 1
    counts = {}
    only = args.only.split(",")
    if "kernels" in only or "attention" in only:

        def kernels():
            yield from gemm_rows(run, scale) if "kernels" in only else ()
            yield from attention_rows(run, scale)
            yield from memory_rows(run, scale) if "kernels" in only else ()

        counts["kernels"] = write_csv(
            os.path.join(args.out, "kernels.csv"), KERNEL_COLUMNS, kernels()
        )
        print(f"kernels: {counts['kernels']} rows at {time.perf_counter() - run.start:.0f} s")
    if "e2e" in only:
        counts["e2e"] = write_csv(
            os.path.join(args.out, "e2e.csv"), E2E_COLUMNS, e2e_rows(run, scale)
        )
    write_meta(args.out, run, rows=counts, dispatch_s=run.dispatch_s)
    return 0


def write_meta(out: str, run: Run, **facts) -> dict:
    """Write and print ``out/meta.json``: the command, date, device and software, ``facts``,
    what was skipped or failed and the elapsed time."""
    meta = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(jax.devices()[0]),
        "device_kind": run.gpu,
        "jax": jax.__version__,
        "optax": optax.__version__,
        "python": platform.python_version(),
        **facts,
        "skipped_over_budget": run.skipped,
        "failures": run.failures,
        "elapsed_s": round(time.perf_counter() - run.start, 1),
    }
    with open(os.path.join(out, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=1)
    print(json.dumps(meta, indent=1))
    return meta


if __name__ == "__main__":
    sys.exit(main())
