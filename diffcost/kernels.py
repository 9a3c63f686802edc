"""Time of one kernel on one GPU: a roofline with shape-dependent GEMM efficiency.

``time = smooth_max(flops / (peak * eff), bytes / (hbm * mem_eff)) + launch overhead``.
GEMM efficiency falls for small dimensions as ``d / (d + d_half)`` per dimension (tile and
wave quantization, smoothed), times a large-GEMM efficiency per precision, times a per-shape
factor read from a grid with one node per octave of m, n and k (``shape_log_eff``), one grid per
precision class (16 and 32 bits; FP8 and FP4). The grid is 1 everywhere until calibration moves
it: real libraries pick a kernel per shape and operand type, so measured efficiency is jagged in
shape where the smooth curve is not (a GEMM table, or runs whose layers share a shape, pin the
nodes they touch). ``layer_log_time`` reads the same kind of grid for a whole transformer layer
(``Params.layer_shape_log_time``).

References:
    Williams, Waterman & Patterson, "Roofline" (CACM 2009); NVIDIA's GEMM performance guide
    (tile quantization, wave quantization).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from diffcost import smooth
from diffcost.arrays import ACT_BYTES, ClusterArrays, ModelArrays
from diffcost.params import GEMM_GRID_CLASSES, GEMM_GRID_LOG2_LO, LAYER_GRID_LOG2_LO, Params
from diffcost.specs import PRECISIONS
from diffcost.workload import KERNELS_PER_LAYER_FWD, LayerWork

_BF16, _FP16 = PRECISIONS.index("bf16"), PRECISIONS.index("fp16")
_HIGH, _LOW = GEMM_GRID_CLASSES.index("high"), GEMM_GRID_CLASSES.index("low")

ATTN_BWD_FACTOR_FLASH = 2.5  # fused backward recomputes the scores
ATTN_BWD_FACTOR = 2.0
CAUSAL_FRACTION_FLASH = 0.5  # fused causal kernels skip the masked half
# HBM bytes per logit of Megatron's vocab-parallel cross entropy (memory-bound passes over the
# [tokens, vocab / tp] logits). Forward: cast the 16-bit logits to fp32 (2 + 4), max (4),
# subtract it (4 + 4), exp (4 + 4), sum (4), softmax kept for backward (4 + 4). Backward:
# softmax minus the one-hot target (4 + 4), times the loss gradient (4 + 4), cast to 16 bits
# for the head's backward GEMMs (4 + 2).
LOSS_FWD_BYTES_PER_LOGIT = 34.0
LOSS_BWD_BYTES_PER_LOGIT = 22.0
# Forward and backward multiples of a layer's forward elementwise passes and kernel launches.
_FWD_BWD_PASSES = (1.0, 2.0)


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


def _grid_coord(d, size, log2_lo=GEMM_GRID_LOG2_LO):
    """Cell index and fraction of ``d`` on ``size`` octave nodes from ``2 ** log2_lo`` (clamped).

    ``log2`` of a power of two is snapped to the integer. Compiled, it came out one ulp low
    (2.9999998 for 8), and the compiled interpolation then read other values than the eager
    one for shapes on the nodes (``tests/test_calibration.py``).
    """
    x = jnp.log2(jnp.maximum(d, 1.0))
    x = jnp.where(jnp.abs(x - jnp.round(x)) < 1e-4, jnp.round(x), x)
    x = jnp.clip(x - log2_lo, 0.0, size - 1.0)
    i = jnp.clip(jnp.floor(x), 0.0, size - 2.0)
    return i.astype(jnp.int32), x - i


def _cell_corners(table):
    """The 8 corner values of every grid cell, ``[rows * cells, 8]`` from ``table [..., s0, s1,
    s2]``: cell ``(i (s1 - 1) + j) (s2 - 1) + k`` of row ``r`` is entry ``r * cells + cell``,
    corners ordered ``(di, dj, dk)`` as the weights of ``_interpolate``. Reading a cell is then one
    gather of a contiguous row rather than eight scattered ones (the sweep's hot spot)."""
    s0, s1, s2 = table.shape[-3:]
    corners = [
        table[..., di : di + s0 - 1, dj : dj + s1 - 1, dk : dk + s2 - 1]
        for di in (0, 1)
        for dj in (0, 1)
        for dk in (0, 1)
    ]
    return jnp.stack(corners, axis=-1).reshape(-1, 8)


def _interpolate(table, cm, cn, ck, row=None):
    """Trilinear interpolation of ``table`` at grid coordinates ``(cell index, fraction)`` per
    dimension (``_grid_coord``; arrays of one shape), in row ``row`` of a table with a leading
    axis. One gather of each cell's 8 corners (in range by construction of ``_grid_coord``, so
    without bound checks), then the weighted sum corner by corner: weights stacked on a small
    trailing axis make a batched sweep several times slower."""
    s0, s1, s2 = table.shape[-3:]
    (i, a), (j, b), (q, c) = cm, cn, ck
    cell = (i * (s1 - 1) + j) * (s2 - 1) + q
    if row is not None:
        cell = cell + row.astype(cell.dtype) * ((s0 - 1) * (s1 - 1) * (s2 - 1))
    values = _cell_corners(table).at[cell].get(mode="promise_in_bounds")
    weights = (wi * wj * wl for wi in (1.0 - a, a) for wj in (1.0 - b, b) for wl in (1.0 - c, c))
    out = 0.0
    for corner, weight in enumerate(weights):
        out = out + values[..., corner] * weight
    return out


def _coords(table, m, n, k, row=None):
    dims = [jnp.asarray(v, dtype=table.dtype) for v in (m, n, k)]
    if row is None:
        m, n, k = jnp.broadcast_arrays(*dims)
    else:
        m, n, k, row = jnp.broadcast_arrays(*dims, jnp.asarray(row))
    return [_grid_coord(v, table.shape[-1]) for v in (m, n, k)], row


def shape_log_eff(table, m, n, k, row=None):
    """Trilinear interpolation of ``table`` (log efficiency factors on octave nodes of m, n, k;
    clamped at the edges) at GEMM shapes ``(m, n, k)`` (arrays broadcast). With ``row``, the
    table has a leading axis and each shape reads its own ``table[row]``."""
    (cm, cn, ck), row = _coords(table, m, n, k, row)
    return _interpolate(table, cm, cn, ck, row)


def shape_log_effs(table, m, n, k, row=None):
    """``shape_log_eff`` of GEMMs ``(m, n, k)`` and of their backward GEMMs, dgrad ``(m, k, n)``
    and wgrad ``(k, n, m)``: one set of grid coordinates and one gather (a prediction is many
    small operations on the CPU, so fewer of them is faster). ``row`` as in ``shape_log_eff``."""
    (cm, cn, ck), row = _coords(table, m, n, k, row)
    stack = lambda *cs: tuple(jnp.stack(parts) for parts in zip(*cs))  # noqa: E731
    rows = None if row is None else jnp.stack([row] * 3)
    fwd, dgrad, wgrad = _interpolate(
        table, stack(cm, cm, ck), stack(cn, ck, cn), stack(ck, cn, cm), rows
    )
    return fwd, dgrad, wgrad


def layer_and_head_log_effs(table, low, m, n, k, head, base=None):
    """``shape_log_effs`` of a layer's GEMMs ``(m, n, k)`` (arrays) and, last entry, of the LM
    head ``head = (m, n, k)``: the layers read the grid of their class (blended by ``low``: 1
    FP8/FP4, 0 16 bits, in between when relaxed), the head the 16-bit grid (it stays in 16 bits).

    ``table`` is ``Params.gemm_shape_log_eff`` (classes first), or with ``base`` a shared table
    whose rows ``base + class`` are this configuration's grids. Without ``base`` the two grids
    are blended first and read once, cheapest when ``low`` is the same for a whole batch (a
    sweep); with it each layer GEMM is read in both rows and the values blended, so a batch of
    configurations never copies the table (a calibration's thousands of rows).
    """
    head_m, head_n, head_k = (jnp.reshape(v, (1,)) for v in head)
    count = m.shape[0]
    if base is None:
        layers = table[_HIGH] + low * (table[_LOW] - table[_HIGH])
        return shape_log_effs(
            jnp.stack([layers, table[_HIGH]]),
            jnp.concatenate([m, head_m]),
            jnp.concatenate([n, head_n]),
            jnp.concatenate([k, head_k]),
            row=jnp.append(jnp.zeros(count, jnp.int32), 1),
        )
    rows = jnp.concatenate([jnp.full(count + 1, _HIGH), jnp.full(count, _LOW)]).astype(jnp.int32)
    effs = shape_log_effs(
        table,
        jnp.concatenate([m, head_m, m]),
        jnp.concatenate([n, head_n, n]),
        jnp.concatenate([k, head_k, k]),
        row=jnp.asarray(base).astype(jnp.int32) + rows,
    )
    return tuple(jnp.append(e[:count] + low * (e[count + 1 :] - e[:count]), e[count]) for e in effs)


def layer_log_time(table, tokens, width, tp, log2_lo=LAYER_GRID_LOG2_LO):
    """Trilinear interpolation of the layer shape grid ``table`` (``Params.layer_shape_log_time``:
    log time factors on octave nodes of tokens per microbatch, width per GPU and tp; clamped at
    the edges) at one layer shape. The LM head shape grid (``Params.head_shape_log_time``, width
    the hidden size, its own ``log2_lo``) is read the same way."""
    coords = [
        _grid_coord(jnp.asarray(v, dtype=table.dtype), size, lo)
        for v, size, lo in zip((tokens, width, tp), table.shape, log2_lo)
    ]
    return _interpolate(table, *coords)


def memory_bound_s(n_bytes, cluster: ClusterArrays, params: Params):
    """Time of a memory-bound kernel moving ``n_bytes`` through HBM."""
    return n_bytes / (cluster.hbm_Bps * params.mem_eff)


def gemm_operand_bytes(m, n, k):
    """HBM bytes of GEMMs ``(m x k) @ (k x n)``: both operands and the result at ``ACT_BYTES``."""
    return ACT_BYTES * (m * k + k * n + m * n)


def gemm_s(
    m,
    n,
    k,
    flops_per_s,
    cluster: ClusterArrays,
    params: Params,
    temperature,
    log_eff=None,
    io_bytes=None,
):
    """Time of GEMMs ``(m x k) @ (k x n)`` (arrays broadcast) at ``flops_per_s`` large-GEMM rate;
    ``log_eff`` is their shape-grid factor (default: read from the 16-bit grid); ``io_bytes``
    their HBM traffic (default: ``gemm_operand_bytes``; an implicit-GEMM
    convolution passes its tensors' bytes, as its ``m x k`` operand is never stored).

    ``2 m n k / (rate * prod(d / (d + d_half)))`` is written as ``2 prod(d + d_half) / rate``
    so it stays finite for a zero dimension; a zero-size GEMM costs nothing.
    """
    c = params.gemm_dim_half
    flops = 2.0 * m * n * k
    present = flops / (flops + 1.0)
    if log_eff is None:  # the 16-bit grid
        log_eff = shape_log_eff(params.gemm_shape_log_eff, m, n, k, row=_HIGH)
    shape = jnp.exp(-log_eff)
    compute = 2.0 * (m + c) * (n + c) * (k + c) / flops_per_s * present * shape
    if io_bytes is None:
        io_bytes = gemm_operand_bytes(m, n, k)
    io = memory_bound_s(io_bytes, cluster, params)
    return smooth.smax2(compute, io, temperature)


@struct.dataclass
class KernelTimes:
    """Kernel time on one GPU for one microbatch; every field is [2]: forward, backward."""

    layer_s: jax.Array  # one layer: GEMMs, attention, memory-bound kernels, casts, launches
    attention_s: jax.Array  # the layer's attention core (part of ``layer_s``)
    head_s: jax.Array  # LM head GEMMs (backward: dgrad + wgrad)
    loss_s: jax.Array  # vocab-parallel cross entropy over the local logits


def _gemm_times(work: LayerWork, model, cluster, params, temperature, grid):
    """(layer GEMMs [2], LM head GEMMs [2]) forward and backward, one ``gemm_s`` call.

    Forward ``(m x k) @ (k x n)``; dgrad ``(m x n) @ (n x k)`` and wgrad ``(k x m) @ (m x n)``:
    the same FLOPs, transposed shapes. Rates are a training step's (``Params.step_compute``
    times a lone kernel's). The LM head is not an FP8/FP4 layer (Megatron-Core's
    output layer, llm-foundry's tied head and torchtitan's float8 conversion all keep it in 16
    bits): it runs at the 16-bit rate and reads the 16-bit shape grid.
    """
    low, g = work.low_precision, work.gemms
    step = params.step_compute
    rate = jnp.maximum(gemm_peak_flops(model, cluster, params) * step, 1.0)
    half = jnp.maximum(half_peak_flops(model, cluster, params) * step, 1.0)
    head_rate = low * half + (1.0 - low) * rate
    head = (work.head_tokens, work.vocab_local, model.hidden)
    table, base = (params.gemm_shape_log_eff, None) if grid is None else grid
    log_effs = layer_and_head_log_effs(table, low, g.m, g.n, g.k, head, base)
    m, n, k = (jnp.append(d, h) for d, h in zip((g.m, g.n, g.k), head))
    rates = jnp.append(jnp.broadcast_to(rate, g.m.shape), head_rate)
    fwd, dgrad, wgrad = gemm_s(
        jnp.stack([m, m, k]),
        jnp.stack([n, k, n]),
        jnp.stack([k, n, m]),
        rates,
        cluster,
        params,
        temperature,
        jnp.stack(log_effs),
    )
    # frozen base weights (LoRA) have no weight gradients
    wgrad = wgrad * (1.0 - work.lora)
    layer = jnp.stack([jnp.sum(fwd[:-1]), jnp.sum(dgrad[:-1] + wgrad[:-1])])
    return layer, jnp.stack([fwd[-1], dgrad[-1] + wgrad[-1]])


def adapter_gemm_s(work: LayerWork, model, cluster, params, temperature):
    """LoRA adapters' GEMMs of one layer ([2]: forward; backward, dgrad and wgrad): 16-bit,
    at the 16-bit large-GEMM rate, without a shape-grid factor (rank-r GEMMs are bound by
    reading their inputs); 0 without LoRA (every adapter GEMM then has size zero).

    Computed under ``lax.cond`` on the adapter ranks: where they do not vary over a batch (a
    sweep passes such plan leaves unbatched, ``sweep.batch_axes``) a batch without LoRA skips
    the adapters; under ``vmap`` with batched ranks the condition is a select of both
    branches, the same values."""
    zero = jnp.zeros(2, work.lora.dtype)
    on = jnp.any(work.adapter_ranks > 0.0)
    args = (work, model, cluster, params)
    return jax.lax.cond(on, lambda a: _adapter_gemm_s(*a, temperature), lambda a: zero, args)


def _adapter_gemm_s(work: LayerWork, model, cluster, params, temperature):
    g = work.adapter_gemms
    rate = jnp.maximum(half_peak_flops(model, cluster, params) * params.step_compute, 1.0)
    fwd, dgrad, wgrad = gemm_s(
        jnp.stack([g.m, g.m, g.k]),
        jnp.stack([g.n, g.k, g.n]),
        jnp.stack([g.k, g.n, g.m]),
        rate,
        cluster,
        params,
        temperature,
        jnp.zeros((3, *g.m.shape), rate.dtype),
    )
    return jnp.stack([jnp.sum(fwd), jnp.sum(dgrad + wgrad)])


def fused_attention_s(flops, n_bytes, rate, eff, cluster, params, temperature):
    """Fused attention kernels ``[2]`` (forward, backward) of ``flops`` model FLOPs (the full
    square; the causal kernel does half), ``n_bytes`` forward HBM traffic, at ``rate`` FLOP/s
    times ``eff`` (``Params.attention_eff``, ``[2]``): a roofline per pass, the backward
    ``ATTN_BWD_FACTOR_FLASH`` times the forward's work."""
    compute = flops * CAUSAL_FRACTION_FLASH / (rate * eff)
    one = smooth.smax2(compute, memory_bound_s(n_bytes, cluster, params), temperature)
    return one * jnp.asarray((1.0, ATTN_BWD_FACTOR_FLASH), one.dtype)


def _attention_times(work: LayerWork, model, cluster, params, temperature):
    """Attention core forward and backward [2]: a roofline of its FLOPs (half of them with a
    fused causal kernel, all of them for non-causal attention) and its HBM traffic; unfused,
    the score passes add up in series. The fused kernel's efficiency depends on its shape
    (``LayerWork.attention_shape``); its rate is a training step's (``Params.step_compute``)."""
    flash, mask = model.flash, model.causal
    causal = flash * (mask * CAUSAL_FRACTION_FLASH + (1.0 - mask)) + (1.0 - flash)
    rate16 = jnp.maximum(half_peak_flops(model, cluster, params) * params.step_compute, 1.0)
    eff = params.attention_eff(model.flash2, work.attention_shape, model.triton)
    attn_rate = rate16 * (flash * eff + (1.0 - flash))
    fwd = smooth.smax2(
        work.attention_flops * causal / attn_rate,
        memory_bound_s(work.attention_bytes * flash, cluster, params),
        temperature,
    ) + memory_bound_s(work.attention_bytes * (1.0 - flash), cluster, params)
    bwd_factor = flash * ATTN_BWD_FACTOR_FLASH + (1 - flash) * ATTN_BWD_FACTOR
    return fwd * jnp.stack([jnp.ones_like(bwd_factor), bwd_factor])


def kernel_times(
    work: LayerWork,
    model: ModelArrays,
    cluster: ClusterArrays,
    params: Params,
    temperature,
    grid=None,
) -> KernelTimes:
    """Kernel times of one layer, its attention core, the LM head and the loss.

    Args:
        work: ``workload.layer_work(model, plan)``.
        model, cluster, params: array pytrees of one configuration.
        temperature: relative softness of the rooflines' smooth maxima (static).
        grid: ``(table, base)`` of shared GEMM shape grids (see ``simulate.simulate``), or
            None for ``params.gemm_shape_log_eff``.

    Returns:
        A ``KernelTimes`` in seconds.
    """
    gemm, head = _gemm_times(work, model, cluster, params, temperature, grid)
    attention = _attention_times(work, model, cluster, params, temperature)
    passes = jnp.asarray(_FWD_BWD_PASSES, dtype=attention.dtype)
    elementwise = memory_bound_s(work.elementwise_bytes, cluster, params) * passes
    casts = memory_bound_s(jnp.stack([work.cast_fwd_bytes, work.cast_bwd_bytes]), cluster, params)
    launches = KERNELS_PER_LAYER_FWD * params.kernel_overhead_s * passes
    lora = adapter_gemm_s(work, model, cluster, params, temperature)
    logits = work.head_tokens * work.vocab_local
    loss_bytes = jnp.asarray((LOSS_FWD_BYTES_PER_LOGIT, LOSS_BWD_BYTES_PER_LOGIT), attention.dtype)
    return KernelTimes(
        layer_s=gemm + attention + elementwise + casts + launches + lora,
        attention_s=attention,
        head_s=head,
        loss_s=memory_bound_s(loss_bytes * logits, cluster, params),
    )
