"""The kernel levels of the fit: GEMMs, fused attention kernels and memory-bound transfers.

``gemm_time`` is how the GEMM level (built by ``calibration.fit.build_problem``) times a row.
``build`` turns records into the arrays of ``calibration.fit.Problem`` (levels ``"attn"`` and
``"mem"``), ``predict_log`` gives the model's log time of each row. Attention kernels are timed
as the model times a layer's fused attention (``diffcost.kernels.fused_attention_s``) at the
kernel's shape efficiency (``Params.attention_eff``), so a kernel table fits ``attn_eff``, the
shape odds and the backward odds ratio; a memory-bound transfer is
``diffcost.kernels.memory_bound_s`` on its cluster's HBM, so it fits ``mem_eff``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from calibration.records import Measurements
from diffcost import kernels
from diffcost.arrays import ACT_BYTES, stack
from diffcost.gpus import FAMILY_CLUSTER, gpu_family
from diffcost.params import ATTN_BWD_SHAPE_LEAVES, ATTN_SHAPE_LEAVES
from diffcost.specs import PRECISIONS
from diffcost.workload import attention_shape

KERNEL_LEVELS = ("attn", "mem")


def _load_factor(sustained, params):
    """Rate factor of a kernel-table row: ``step_compute`` for a kernel timed under sustained
    load (``sustained`` 1), as a training step's kernels run; 1 for one timed on a cool GPU."""
    return 1.0 + sustained * (params.step_compute - 1.0)


def gemm_time(m, n, k, precision, sustained, cluster, params, log_eff, temperature):
    """One GEMM kernel as the model times it, plus the per-kernel gap; a kernel timed under
    sustained load (``sustained`` 1) runs at a training step's rate (``step_compute``)."""
    rate = jnp.sum(precision * cluster.peak_flops) * jnp.sum(precision * params.gemm_eff)
    rate = rate * _load_factor(sustained, params)
    t = kernels.gemm_s(m, n, k, jnp.maximum(rate, 1.0), cluster, params, temperature, log_eff)
    return t + params.kernel_overhead_s


def attention_time(flops, n_bytes, shape, stage, sustained, cluster, params, temperature):
    """One fused (cuDNN / Transformer Engine) attention kernel as the model times it
    (``kernels.fused_attention_s`` at the 16-bit rate and the shape's efficiency), forward
    (``stage`` 0) or backward (1), plus the per-kernel gap; a kernel timed under sustained load
    (``sustained`` 1) runs at a training step's rate (``step_compute``)."""
    bf16 = PRECISIONS.index("bf16")
    step = _load_factor(sustained, params)
    rate = jnp.maximum(cluster.peak_flops[bf16] * params.gemm_eff[bf16] * step, 1.0)
    eff = params.attention_eff(0.0, shape)
    t = kernels.fused_attention_s(flops, n_bytes, rate, eff, cluster, params, temperature)
    return t[stage] + params.kernel_overhead_s


# Device constants that only attention kernel tables move: a family without such a table keeps
# them at their start (``freeze_unmeasured_attention``), so its end-to-end runs cannot use
# them as free knobs.
ATTENTION_ONLY_LEAVES = (
    ATTN_SHAPE_LEAVES + ATTN_BWD_SHAPE_LEAVES + ("attn_bwd_log_odds", "attn_ceiling_log")
)


def build(meas: Measurements, families, clusters, cl, idx) -> dict:
    """The attention kernel level (``"attn"``) and the memory-bound level (``"mem"``) of
    ``calibration.fit.build_problem``: model FLOPs (the full square, doubled for a non-causal
    kernel, whose work the causal fraction then halves back), forward HBM bytes and shape
    octaves of each attention kernel; bytes of each transfer on its cluster. ``cl`` and ``idx``
    are ``build_problem``'s cluster loader and row indexer."""
    data = {}
    attn = meas.attention  # placed by build_problem (records.placed_kernels)
    if attn:
        specs = [cl(FAMILY_CLUSTER[a.gpu]) for a in attn]
        b, s, h, kv, hd = (
            np.array([getattr(a, f) for a in attn], dtype=float)
            for f in ("batch", "seq_len", "heads", "kv_heads", "head_dim")
        )
        causal = np.array([a.causal for a in attn], dtype=float)
        data["attn"] = {
            "flops": 4.0 * b * s * s * h * hd * (2.0 - causal),
            "bytes": ACT_BYTES * b * s * hd * (2.0 * h + 2.0 * kv),
            "shape": np.asarray(attention_shape(s, hd, b * h, h / kv)),
            "stage": np.array([a.stage == "bwd" for a in attn], dtype=np.int32),
            "sustained": np.array([a.sustained for a in attn], dtype=float),
            "cluster": stack([sp[1] for sp in specs]),
            "d": np.array([idx(families, a.gpu) for a in attn]),
            "c": np.array([idx(clusters, FAMILY_CLUSTER[a.gpu]) for a in attn]),
            "log_meas": np.log(np.array([a.time_s for a in attn], dtype=float)),
        }
    mem = [r for r in meas.memory if r.cluster]
    if mem:
        specs = [cl(r.cluster) for r in mem]
        data["mem"] = {
            "bytes": np.array([r.n_bytes for r in mem], dtype=float),
            "cluster": stack([sp[1] for sp in specs]),
            "d": np.array([idx(families, gpu_family(sp[0].gpu.name)) for sp in specs]),
            "c": np.array([idx(clusters, r.cluster) for r in mem]),
            "log_meas": np.log(np.array([r.time_s for r in mem], dtype=float)),
        }
    return data


def predict_log(level: str, d: dict, params, temperature):
    """log of the model's time of every row of ``level`` (``"attn"`` or ``"mem"``) with
    per-row ``params``."""
    if level == "attn":
        run = jax.vmap(lambda *a: attention_time(*a, temperature))
        args = (d["flops"], d["bytes"], d["shape"], d["stage"], d["sustained"], d["cluster"])
        return jnp.log(run(*args, params))
    return jnp.log(jax.vmap(kernels.memory_bound_s)(d["bytes"], d["cluster"], params))


def freeze_unmeasured_attention(dev: dict, measured) -> dict:
    """``dev`` with ``ATTENTION_ONLY_LEAVES`` held fixed (no gradient) in the rows of
    families not in ``measured`` (a boolean per family row)."""
    free = jnp.asarray(measured)

    def held(x):
        mask = free.reshape(free.shape + (1,) * (x.ndim - 1))
        return jnp.where(mask, x, jax.lax.stop_gradient(x))

    return {**dev, **{k: held(dev[k]) for k in ATTENTION_ONLY_LEAVES}}
