"""Shared builders for tests: small hand-made specs (no config files needed)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import jax.numpy as jnp

from diffcost.arrays import cluster_arrays, model_arrays, plan_arrays
from diffcost.specs import ClusterSpec, GpuSpec, ModelSpec, MoeSpec, PlanSpec

# The shared measurements (../shared/data of the workspace); tests that read them skip without.
SHARED_DATA = Path("/work/shared/data")

A100 = GpuSpec(
    name="A100-80G",
    peak_tflops={"fp32": 19.5, "bf16": 312.0, "fp16": 312.0},
    hbm_bandwidth_GBps=2039.0,
    memory_GiB=80.0,
)
CLUSTER = ClusterSpec(
    name="test-a100",
    gpu=A100,
    gpus_per_node=8,
    nvlink_GBps=600.0,
    nvlink_latency_us=3.0,
    nics_per_node=8,
    nic_Gbps=200.0,
    nic_latency_us=5.0,
)
GPT = ModelSpec(
    name="gpt-1.3b",
    n_layers=24,
    hidden=2048,
    ffn_hidden=8192,
    heads=16,
    kv_heads=16,
    seq_len=2048,
    vocab=50257,
)
LLAMA = ModelSpec(
    name="llama-small",
    n_layers=16,
    hidden=2048,
    ffn_hidden=5632,
    heads=16,
    kv_heads=4,
    seq_len=4096,
    vocab=32000,
    mlp="swiglu",
    norm="rmsnorm",
    tied_embeddings=False,
    bias=False,
)
MOE = ModelSpec(
    name="moe-small",
    n_layers=8,
    hidden=1024,
    ffn_hidden=3584,
    heads=16,
    kv_heads=8,
    seq_len=2048,
    vocab=32000,
    mlp="swiglu",
    norm="rmsnorm",
    tied_embeddings=False,
    bias=False,
    moe=MoeSpec(experts=8, top_k=2, capacity_factor=1.25),
)
PLANS = {
    "single": PlanSpec(microbatch=2, global_batch=8),
    "dp8": PlanSpec(dp=8, microbatch=2, global_batch=64, overlap_dp=True),
    "tp4pp2": PlanSpec(
        tp=4,
        pp=2,
        dp=2,
        sequence_parallel=True,
        microbatch=1,
        global_batch=16,
        recompute="selective",
    ),
    "3d-interleaved": PlanSpec(
        tp=2,
        pp=4,
        dp=4,
        sequence_parallel=True,
        zero=1,
        microbatch=1,
        global_batch=64,
        schedule="interleaved",
        chunks=2,
    ),
    "fsdp": PlanSpec(dp=16, zero=3, microbatch=2, global_batch=64, recompute="full"),
    "gpipe": PlanSpec(pp=4, dp=2, microbatch=2, global_batch=32, schedule="gpipe"),
    "cp2": PlanSpec(tp=2, cp=2, dp=2, sequence_parallel=True, microbatch=1, global_batch=8),
}


def arrays(model=GPT, plan=None, cluster=CLUSTER, dtype=jnp.float64):
    plan = PLANS["tp4pp2"] if plan is None else plan
    return (
        model_arrays(model, dtype),
        plan_arrays(plan, dtype),
        cluster_arrays(cluster, dtype),
    )


def write(path: Path, text: str) -> Path:
    """Write ``text``, dedented, to ``path`` (making its folder); return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path
