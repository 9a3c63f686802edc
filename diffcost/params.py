"""Every constant the model is calibrated on, in one pytree, reparametrized to stay valid.

Leaves are unconstrained raw values (log for positive quantities, logit for fractions); the
properties return the constrained values the cost model uses. Defaults come from datasheets
and common practice, not from fitting; ``calibration/`` fits them to measurements.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from diffcost.specs import PRECISIONS

# The GEMM shape grid: one node per octave of each GEMM dimension (m, n, k), from 128 to 16384;
# shapes outside are clamped to the edge nodes.
GEMM_GRID_LOG2_LO = 7
GEMM_GRID = 8
# One grid per precision class: cuBLAS picks different kernels (tiles, pipelines) for 16-bit and
# for FP8/FP4 operands, so a shape that is slow in one need not be in the other. "high" holds
# fp32, bf16 and fp16 GEMMs, "low" FP8 and FP4 ones (``workload.low_precision``).
GEMM_GRID_CLASSES = ("high", "low")
# The layer shape grid: a time factor of one transformer layer (all its kernels, communication
# and host dispatch) over the layer's shape on one GPU, with one node per octave of the tokens
# of a microbatch (512 to 65536), of the width hidden / tp (128 to 16384) and of tp (1 to 8);
# shapes outside are clamped to the edge nodes. Measured layer times are jagged in that shape
# where no work-based term is (host dispatch, kernel and NCCL algorithm choices all change
# with it): profiling simulators such as vTrain time every layer shape on the GPU, and this
# grid is the calibrated counterpart. It is 1 everywhere until runs of a shape move its nodes.
LAYER_GRID = (8, 8, 4)
LAYER_GRID_LOG2_LO = (9, 7, 0)
# The LM head shape grid: a time factor of the LM head and loss (its GEMMs, cross-entropy passes
# and their all-reduces) over the head's shape on one GPU, one node per octave of the tokens of a
# microbatch (512 to 65536), of the hidden size (128 to 16384) and of tp (1 to 8; the head's
# vocabulary is split tp ways). The head is one GEMM with a vocabulary-sized dimension, far
# outside the shapes the layers share the GEMM grid with (that grid's nodes stop at 16384), and
# measured heads are jagged in its shape (vTrain: tp 1 heads 1.7-3x the work-based time, tp 2
# ones close to it). 1 everywhere until runs of a shape move its nodes.
HEAD_GRID = (8, 8, 4)
HEAD_GRID_LOG2_LO = (9, 7, 0)


def _logit(p):
    p = jnp.asarray(p, dtype=float)
    return jnp.log(p) - jnp.log1p(-p)


@struct.dataclass
class Params:
    """Calibratable constants (raw, unconstrained leaves).

    Efficiencies are fractions of a datasheet peak; latencies and overheads are seconds.
    ``gemm_eff`` has one entry per precision in ``diffcost.specs.PRECISIONS`` order;
    ``gemm_shape_log_eff`` holds, per class of ``GEMM_GRID_CLASSES``, a ``GEMM_GRID``-cubed grid
    over (m, n, k) octaves (all 0: factor 1); ``layer_shape_log_time`` a ``LAYER_GRID`` grid of
    log time factors over a layer's (tokens, width, tp) octaves (all 0: factor 1), which
    ``cluster_layer_log_time`` (a cluster's own, same shape) adds to, and ``head_shape_log_time``
    a ``HEAD_GRID`` one over the LM head's (tokens, hidden, tp) octaves.
    """

    gemm_eff_logit: jax.Array  # [n_precisions] large-GEMM fraction of peak FLOP/s
    gemm_dim_half_log: jax.Array  # GEMM dimension at which that dimension halves efficiency
    attn_eff_logit: jax.Array  # fused (cuDNN) attention efficiency relative to 16-bit peak
    attn_flash_log_odds: jax.Array  # odds ratio of FlashAttention-2's efficiency to it
    mem_eff_logit: jax.Array  # fraction of HBM bandwidth reached by memory-bound kernels
    kernel_overhead_log_s: jax.Array  # GPU-side gap per kernel launch
    host_op_log_s: jax.Array  # CPU time to dispatch one framework op (eager Python + autograd)
    host_overlap_logit: jax.Array  # fraction of host dispatch hidden under GPU work (1: max)
    nvlink_eff_logit: jax.Array  # fraction of NVLink bandwidth reached by collectives
    nic_eff_logit: jax.Array  # fraction of NIC bandwidth reached by collectives
    nvlink_latency_log_scale: jax.Array  # multiplier on the cluster's NVLink latency
    nic_latency_log_scale: jax.Array  # multiplier on the cluster's NIC latency
    half_bw_log_bytes: jax.Array  # message size reaching half the link bandwidth
    collective_overhead_log_s: jax.Array  # fixed cost of one collective call (launch, sync)
    reduce_log_Bps: jax.Array  # rate of a reducing collective's pass over its whole buffer
    interference_log: jax.Array  # slowdown of compute and comm while they overlap
    optimizer_log_bytes_per_param: jax.Array  # HBM traffic of the optimizer step per parameter
    iteration_overhead_log_s: jax.Array  # fixed per-iteration cost (data, logging, sync)
    microbatch_overhead_log_s: jax.Array  # host time per microbatch on every stage (schedule)
    gemm_shape_log_eff: jax.Array  # [C, G, G, G] log efficiency per precision class and octave node
    layer_shape_log_time: jax.Array  # [T, W, P] log time factor of a layer per octave node
    cluster_layer_log_time: jax.Array  # [T, W, P] the cluster's own factor on top of it
    head_shape_log_time: jax.Array  # [T, H, P] log time factor of the LM head per octave node

    @property
    def gemm_eff(self):
        return jax.nn.sigmoid(self.gemm_eff_logit)

    @property
    def gemm_dim_half(self):
        return jnp.exp(self.gemm_dim_half_log)

    @property
    def attn_eff(self):
        return jax.nn.sigmoid(self.attn_eff_logit)

    @property
    def attn_flash_odds(self):
        return jnp.exp(self.attn_flash_log_odds)

    def attention_eff(self, flash2):
        """Attention kernel efficiency: the fused (cuDNN) kernel's ``attn_eff``, or for
        ``flash2`` = 1 FlashAttention-2's, whose odds are ``attn_flash_odds`` times those."""
        return jax.nn.sigmoid(self.attn_eff_logit + flash2 * self.attn_flash_log_odds)

    @property
    def mem_eff(self):
        return jax.nn.sigmoid(self.mem_eff_logit)

    @property
    def kernel_overhead_s(self):
        return jnp.exp(self.kernel_overhead_log_s)

    @property
    def host_op_s(self):
        return jnp.exp(self.host_op_log_s)

    @property
    def host_overlap(self):
        return jax.nn.sigmoid(self.host_overlap_logit)

    @property
    def nvlink_eff(self):
        return jax.nn.sigmoid(self.nvlink_eff_logit)

    @property
    def nic_eff(self):
        return jax.nn.sigmoid(self.nic_eff_logit)

    @property
    def nvlink_latency_scale(self):
        return jnp.exp(self.nvlink_latency_log_scale)

    @property
    def nic_latency_scale(self):
        return jnp.exp(self.nic_latency_log_scale)

    @property
    def half_bw_bytes(self):
        return jnp.exp(self.half_bw_log_bytes)

    @property
    def collective_overhead_s(self):
        return jnp.exp(self.collective_overhead_log_s)

    @property
    def reduce_Bps(self):
        return jnp.exp(self.reduce_log_Bps)

    @property
    def interference(self):
        return jnp.exp(self.interference_log)

    @property
    def optimizer_bytes_per_param(self):
        return jnp.exp(self.optimizer_log_bytes_per_param)

    @property
    def iteration_overhead_s(self):
        return jnp.exp(self.iteration_overhead_log_s)

    @property
    def microbatch_overhead_s(self):
        return jnp.exp(self.microbatch_overhead_log_s)


# Datasheet-style defaults, constrained values. Sources: NVIDIA's published large-GEMM
# throughput (~75-85% of dense peak for bf16 on A100/H100), nccl-tests bus bandwidth on
# DGX systems (~80% of NVLink per-direction peak), Adam in mixed precision (fp32 master
# weights, two moments, fp32 gradients, 16-bit copy: ~ 28 B of HBM traffic per parameter);
# a reducing collective's pass over its buffer runs on a few SMs at ~1 TB/s (order of
# magnitude: the A100 all-reduce tables fit ~0.5 TB/s); PyTorch eager dispatch costs ~10 us of
# CPU per op with autograd, so small layers are bound by the host, not the GPU.
DEFAULTS = {
    "gemm_eff": {"fp32": 0.80, "bf16": 0.80, "fp16": 0.80, "fp8": 0.65, "fp4": 0.55},
    "gemm_dim_half": 48.0,
    "attn_eff": 0.70,
    "attn_flash_odds": 1.0,
    "mem_eff": 0.80,
    "kernel_overhead_s": 4e-6,
    "host_op_s": 15e-6,
    "host_overlap": 0.95,
    "nvlink_eff": 0.80,
    "nic_eff": 0.85,
    "nvlink_latency_scale": 1.0,
    "nic_latency_scale": 1.0,
    "half_bw_bytes": 1.0 * 2**20,
    "collective_overhead_s": 10e-6,
    "reduce_Bps": 1e12,
    "interference": 0.05,
    "optimizer_bytes_per_param": 28.0,
    "iteration_overhead_s": 5e-3,
    "microbatch_overhead_s": 1e-3,
}


def default_params(dtype=None) -> Params:
    """Params at their datasheet defaults (``dtype`` defaults to JAX's default float).

    Leaves are strongly typed: a weakly typed leaf would turn strong after one optimizer step,
    and a jit-compiled step would then compile a second time.
    """
    d = DEFAULTS
    dtype = jnp.result_type(float) if dtype is None else dtype
    f = lambda v: jnp.asarray(v, dtype=dtype)  # noqa: E731
    return Params(
        gemm_eff_logit=f(_logit(jnp.array([d["gemm_eff"][p] for p in PRECISIONS]))),
        gemm_dim_half_log=f(jnp.log(d["gemm_dim_half"])),
        attn_eff_logit=f(_logit(d["attn_eff"])),
        attn_flash_log_odds=f(jnp.log(d["attn_flash_odds"])),
        mem_eff_logit=f(_logit(d["mem_eff"])),
        kernel_overhead_log_s=f(jnp.log(d["kernel_overhead_s"])),
        host_op_log_s=f(jnp.log(d["host_op_s"])),
        host_overlap_logit=f(_logit(d["host_overlap"])),
        nvlink_eff_logit=f(_logit(d["nvlink_eff"])),
        nic_eff_logit=f(_logit(d["nic_eff"])),
        nvlink_latency_log_scale=f(jnp.log(d["nvlink_latency_scale"])),
        nic_latency_log_scale=f(jnp.log(d["nic_latency_scale"])),
        half_bw_log_bytes=f(jnp.log(d["half_bw_bytes"])),
        collective_overhead_log_s=f(jnp.log(d["collective_overhead_s"])),
        reduce_log_Bps=f(jnp.log(d["reduce_Bps"])),
        interference_log=f(jnp.log(d["interference"])),
        optimizer_log_bytes_per_param=f(jnp.log(d["optimizer_bytes_per_param"])),
        iteration_overhead_log_s=f(jnp.log(d["iteration_overhead_s"])),
        microbatch_overhead_log_s=f(jnp.log(d["microbatch_overhead_s"])),
        gemm_shape_log_eff=jnp.zeros((len(GEMM_GRID_CLASSES),) + (GEMM_GRID,) * 3, dtype=dtype),
        layer_shape_log_time=jnp.zeros(LAYER_GRID, dtype=dtype),
        cluster_layer_log_time=jnp.zeros(LAYER_GRID, dtype=dtype),
        head_shape_log_time=jnp.zeros(HEAD_GRID, dtype=dtype),
    )
