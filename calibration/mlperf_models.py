"""MLPerf rows the transformer core does not represent: ResNet-50, SSD and 3D U-Net (operator
graphs, data parallel) and DLRM-DCNv2 (embedding tables and an all-to-all, ``diffcost.dlrm_cost``).

* **ResNet-50** (``resnet``): NVIDIA's MXNet implementation (every ResNet row's framework cell
  names MXNet or NVIDIA's MLPerf containers; ``config_DGXH100*.sh`` of
  ``NVIDIA/benchmarks/resnet/implementations/mxnet``): ResNet-50 v1.5, 224x224, fp16 NHWC,
  pure data parallelism with Horovod (gradients all-reduced in 16 bits while the backward
  runs), per-GPU batch ``global_batch / (n_gpus * accumulation)``, LARS (taken as the
  optimizer traffic of ``Params.optimizer_bytes_per_param``). The graph is the zoo's flax
  ResNet-50 (``diffcost.zoo``) traced by ``from_jax`` in fp16 at that batch, priced by
  ``opgraph.data_parallel``. The backward recomputes the normalization and activations from
  the saved convolution outputs (``saves_products``), as fused batch-norm kernels do. Not
  represented: the kernel fusions themselves (convolution with batch-norm statistics,
  batch-norm with ReLU and the residual add) and CUDA-graph replay: the traced graph
  launches one kernel per fused group of XLA-fusible operators; the calibration's offsets on
  the memory-bound efficiency and the per-kernel time absorb the difference.
* **3D U-Net** (``unet3d``): NVIDIA's MXNet implementation, as ResNet-50: the zoo's
  ``UNet3D`` (the reference's model/unet3d.py) on 128^3 patches, fp16, data parallel at the
  row's per-GPU batch (7 on 8 GPUs). Rows with fewer samples than GPUs (72 and 768 GPUs at a
  global batch of 56 and 84) split samples spatially: not represented.
* **SSD** (``ssd``): NVIDIA's PyTorch implementation (every SSD row's framework cell names
  PyTorch or NVIDIA's MLPerf containers; ``config_DGXH100_*.sh`` of
  ``NVIDIA/benchmarks/ssd/implementations/pytorch``): the zoo's ``retinanet`` (the
  reference's RetinaNet, ResNeXt-50 32x4d, FPN P3-P7, 800x800, 264 classes; stem and first
  stage frozen, batch norm frozen) in fp16, data parallel with DDP at the row's per-GPU batch
  (``BATCHSIZE``: 32 on 8 H100, 1 on 2,528), priced like ResNet-50. Apex's fused Adam is taken
  as the optimizer traffic of ``Params.optimizer_bytes_per_param``. Not represented: the
  implementation's fused kernels (``--apex-backbone-fusion``, ``--apex-head-fusion``, frozen
  batch norm folded into the convolutions, the fused focal loss) and its CUDA graphs, as for
  ResNet-50; the losses and anchor matching are outside the graph.
* **DLRM-DCNv2** (``dlrm_dcnv2``): ``configs/dlrm/dlrm-dcnv2.yaml`` (the reference's 26 Criteo
  1TB multi-hot tables, dimension 128, DCNv2 3 x rank 512) at the row's global batch on its
  GPUs, priced by ``dlrm_cost`` under the sharding plan HugeCTR's planner picks
  (``dlrm_hugectr.plan``: ``auto`` on one node, ``hier_auto`` on several, as NVIDIA's configs).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from calibration.records import Source
from diffcost import zoo
from diffcost.dlrm import DlrmSpec, load_dlrm
from diffcost.dlrm_cost import ShardingPlan, make_problem, one_hot_plan
from diffcost.dlrm_hugectr import PlannerConfig
from diffcost.dlrm_hugectr import plan as hugectr_plan
from diffcost.opgraph import from_jax, graph_arrays
from diffcost.opgraph.pricing import GraphArrays
from diffcost.profiles import params_for
from diffcost.specs import ClusterSpec

# NVIDIA's MXNet ResNet and 3D U-Net and its PyTorch SSD train in fp16 (loss scaling) and
# all-reduce fp16 gradients
GRAPH_DTYPE = jnp.float16
GRAPH_GRAD_BYTES = 2
DLRM_PRESET = "dlrm-dcnv2"
# NVIDIA's HugeCTR trains DLRM-DCNv2 in mixed precision (USE_MIXED_PRECISION=true in every
# config_*.sh): its embedding collection then exchanges the pooled embeddings and their
# gradients in 16 bits (``emb_type`` and ``wgrad_type`` half in Model::add of the embedding
# collection) and Network::exchange_wgrad all-reduces the dense gradients as ncclHalf; the
# tables stay fp32.
DLRM_HUGECTR = {"exchange_bytes": 2, "grad_bytes": 2}
# Evaluation inside the logged DLRM throughput. The single ``tracked_stats`` report of a
# HugeCTR DLRM run is the samples trained over the whole run, run_start to run_stop, evaluations
# included (NVIDIA eos_ngc24.04_merlin_hugectr result_0: 0.79989 epoch x 4,195,197,692 samples in
# 243.13 s = 13.80M/s, the logged 13,802,270; QCT D54U-3U result_5: 0.69990 epoch in 2,349.6 s =
# 1.2500M/s, the logged 1,249,699). Every 0.05 epoch of the 4,195,197,692 training samples the
# run evaluates all 89,137,319 evaluation samples (the logged train_samples, eval_samples and
# eval_start epochs), forward only: 0.425 evaluated samples per trained one.
DLRM_TRAIN_SAMPLES = 4_195_197_692
DLRM_EVAL_SAMPLES = 89_137_319
DLRM_EVAL_EVERY_EPOCH = 0.05
DLRM_EVAL_PER_TRAIN = DLRM_EVAL_SAMPLES / (DLRM_EVAL_EVERY_EPOCH * DLRM_TRAIN_SAMPLES)
# HugeCTR planner settings of NVIDIA's v4.0 configs (merlin_hugectr/config_DGXH200_1x8x6912.sh
# and config_DGXH100_16x8x1056.sh: DP_SHARDING_THRESHOLD 0.008 on one node, 0.0125 on 16);
# their MEM_COMM_BW_RATIO (11, 67) is what ``dlrm_hugectr.cluster_bw_ratio`` computes.
DLRM_PLANNER_ONE_NODE = PlannerConfig(dp_threshold_gib=0.008)
DLRM_PLANNER_NODES = PlannerConfig(dp_threshold_gib=0.0125)


@dataclasses.dataclass(frozen=True)
class GraphRecord:
    """A data-parallel operator-graph run: the zoo model at ``local_batch`` per GPU."""

    benchmark: str
    zoo_model: str
    cluster: ClusterSpec
    n_gpus: int
    local_batch: int
    measured_iter_s: float
    source_name: str
    row: int
    defaults: tuple[str, ...]
    where: Source


@dataclasses.dataclass(frozen=True)
class DlrmRecord:
    """A DLRM run: ``spec`` (its ``batch_size`` the global batch) on ``n_gpus`` GPUs."""

    benchmark: str
    spec: DlrmSpec
    cluster: ClusterSpec
    n_gpus: int
    measured_iter_s: float
    source_name: str
    row: int
    defaults: tuple[str, ...]
    where: Source


def graph_record(
    row, cluster: ClusterSpec, used: list[str], row_no: int, zoo_model: str
) -> GraphRecord:
    """The row as a data-parallel run of ``zoo_model`` (``ValueError``: a batch that does not
    split evenly over the GPUs, as when an implementation splits samples spatially)."""
    local = row.global_batch / (row.n_gpus * row.grad_accumulation)
    if local != int(local):
        raise ValueError(
            f"global batch {row.global_batch} is not a multiple of {row.n_gpus} GPUs x "
            f"{row.grad_accumulation} accumulation steps (the implementation splits samples "
            "over GPUs: spatial parallelism is not represented)"
        )
    used += [f"zoo={zoo_model}", "precision=fp16", "dp=n_gpus", f"batch_per_gpu={int(local)}"]
    used.append("fp16 gradient all-reduce overlapped with the backward")
    return GraphRecord(
        row.benchmark,
        zoo_model,
        cluster,
        row.n_gpus,
        int(local),
        row.iter_s,
        f"mlperf_v4.0/{row.benchmark}",
        row_no,
        tuple(used),
        row.where,
    )


resnet_record = functools.partial(graph_record, zoo_model="resnet50")
unet3d_record = functools.partial(graph_record, zoo_model="unet3d")
ssd_record = functools.partial(graph_record, zoo_model="retinanet")


def dlrm_record(row, cluster: ClusterSpec, used: list[str], row_no: int) -> DlrmRecord:
    """The DLRM-DCNv2 row on its GPUs (``ValueError``: a batch the GPUs cannot share)."""
    if row.grad_accumulation != 1:
        raise ValueError(f"gradient accumulation {row.grad_accumulation} (DLRM runs 1)")
    if row.global_batch % row.n_gpus:
        raise ValueError(f"global batch {row.global_batch} is not a multiple of {row.n_gpus}")
    spec = load_dlrm(DLRM_PRESET, {"batch_size": row.global_batch, **DLRM_HUGECTR})
    used += [f"dlrm={DLRM_PRESET}", f"batch={row.global_batch}", "sharding=HugeCTR planner"]
    used.append("16-bit embedding exchange and gradient all-reduce (HugeCTR mixed precision)")
    used.append(
        f"measured step includes evaluation: {DLRM_EVAL_PER_TRAIN:.3f} forward-only samples "
        "per trained sample"
    )
    return DlrmRecord(
        row.benchmark,
        spec,
        cluster,
        row.n_gpus,
        row.iter_s,
        f"mlperf_v4.0/{row.benchmark}",
        row_no,
        tuple(used),
        row.where,
    )


def saves_products(primitive, *_, **__) -> bool:
    """``jax.checkpoint`` policy: keep only convolution and matrix-product outputs for the
    backward, recompute everything else. Fused batch-norm kernels (cuDNN's, as NVIDIA's MXNet
    ResNet uses) keep the convolution output and the per-channel statistics and recompute the
    normalization and activation in their backward, where autodiff of the unfused operators
    would store every intermediate."""
    return primitive.name in ("conv_general_dilated", "dot_general")


@functools.lru_cache(maxsize=32)
def zoo_graph_arrays(name: str, batch: int) -> GraphArrays:
    """``graph_arrays`` of zoo model ``name`` at ``batch`` samples per GPU, traced in fp16."""
    m = zoo.model(name, batch)

    def half(a):
        floating = jnp.issubdtype(a.dtype, jnp.floating)
        return jax.ShapeDtypeStruct(a.shape, GRAPH_DTYPE) if floating else a

    args = jax.tree.map(half, m.args)
    fn = jax.checkpoint(m.fn, policy=saves_products)
    return graph_arrays(from_jax(fn, *args, argnums=m.argnums))


@functools.lru_cache(maxsize=4)
def zoo_param_count(name: str) -> int:
    """Trained parameters of zoo model ``name``."""
    m = zoo.model(name, 1)
    return int(sum(x.size for i in m.argnums for x in jax.tree.leaves(m.args[i])))


def dlrm_problem_plan(record: DlrmRecord, dtype=None):
    """(problem, one-hot plan) of a DLRM record on its shipped profile: HugeCTR's planner's
    plan, its tables split into their shards."""
    params = params_for(record.cluster, dtype=dtype)[0]
    one_node = record.n_gpus <= record.cluster.gpus_per_node
    cfg = DLRM_PLANNER_ONE_NODE if one_node else DLRM_PLANNER_NODES
    spec, choices = hugectr_plan(record.spec, record.cluster, record.n_gpus, cfg)
    problem = make_problem(spec, record.cluster, record.n_gpus, params, dtype)
    plan: ShardingPlan = one_hot_plan(choices, problem.layout, dtype)
    return problem, plan
