"""Time of one kernel on one GPU: a roofline with shape-dependent GEMM efficiency.

``time = smooth_max(flops / (peak * eff), bytes / (hbm * mem_eff)) + launch overhead``.
GEMM efficiency falls for small dimensions as ``d / (d + d_half)`` per dimension (tile and
wave quantization, smoothed), times a large-GEMM efficiency per precision.

References:
    Williams, Waterman & Patterson, "Roofline" (CACM 2009); NVIDIA's GEMM performance guide
    (tile quantization, wave quantization).
"""

from __future__ import annotations

import jax.numpy as jnp

from diffcost import smooth
from diffcost.arrays import ACT_BYTES, ClusterArrays, ModelArrays
from diffcost.params import Params
from diffcost.specs import PRECISIONS

_BF16, _FP16 = PRECISIONS.index("bf16"), PRECISIONS.index("fp16")


def gemm_peak_flops(model: ModelArrays, cluster: ClusterArrays, params: Params):
    """Large-GEMM FLOP/s at the model's precision: peak x efficiency (0 if unsupported)."""
    peak = jnp.sum(model.precision * cluster.peak_flops)
    eff = jnp.sum(model.precision * params.gemm_eff)
    return peak * eff


def half_peak_flops(model: ModelArrays, cluster: ClusterArrays, params: Params):
    """16-bit FLOP/s of the kernels that stay in 16 bits (attention, the FP8 run's LM head).

    A bf16 or fp16 model uses its own type. Beside FP8/FP4 (and fp32) layers that is bf16,
    or fp16 on a GPU without bf16 (V100). Never the faster of the two: an efficiency that no
    measurement pins (fp16 on H100) must not become a free knob on every run's attention.
    """
    bf16 = cluster.peak_flops[_BF16] * params.gemm_eff[_BF16]
    fp16 = cluster.peak_flops[_FP16] * params.gemm_eff[_FP16]
    beside = jnp.where(cluster.peak_flops[_BF16] > 0.0, bf16, fp16)
    w_bf16, w_fp16 = model.precision[_BF16], model.precision[_FP16]
    return w_bf16 * bf16 + w_fp16 * fp16 + (1.0 - w_bf16 - w_fp16) * beside


def memory_bound_s(n_bytes, cluster: ClusterArrays, params: Params):
    """Time of a memory-bound kernel moving ``n_bytes`` through HBM."""
    return n_bytes / (cluster.hbm_Bps * params.mem_eff)


def gemm_s(m, n, k, flops_per_s, cluster: ClusterArrays, params: Params, temperature):
    """Time of GEMMs ``(m x k) @ (k x n)`` (arrays broadcast) at ``flops_per_s`` large-GEMM rate.

    ``2 m n k / (rate * prod(d / (d + d_half)))`` is written as ``2 prod(d + d_half) / rate``
    so it stays finite for a zero dimension; a zero-size GEMM costs nothing.
    """
    c = params.gemm_dim_half
    flops = 2.0 * m * n * k
    present = flops / (flops + 1.0)
    compute = 2.0 * (m + c) * (n + c) * (k + c) / flops_per_s * present
    io = memory_bound_s(ACT_BYTES * (m * k + k * n + m * n), cluster, params)
    return smooth.smax2(compute, io, temperature)
