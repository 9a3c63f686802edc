"""Static descriptions of a model, a cluster and a parallelization plan.

These are plain frozen dataclasses holding what a user writes in a config file, in the units of
that file's keys. They are validated at load time (``diffcost.config``) and turned into array
pytrees by ``diffcost.arrays`` before any numerics run.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Precision = Literal["fp32", "bf16", "fp16", "fp8", "fp4"]
Recompute = Literal["none", "selective", "full"]
Schedule = Literal["gpipe", "1f1b", "interleaved"]
ParamGather = Literal["step", "layer"]
Mlp = Literal["gelu", "swiglu"]
Norm = Literal["layernorm", "rmsnorm"]
# Attention core: "unfused" writes the s x s scores to HBM (Megatron's softmax path); "flash" is
# FlashAttention-2 (flash-attn, PyTorch SDPA); "triton" is FlashAttention written in Triton (the
# 2022 kernel llm-foundry's MPT configs select with ``attn_impl: triton``, for ALiBi); "cudnn" is
# cuDNN fused attention (Transformer Engine, Megatron-Core's default), the Hopper-tuned kind that
# FlashAttention-3 also belongs to.
Attention = Literal["unfused", "flash", "triton", "cudnn"]
# Linear layers of every transformer layer that carry LoRA adapters: "attention" the QKV and
# output projections (NeMo's ``target_modules: [attention]``), "mlp" FC1 and FC2, "all" both.
LoraModules = Literal["attention", "mlp", "all"]
LORA_MODULES = {"attention": (1, 1, 0, 0), "mlp": (0, 0, 1, 1), "all": (1, 1, 1, 1)}

PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "fp4")
RECOMPUTE_MODES = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
ZERO_STAGES = (0, 1, 2, 3)
# How NCCL moves bytes between nodes: "rdma" (InfiniBand, RoCE: the default) or "tcp"
# (Google's GPUDirect-TCPX/TCPXO, a TCP stack with GPU-direct payloads); the graph path prices
# the two differently (``diffcost.network.cost``, ``CollectivePricing.tcp``).
TRANSPORTS = ("rdma", "tcp")
# Parallel dimensions that are laid out on the topology, in the order used by arrays.
PLACED_DIMS = ("tp", "cp", "dp", "pp")


def pipeline_places(n_layers, split_edges=1):
    """Places the pipeline split divides: the layers, plus one each for the embedding and the
    loss with ``split_edges`` (Megatron-Core's ``account_for_embedding_in_pipeline_split`` and
    ``account_for_loss_in_pipeline_split``). Ints or arrays (``split_edges`` a 0-1 weight)."""
    return n_layers + 2 * split_edges


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """Mixture-of-experts feed-forward: every layer's MLP is `experts` copies, `top_k` active."""

    experts: int
    top_k: int
    capacity_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer.

    GPT style: ``mlp="gelu"``, ``norm="layernorm"``, ``kv_heads == heads``, tied embeddings.
    Llama style: ``mlp="swiglu"``, ``norm="rmsnorm"``, grouped-query attention
    (``kv_heads < heads``), untied embeddings.
    """

    name: str
    n_layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    kv_heads: int
    seq_len: int
    vocab: int
    mlp: Mlp = "gelu"
    norm: Norm = "layernorm"
    tied_embeddings: bool = True
    bias: bool = True
    precision: Precision = "bf16"
    moe: MoeSpec | None = None
    attention: Attention = "cudnn"  # attention kernel (see ``Attention``)
    # hidden and attention dropout on: Megatron keeps their masks for backward (memory only);
    # Llama-family recipes train with both at 0
    dropout: bool = True
    # causal (decoder) self-attention: fused kernels skip the masked half of the scores; False
    # for an encoder (BERT), whose fused kernels compute the whole square
    causal: bool = True
    # fraction of a sample's tokens the LM head and loss run on: 1 for a language model; a
    # masked-LM head that gathers the masked positions first (BERT) runs on a fraction of them
    head_tokens: float = 1.0

    @property
    def flash_attention(self) -> bool:
        """Fused attention: no s x s scores in HBM, masked half of causal attention skipped."""
        return self.attention != "unfused"


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One accelerator: peak dense FLOP/s per precision, HBM bandwidth and capacity."""

    name: str
    peak_tflops: dict[str, float]  # precision -> dense TFLOP/s (10^12 FLOP/s)
    hbm_bandwidth_GBps: float  # 10^9 B/s
    memory_GiB: float  # 2^30 B


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """GPUs in nodes; an NVLink/NVSwitch domain per node; NICs into a fat-tree fabric."""

    name: str
    gpu: GpuSpec
    gpus_per_node: int
    nvlink_GBps: float  # per GPU, both directions added (datasheet convention)
    nvlink_latency_us: float
    nics_per_node: int
    nic_Gbps: float  # per NIC, one direction, 10^9 bit/s
    nic_latency_us: float
    oversubscription: float = 1.0  # fat-tree: bisection is divided by this
    # GPU <-> host memory link per GPU, both directions added (datasheet convention): PCIe 4.0
    # x16 (64 GB/s) unless a preset says otherwise; the path of CPU activation offloading
    host_link_GBps: float = 64.0
    # "switch": every GPU reaches any other at its full NVLink bandwidth (NVSwitch);
    # "mesh": one point-to-point link to each peer (AMD Infinity Fabric), so a group of k GPUs
    # in a node uses (k - 1) / (gpus_per_node - 1) of it; "cube-mesh": DGX-1's hybrid
    # cube-mesh of 8 V100 (see ``diffcost.topology``).
    intra_node: str = "switch"  # NVLink topology: a name in diffcost.topology.INTRA_NODE
    # the network as a graph (opt-in, ``diffcost.network.attach``): "" for none (the NVLink
    # ring-share table and ``oversubscription``), "cluster" for the graph this spec describes
    # (``generators.from_cluster``), or a ``configs/topologies`` preset name or YAML path
    topology: str = ""
    transport: str = "rdma"  # a name in TRANSPORTS
    description: str = ""


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """How the work is split.  ``n_gpus = dp * tp * pp * cp``; ``ep`` divides ``dp``.

    ``order`` lists the placed dimensions innermost first: the first one's ranks are adjacent
    on the topology (same node when it fits).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    zero: int = 0
    # Where ZeRO-2's sharded 16-bit parameters are gathered: "step", all of the stage's at once
    # after the optimizer step (DeepSpeed ZeRO-2); "layer", each layer's before its forward,
    # kept through its backward, whose gradients are reduce-scattered under it (PyTorch FSDP
    # ``SHARD_GRAD_OP``, FSDP2 without resharding after the forward)
    param_gather: ParamGather = "step"
    recompute: Recompute = "none"
    # Share of the layers ``recompute`` applies to; the others keep every activation (Megatron's
    # ``--recompute-method block --recompute-num-layers``, torchtitan's selective AC by layer)
    recompute_fraction: float = 1.0
    # Share of the layers whose saved activations are copied to host memory in the forward
    # and back in the backward (Megatron-Core's ``cpu_offloading`` with
    # ``cpu_offloading_num_layers`` / layers, activations only); 0 keeps them all on the GPU
    offload_fraction: float = 0.0
    microbatch: int = 1
    global_batch: int = 1
    schedule: Schedule = "1f1b"
    chunks: int = 1  # virtual pipeline stages per rank (interleaved schedule)
    # The embedding and the loss each take one layer's place in the pipeline split
    # (Megatron-Core's account_for_embedding_in_pipeline_split and _loss_): every stage has
    # ``(n_layers + 2) / pp`` places, so the first and the last run one layer fewer
    split_edges: bool = False
    overlap_dp: bool = True
    overlap_tp: bool = False
    # ZeRO 0-2 gradients are accumulated and reduced in fp32 (Megatron's main_grad with bf16);
    # False: in 16 bits (DeepSpeed and Megatron fp16). ZeRO-3 always reduces 16-bit ones.
    grad_reduce_fp32: bool = True
    order: tuple[str, ...] = ("tp", "cp", "dp", "pp")
    # LoRA fine-tuning (Hu et al. 2021): None trains every weight; a rank freezes the base
    # weights (no weight gradients, gradient buffers, optimizer state or gradient sync for
    # them) and trains rank-r adapters on ``lora_modules`` of every layer
    lora_rank: int | None = None
    lora_modules: LoraModules = "attention"
    # The implementation replays captured CUDA graphs (NVIDIA's MLPerf BERT, MXNet ResNet) or
    # runs one compiled program per step (a jitted JAX step): the host launches one graph or
    # program per step instead of dispatching every op, so there is no host time per op
    # (``Params.host_op_s``); each kernel's GPU-side time stays
    cuda_graphs: bool = False

    @property
    def n_gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def n_microbatches(self) -> float:
        return self.global_batch / (self.dp * self.microbatch)

    def fields_from(self, base: PlanSpec, always: tuple[str, ...] = ()) -> dict:
        """The fields that differ from ``base``'s, and those named in ``always``, in field
        order: what a config or its overrides must set to turn ``base`` into this plan."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name in always or getattr(self, f.name) != getattr(base, f.name)
        }


@dataclasses.dataclass(frozen=True)
class Experiment:
    """Model, cluster and plan together: what ``diffcost predict`` evaluates."""

    model: ModelSpec
    cluster: ClusterSpec
    plan: PlanSpec
    source: str = ""  # file it came from, for messages
    stack: str | None = None  # diffcost.stacks name of the training software (None: unknown)
