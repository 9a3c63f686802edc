"""Every constant the model is calibrated on: one registry, and the pytree built from it.

``CONSTANTS`` holds one :class:`Constant` per calibrated quantity: its name, the raw leaf that
stores it, its transform (log for positive quantities, logit for fractions), its datasheet
default, the width of the calibration prior, the level it belongs to (device, cluster or
software stack), and how reports label it. ``Params`` (its leaves are the raw, unconstrained
values; a property of the constant's name returns the constrained value), ``default_params``,
the profile fields (``diffcost.profiles``), the prior widths (``calibration.fit``) and
``diffcost.explain``'s labels all derive from it: adding a constant is one entry here.
Defaults come from datasheets and common practice, not from fitting; ``calibration/`` fits them
to measurements.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

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


# The attention kernel's shape terms: its efficiency is logit-linear in the octaves of these
# four quantities from a reference shape (``Params.attention_eff``): sequence length per GPU
# (after cp), head dim, heads per GPU times microbatch (the kernel's parallel work across SMs)
# and heads per KV head (the GQA group). The reference is Llama-3-style, 4096 tokens, head dim
# 128, 32 (batch x heads) per GPU, MHA; ``attn_eff`` is the efficiency there.
ATTN_SHAPE_REF = {"seq_len": 4096.0, "head_dim": 128.0, "parallel_heads": 32.0, "group": 1.0}
ATTN_SHAPE_LEAVES = (
    "attn_seq_log_odds",
    "attn_dim_log_odds",
    "attn_heads_log_odds",
    "attn_group_log_odds",
)
# The backward kernel's own shape terms, same order (it parallelizes over key blocks, so it
# depends less on the head count than the forward).
ATTN_BWD_SHAPE_LEAVES = tuple(leaf.replace("attn_", "attn_bwd_") for leaf in ATTN_SHAPE_LEAVES)

Transform = Literal["log", "logit"]
Level = Literal["device", "cluster", "stack"]
PER_PRECISION = (len(PRECISIONS),)
LEVELS = ("device", "cluster", "stack")


@dataclasses.dataclass(frozen=True)
class Constant:
    """One calibrated constant.

    Attributes:
        name: the constrained quantity: profile field and ``Params`` property (SI units).
        leaf: the raw ``Params`` leaf that stores it.
        transform: ``"log"`` (positive) or ``"logit"`` (fraction in (0, 1)).
        default: datasheet default, constrained; a ``{precision: value}`` mapping for per-
            precision constants; None for shape grids (factor 1 everywhere).
        prior_sd: width of the calibration prior around the default, in raw units.
        level: ``"device"`` (per GPU family), ``"cluster"`` (per cluster) or ``"stack"``
            (per software stack).
        label: what reports call it.
        unit: the unit reports show; ``scale`` converts the SI value to it.
        shape: the leaf's shape: () for a scalar, ``PER_PRECISION``, or a grid's shape.
    """

    name: str
    leaf: str
    transform: Transform
    default: float | dict | None
    prior_sd: float
    level: Level
    label: str
    unit: str = ""
    scale: float = 1.0
    shape: tuple[int, ...] = ()

    @property
    def is_grid(self) -> bool:
        return self.default is None


# NVLink SHARP (in-switch reduction, ``diffcost.network.cost``'s ``nvls``) reaches
# ``nvls_ratio`` times the cluster's ``nvlink_eff`` of the NVLink per-direction rate: what a
# system's software reaches on NVLink (protocol overhead, library version, runtime) scales both,
# and the switch's reduction is the device's. The default is NVIDIA's two figures for 8 H100:
# ring bus bandwidth 370 GB/s of the 450 GB/s line rate (0.82; NVIDIA/nccl#1442,
# NVIDIA/nccl-tests#212) and NVLS all-reduce algorithm bandwidth ~275 GB/s (bus bandwidth
# ~480 GB/s, nccl-tests#212), which crosses each link (n + 1)/n = 9/8 of it: 309 GB/s, 0.69
# of the line rate, so 0.69 / 0.82 = 0.83. Its fixed cost per call, ``nvls_latency_s``,
# defaults to NCCL's own tuning model (src/graph/tuning.cc: hwLat for NVLS over NVLink, Simple
# protocol, 25 us; the ring's is 3.4 us per step). Both are device constants (the NVSwitch
# generation comes with the GPU family). NCCL moves NVLS in chunks it shrinks for small messages
# (``diffcost.network.nvls``), each paying a fixed cost: ``nvls_chunk_bytes`` is that cost as
# bytes a channel would stream meanwhile, the chunk at which NVLS reaches half its rate. Its
# default is a round trip of ~1 us through the switch at a channel's ~20 GB/s (NCCL's NVLink
# rate per channel in its topology search), one e-fold wide; a device constant too.
# ``diffcost.comm`` does not use them (the graph path and ``calibration.network_fit`` do), so
# the joint fit leaves them at their prior.
# XLA's collective table (``shared/data`` README: each XLA-emitted collective timed alone)
# takes longer over small groups than NCCL's ring does: all-gather, reduce-scatter and
# all-reduce over 2, 4 and 8 H100 or B200 fit the ring at one bandwidth for every group size
# plus a time proportional to each rank's chunk ``msg / n`` (``diffcost.network.cost``'s
# ``xla``). ``chunk_pass_Bps`` is the rate of that pass in all-gather, ``chunk_reduce_Bps`` in
# reduce-scatter and all-reduce (over 2, 4, 8 H100 the two rates differ by 2x; on B200 they
# do not); the default is the order of a GPU-local pass over a buffer on a few SMs (as
# ``reduce_Bps``), one e-fold wide. Only the graph path uses them, for tables that declare
# it, and ``calibration.network_fit`` fits them.
# The same tables' all-to-all (XLA runs it as grouped NCCL sends and receives) runs below the
# ring's bandwidth up to tens of MiB where all-gather over the same GPUs does not:
# ``sendrecv_half_bw_bytes`` is its own small-message curve's half-bandwidth message (NCCL's
# sends have their own chunking, not the collectives' Simple buffers whose curve
# ``half_bw_bytes`` is), defaulting to ``half_bw_bytes``' default (1 MiB), 1.5 e-folds wide.
# NCCL stripes each peer's send over more channels the more bytes it carries (src/enqueue.cc,
# ``calcP2pChannelCount``: the channels double while each would carry more than its maximum), so
# an all-to-all whose per-peer share ``msg / n`` is small runs on few channels: below
# ``sendrecv_peer_bytes`` (default 1 MiB, an e-fold wide) the grouped sends run at
# ``sendrecv_small_share`` of the links' bandwidth (default 0.5, one unit of log odds), a
# logistic step in ``log(msg / n)`` (``diffcost.network.sendrecv``, which says why, with NCCL's
# sources, for these and the next two). Below that step the pairwise sends' ``n - 1`` path
# latencies are paid ``sendrecv_concurrency`` at a time (default 8, one NCCL work batch; 1.5
# e-folds wide), and ``n - 1`` peers at once reach ``min(1, (n - 1) * sendrecv_peer_max_share)``
# of the links' bandwidth (default 0.5: two peers fill it; 1.5 units of log odds wide, NCCL's
# channel counts vary by system). The sends of a group whose size is not a power of two leave
# part of NCCL's p2p channels idle (several peers' sends share a channel) until each send is
# spread over more of them: a send's channels double while each part would exceed
# ``sendrecv_balance_bytes`` (default 16 MiB, NCCL's largest part per channel within a node;
# 1.5 e-folds wide; ``sendrecv.busy_levels`` and ``sendrecv.channel_share``). Busy channels
# fill the links once ``sendrecv_channel_need`` of them are: the links' bandwidth over the p2p
# channels' own rates (default 0.75, one unit of log odds wide: NVLink 4 moves about half of
# what 32 SMs' p2p channels do, NVLink 5 twice as much on similar SMs).
# Device constants, read only for XLA's tables.
# NCCL runs each algorithm under one of its protocols, the fastest by its own tuning model
# (src/graph/tuning.cc: a latency plus the bytes over the protocol's share of the bus bandwidth).
# ``diffcost.network.cost``'s ``protocols`` adds LL128 beside Simple: ``ll128_bw_share`` is its
# bandwidth as a share of Simple's, defaulting to NCCL's 0.92 within a node (LL128 carries 120
# data bytes of every 128-byte line; the model caps it further per channel), and
# ``ll128_half_bw_bytes`` its small-message curve, which NCCL's model does not have (LL128 needs
# no large chunks in flight): a small round default, 128 KiB, two e-folds wide. Device
# constants; only the graph path reads them, for a pricing built with ``protocols``.
# A network transport over TCP (``ClusterSpec.transport: tcp``, Google's GPUDirect-TCPX/TCPXO)
# runs NCCL in two regimes by message size (``diffcost.network.cost``, ``tcp``): a ring on
# ``tcp_ring_share`` of the NICs' bandwidth with no fixed cost beyond its steps, and the
# algorithms that use every NIC (hierarchical, tree) at the full rate after a fixed cost per
# call, ``tcp_fill_s``. Neither has a published figure: the defaults are round guesses with wide
# priors (1.5 in raw units), and ``calibration.network_fit`` fits both per cluster. Only the
# graph path reads them, for a pricing built with ``tcp``.
# Datasheet-style defaults, constrained values. Sources: NVIDIA's published large-GEMM
# throughput (~75-85% of dense peak for bf16 on A100/H100), nccl-tests bus bandwidth on
# DGX systems (~80% of NVLink per-direction peak), Adam in mixed precision (fp32 master
# weights, two moments, fp32 gradients, 16-bit copy: ~ 28 B of HBM traffic per parameter);
# a reducing collective's pass over its buffer runs on a few SMs at ~1 TB/s (order of
# magnitude: the A100 all-reduce tables fit ~0.5 TB/s); PyTorch eager dispatch costs ~10 us of
# CPU per op with autograd, so small layers are bound by the host, not the GPU.
# ``step_compute`` scales the GEMM and attention rates of a training step's kernels (not of a
# kernel measured alone on a cool GPU: GEMM and attention tables, ``diffcost.microbench``): a
# GPU running a training step sustains lower clocks under its power limit than in a short
# microbenchmark, and that is the device's, whatever the software (one H200: 0.83 of the first
# 50 ms of 8192^3 GEMMs within 1.4 s, benchmarks/results/h200/). SM sharing with overlapped
# communication kernels is ``interference``'s. It defaults to 1 (no difference until
# end-to-end runs and kernel tables of one family disagree); its width, 0.3 in log, is the
# order of the clock loss.
# Prior widths (``prior_sd``) are in the raw units the fit moves (natural log for positive
# constants, logit for fractions): how far a datasheet-style value is plausibly off. Link
# efficiencies are well known from nccl-tests (0.8 -> 0.66-0.89 at one width); kernel
# efficiencies and latencies less so. The per-iteration overhead (data loading, logging,
# framework hooks) gets one e-fold: wider, the fit turns time it cannot explain in long runs
# into a fixed cost per iteration that short runs then pay; that width was picked from 2, 1 and
# 0.5 by the grouped CV (benchmarks/calibration_cv.py), so it carries a small selection bias.
# FlashAttention-2 runs about as fast as the cuDNN kernel on Ampere, so its odds ratio defaults
# to 1 (on Hopper to the published ratio, ``FAMILY_DEFAULTS``) and stays there where no data
# separates the two kernels. The
# attention shape odds (per octave of sequence, head dim, heads per GPU, GQA group; forward and
# backward), the backward kernel's odds ratio and the ceiling (attention's best rate as a
# multiple of the 16-bit GEMM rate: a fused kernel can outrun the GEMMs of a table whose GEMMs
# run far below peak) default to 1, so attention is ``attn_eff`` at every shape until
# an attention kernel table moves them (``calibration.fit`` fits them only for GPU families
# with such a table); their width, 0.5 in log odds per octave, is a guess of how far a
# kernel's efficiency plausibly drifts per doubling of a dimension. Shape grid nodes get 0.3
# (a node 30% off the smooth curve is one width away): the data move the nodes they touch
# and the rest stay at factor 1; narrower (0.1) kept vTrain's per-shape offsets from being
# fitted. The LM head grid gets 1.0: at 0.3 the prior held vTrain's tp 1 heads (1.7-3x
# the work-based time) to a fraction of that and the fit lengthened the layers instead.
_GEMM_EFF = {"fp32": 0.80, "bf16": 0.80, "fp16": 0.80, "fp8": 0.65, "fp4": 0.55}
_C = Constant
# fmt: off
CONSTANTS = (
    # name, leaf, transform, default, prior sd, level, label, unit, scale[, shape]
    _C("gemm_eff", "gemm_eff_logit", "logit", _GEMM_EFF, 1.0, "device",
       "GEMM efficiency", "%", 100.0, PER_PRECISION),
    _C("gemm_dim_half", "gemm_dim_half_log", "log", 48.0, 1.5, "device",
       "GEMM half-efficiency dim"),
    _C("attn_eff", "attn_eff_logit", "logit", 0.70, 1.0, "device",
       "fused attention efficiency", "%", 100.0),
    _C("attn_flash_odds", "attn_flash_log_odds", "log", 1.0, 0.5, "device",
       "FlashAttention-2 odds ratio", "x"),
    # Triton FlashAttention against FlashAttention-2: Dao, "FlashAttention-2" (2023), section
    # 4.1, A100: FlashAttention-2 is 1.3-2.5x faster than FlashAttention in Triton; at 1.8x (the
    # geometric middle) and FlashAttention-2's ~60% of peak, odds 0.5 against 1.5.
    _C("attn_triton_odds", "attn_triton_log_odds", "log", 0.33, 0.5, "device",
       "Triton FlashAttention odds against FlashAttention-2", "x"),
    _C("attn_seq_odds", "attn_seq_log_odds", "log", 1.0, 0.5, "device",
       "attention odds per sequence octave", "x"),
    _C("attn_dim_odds", "attn_dim_log_odds", "log", 1.0, 0.5, "device",
       "attention odds per head-dim octave", "x"),
    _C("attn_heads_odds", "attn_heads_log_odds", "log", 1.0, 0.5, "device",
       "attention odds per heads-per-GPU octave", "x"),
    _C("attn_group_odds", "attn_group_log_odds", "log", 1.0, 0.5, "device",
       "attention odds per GQA-group octave", "x"),
    _C("attn_bwd_odds", "attn_bwd_log_odds", "log", 1.0, 0.5, "device",
       "attention backward odds ratio", "x"),
    _C("attn_bwd_seq_odds", "attn_bwd_seq_log_odds", "log", 1.0, 0.5, "device",
       "attention backward odds per sequence octave", "x"),
    _C("attn_bwd_dim_odds", "attn_bwd_dim_log_odds", "log", 1.0, 0.5, "device",
       "attention backward odds per head-dim octave", "x"),
    _C("attn_bwd_heads_odds", "attn_bwd_heads_log_odds", "log", 1.0, 0.5, "device",
       "attention backward odds per heads-per-GPU octave", "x"),
    _C("attn_bwd_group_odds", "attn_bwd_group_log_odds", "log", 1.0, 0.5, "device",
       "attention backward odds per GQA-group octave", "x"),
    _C("attn_ceiling", "attn_ceiling_log", "log", 1.0, 0.5, "device",
       "attention ceiling over the 16-bit GEMM rate", "x"),
    _C("mem_eff", "mem_eff_logit", "logit", 0.80, 1.0, "device", "HBM efficiency", "%", 100.0),
    _C("step_compute", "step_compute_log", "log", 1.0, 0.3, "device",
       "compute rate in a training step over the kernel tables'", "x"),
    _C("kernel_overhead_s", "kernel_overhead_log_s", "log", 4e-6, 1.0, "device",
       "kernel launch overhead", "µs", 1e6),
    _C("host_op_s", "host_op_log_s", "log", 15e-6, 1.0, "cluster", "host time per op", "µs", 1e6),
    _C("host_overlap", "host_overlap_logit", "logit", 0.95, 1.5, "cluster",
       "host dispatch hidden", "%", 100.0),
    _C("nvlink_eff", "nvlink_eff_logit", "logit", 0.80, 0.7, "cluster",
       "NVLink efficiency", "%", 100.0),
    _C("nic_eff", "nic_eff_logit", "logit", 0.85, 0.7, "cluster", "NIC efficiency", "%", 100.0),
    _C("nvlink_latency_scale", "nvlink_latency_log_scale", "log", 1.0, 1.0, "cluster",
       "NVLink latency scale", "x"),
    _C("nic_latency_scale", "nic_latency_log_scale", "log", 1.0, 1.0, "cluster",
       "NIC latency scale", "x"),
    _C("half_bw_bytes", "half_bw_log_bytes", "log", 1.0 * 2**20, 1.5, "cluster",
       "half-bandwidth message", "MiB", 2.0**-20),
    _C("collective_overhead_s", "collective_overhead_log_s", "log", 10e-6, 1.5, "cluster",
       "collective call overhead", "µs", 1e6),
    _C("reduce_Bps", "reduce_log_Bps", "log", 1e12, 1.0, "device",
       "collective reduction pass", "GB/s", 1e-9),
    _C("interference", "interference_log", "log", 0.05, 1.5, "cluster",
       "overlap interference", "%", 100.0),
    _C("optimizer_bytes_per_param", "optimizer_log_bytes_per_param", "log", 28.0, 1.0,
       "cluster", "optimizer bytes per param", "B"),
    _C("iteration_overhead_s", "iteration_overhead_log_s", "log", 5e-3, 1.0, "cluster",
       "per-iteration overhead", "ms", 1e3),
    _C("microbatch_overhead_s", "microbatch_overhead_log_s", "log", 1e-3, 1.0, "cluster",
       "per-microbatch overhead", "ms", 1e3),
    _C("nvls_ratio", "nvls_ratio_logit", "logit", 0.83, 0.7, "device",
       "NVLink SHARP efficiency over NVLink efficiency", "%", 100.0),
    _C("nvls_latency_s", "nvls_latency_log_s", "log", 25e-6, 1.0, "device",
       "NVLink SHARP latency", "µs", 1e6),
    _C("nvls_chunk_bytes", "nvls_chunk_log_bytes", "log", 20e3, 1.0, "device",
       "NVLink SHARP fixed cost per chunk, in bytes", "KiB", 2.0**-10),
    _C("chunk_pass_Bps", "chunk_pass_log_Bps", "log", 1e12, 1.0, "device",
       "unpipelined pass over a rank's chunk (XLA tables)", "GB/s", 1e-9),
    _C("chunk_reduce_Bps", "chunk_reduce_log_Bps", "log", 1e12, 1.0, "device",
       "unpipelined pass over a rank's chunk, reducing collectives (XLA tables)", "GB/s", 1e-9),
    _C("sendrecv_half_bw_bytes", "sendrecv_half_bw_log_bytes", "log", 1.0 * 2**20, 1.5,
       "device", "grouped send/recv half-bandwidth message (XLA)",
       "MiB", 2.0**-20),
    _C("sendrecv_peer_bytes", "sendrecv_peer_log_bytes", "log", 1.0 * 2**20, 1.0, "device",
       "grouped sends' per-peer size for all their channels (XLA)", "MiB", 2.0**-20),
    _C("sendrecv_small_share", "sendrecv_small_share_logit", "logit", 0.5, 1.0, "device",
       "grouped sends' bandwidth share below that size (XLA)", "%", 100.0),
    _C("sendrecv_peer_max_share", "sendrecv_peer_max_share_logit", "logit", 0.5, 1.5, "device",
       "share of the links' bandwidth one peer's sends reach (XLA)", "%", 100.0),
    _C("sendrecv_concurrency", "sendrecv_concurrency_log", "log", 8.0, 1.5, "device",
       "grouped sends' peers whose latencies overlap (XLA)", "x"),
    _C("sendrecv_balance_bytes", "sendrecv_balance_log_bytes", "log", 16.0 * 2**20, 1.5,
       "device", "grouped sends' largest part per channel before doubling (XLA)", "MiB",
       2.0**-20),
    _C("sendrecv_channel_need", "sendrecv_channel_need_logit", "logit", 0.75, 1.0, "device",
       "share of the p2p channels whose sends fill the links (XLA)", "%", 100.0),
    _C("ll128_bw_share", "ll128_bw_share_logit", "logit", 0.92, 0.7, "device",
       "LL128 protocol's share of the links' bandwidth", "%", 100.0),
    _C("ll128_half_bw_bytes", "ll128_half_bw_log_bytes", "log", 2.0**17, 2.0, "device",
       "LL128 protocol's half-bandwidth message", "MiB", 2.0**-20),
    _C("tcp_ring_share", "tcp_ring_share_logit", "logit", 0.25, 1.5, "cluster",
       "ring's share of the NIC bandwidth over a TCP transport", "%", 100.0),
    _C("tcp_fill_s", "tcp_fill_log_s", "log", 500e-6, 1.5, "cluster",
       "fixed cost per call of an all-NIC algorithm over a TCP transport", "µs", 1e6),
    _C("gemm_shape_eff", "gemm_shape_log_eff", "log", None, 0.3, "device",
       "GEMM shape efficiency factor", shape=(len(GEMM_GRID_CLASSES),) + (GEMM_GRID,) * 3),
    _C("layer_shape_time", "layer_shape_log_time", "log", None, 0.3, "device",
       "layer shape time factor", shape=LAYER_GRID),
    _C("cluster_layer_time", "cluster_layer_log_time", "log", None, 0.3, "cluster",
       "cluster layer shape time factor", shape=LAYER_GRID),
    _C("head_shape_time", "head_shape_log_time", "log", None, 1.0, "cluster",
       "LM head shape time factor", shape=HEAD_GRID),
)
# fmt: on
CONSTANT = {c.name: c for c in CONSTANTS}
BY_LEAF = {c.leaf: c for c in CONSTANTS}


def _logit(p):
    p = jnp.asarray(p, dtype=float)
    return jnp.log(p) - jnp.log1p(-p)


def _constrained(constant: Constant):
    """The property returning ``constant``'s constrained value from its raw leaf."""
    squash = jnp.exp if constant.transform == "log" else jax.nn.sigmoid
    return property(lambda self: squash(getattr(self, constant.leaf)), doc=constant.label)


def _attention_eff(self, flash2, shape=None, triton=0.0):
    """Attention kernel efficiency against the 16-bit GEMM rate, forward and backward ``[2]``.

    ``attn_ceiling`` times a sigmoid of log odds: ``attn_eff`` at the reference shape
    (``ATTN_SHAPE_REF``), FlashAttention-2's (``flash2`` = 1) odds ``attn_flash_odds`` times
    those, Triton FlashAttention's (``triton`` = 1) ``attn_triton_odds`` times FlashAttention-2's,
    and ``shape`` ``[..., 4]`` the octaves of the kernel's shape from the reference
    (``diffcost.workload.attention_shape``), each multiplying the odds by its constant per
    octave (``attn_seq_odds``, ... forward; ``attn_bwd_seq_odds``, ... backward, whose odds are
    also ``attn_bwd_odds`` times the forward's). At their defaults (1) every shape and both
    passes get ``attn_eff``.
    """
    fwd = (
        self.attn_eff_logit
        + (flash2 + triton) * self.attn_flash_log_odds
        + triton * self.attn_triton_log_odds
    )
    bwd = fwd + self.attn_bwd_log_odds
    if shape is not None:
        for i, (f, b) in enumerate(zip(ATTN_SHAPE_LEAVES, ATTN_BWD_SHAPE_LEAVES)):
            fwd = fwd + getattr(self, f) * shape[..., i]
            bwd = bwd + getattr(self, b) * shape[..., i]
    return jnp.exp(self.attn_ceiling_log) * jax.nn.sigmoid(jnp.stack([fwd, bwd]))


def _make_params():
    namespace = {c.name: _constrained(c) for c in CONSTANTS}
    namespace["__annotations__"] = {c.leaf: jax.Array for c in CONSTANTS}
    namespace["attention_eff"] = _attention_eff
    namespace["__module__"] = __name__
    namespace["__doc__"] = _PARAMS_DOC
    return struct.dataclass(type("Params", (), namespace))


_PARAMS_DOC = """Calibratable constants: one raw, unconstrained leaf per entry of ``CONSTANTS``.

    Efficiencies are fractions of a datasheet peak; latencies and overheads are seconds. Each
    constant's name is a property returning its constrained value (``params.gemm_eff``). Per
    precision constants follow ``diffcost.specs.PRECISIONS``; ``gemm_shape_log_eff`` holds, per
    class of ``GEMM_GRID_CLASSES``, a ``GEMM_GRID``-cubed grid over (m, n, k) octaves (all 0:
    factor 1); ``layer_shape_log_time`` a ``LAYER_GRID`` grid of log time factors over a layer's
    (tokens, width, tp) octaves, which ``cluster_layer_log_time`` (a cluster's own, same shape)
    adds to, and ``head_shape_log_time`` a ``HEAD_GRID`` one over the LM head's (tokens,
    hidden, tp) octaves.
    """


Params = _make_params()


def raw_default(constant: Constant, dtype=None) -> jax.Array:
    """The raw leaf of ``constant`` at its datasheet default."""
    dtype = jnp.result_type(float) if dtype is None else dtype
    if constant.is_grid:
        return jnp.zeros(constant.shape, dtype=dtype)
    value = constant.default
    if isinstance(value, dict):
        value = jnp.array([value[p] for p in PRECISIONS])
    raw = jnp.log(value) if constant.transform == "log" else _logit(value)
    return jnp.asarray(raw, dtype=dtype)


# Device constants whose default differs by GPU architecture, from published kernel figures:
# GPU family -> {constant name: constrained value}. They replace ``Constant.default`` for that
# family wherever the datasheet defaults stand in (the fit's starting point and prior centre,
# predictions of a family without a calibrated profile).
#
# attn_flash_odds on Hopper: FlashAttention-2 uses Ampere's synchronous tensor-core
# instructions and reaches about a third of an H100's dense peak, while the Hopper-tuned
# kernels (cuDNN, FlashAttention-3) reach about 60%. Shah et al., "FlashAttention-3" (2024),
# attention forward speed, head dim 128, sequence 4k, H100 SXM5 BF16: FlashAttention-2 368
# TFLOP/s, cuDNN 609 TFLOP/s, of 989 dense: odds 0.593 against 1.603, a ratio of 0.37. On Ampere
# FlashAttention-2 is the tuned kernel (ratio 1, the default).
_HOPPER = {"attn_flash_odds": 0.37}
FAMILY_DEFAULTS: dict[str, dict[str, float]] = {
    family: _HOPPER for family in ("h100", "h200", "h800", "h20", "gh200")
}


def default_params(dtype=None, family: str | None = None) -> Params:
    """Params at their datasheet defaults (``dtype`` defaults to JAX's default float), with
    ``FAMILY_DEFAULTS[family]`` in place of them for a GPU family that has entries there.

    Leaves are strongly typed: a weakly typed leaf would turn strong after one optimizer step,
    and a jit-compiled step would then compile a second time.
    """
    values = {c.leaf: raw_default(c, dtype) for c in CONSTANTS}
    for name, value in FAMILY_DEFAULTS.get(family, {}).items():
        c = CONSTANT[name]
        values[c.leaf] = raw_default(dataclasses.replace(c, default=value), dtype)
    return Params(**values)


def scalar_entries() -> tuple[tuple[str, Constant, int | None], ...]:
    """(entry name, constant, index) of every scalar a calibration posterior describes: each
    constant with a scalar leaf (index None), and each entry of a per-precision one
    (``"gemm_eff.bf16"``, its index in ``PRECISIONS``). Shape grids are left out."""
    out = []
    for c in CONSTANTS:
        if c.shape == ():
            out.append((c.name, c, None))
        elif c.shape == PER_PRECISION:
            out.extend((f"{c.name}.{p}", c, i) for i, p in enumerate(PRECISIONS))
    return tuple(out)


SCALAR_ENTRIES = scalar_entries()
SCALAR_NAMES = tuple(name for name, _, _ in SCALAR_ENTRIES)
