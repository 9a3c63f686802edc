"""MLPerf Training v4.0 results (``shared/data/e2e/mlperf_training_v4.0.csv``) as training runs.

Two steps (column meanings in ``shared/data/README.md`` section 1b):

* ``read_mlperf_csv`` reads and checks every row into an ``MlperfRow``; malformed input raises
  ``ReaderError`` (``file:line: column 'x': ...`` with the value and what would be valid);
* ``to_record`` turns a row into an ``E2ERecord`` (model, plan, cluster, measured seconds per
  optimizer step) or raises ``NotRepresented`` with the reason: the transformer core represents
  BERT-large and Llama-2 70B LoRA; ResNet-50, SSD and 3D U-Net (operator graphs) and DLRM-DCNv2
  (embedding tables) become ``calibration.mlperf_models`` records; the GNN and Stable Diffusion
  have no model.

What the CSV leaves out and ``to_record`` assumes (each one listed in ``E2ERecord.defaults``):

* **BERT** (``bert``): NVIDIA's PyTorch implementation (every BERT row's framework cell names
  NVIDIA's PyTorch containers or just PyTorch; its ``config_DGXH100_*.sh``): pure data
  parallelism, fp16 with loss scaling (16-bit gradient all-reduce), fused attention, microbatch
  ``global_batch / (n_gpus * gradient_accumulation_steps)``. The phase-2 samples are up to 512
  tokens long, but the implementation removes the padding (``--unpad --unpad_fmha``): Krell et
  al., "Efficient sequence packing without cross-contamination" (2021), find that padding is
  over 50% of the tokens of this Wikipedia data at length 512, so a sample is taken as
  ``UNPADDED_SEQ_LEN`` = 256 tokens. The masked-LM head runs on the masked tokens only
  (``--dense_seq_output``): ``MASKED_FRACTION`` = 15% of them (BERT's masking rate; MLPerf's
  data generator masks 15%, at most 76 of 512), ``ModelSpec.head_tokens``. NVIDIA's BERT replays
  CUDA graphs (``PlanSpec.cuda_graphs``: no host dispatch per op).
* **Llama-2 70B LoRA** (``llama2_70b_lora``): NVIDIA's NeMo implementation (every row's
  gradient accumulation fits NeMo's configs), conf/megatron_gpt_peft_tuning_config.yaml:
  LoRA rank 16 on the attention projections, FP8 layers, sequence parallel, sequence 8,192,
  microbatch 1, pipeline 1, no recompute. Its ``global_batch = MINIBS * dp`` gives the model
  parallel size ``tp * cp = n_gpus * gradient_accumulation_steps / global_batch``; its configs
  put up to 4 of it in tp and the rest in cp (``config_DGXH100_8x8x1xtp4pp1cp2.sh``,
  ``config_DGXH200_1x8x2xtp2pp1cp1.sh``, ``config_L40S_16x4x2xtp4pp1cp2.sh``). A row's own
  tp/cp cells are used when they agree with that size. Tensor-parallel communication overlaps
  the GEMMs (``TP_COMM_OVERLAP=True`` in config_common.sh) except on L40S, whose configs turn
  it off.
* **SSD** (``ssd``): the logged throughput of NVIDIA's SSD is per GPU (``PER_GPU_THROUGHPUT``,
  checked against the epochs' logged durations), so a step takes ``iter_s / n_gpus``.
* The cluster preset comes from the accelerator and GPUs per node (``ACCELERATORS``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

from calibration.mlperf_models import (
    DlrmRecord,
    GraphRecord,
    dlrm_record,
    resnet_record,
    ssd_record,
    unet3d_record,
)
from calibration.records import CsvTable, E2ERecord, Measurements, ReaderError, Source
from diffcost import config
from diffcost.specs import PlanSpec

BENCHMARKS = (
    "resnet",
    "bert",
    "dlrm_dcnv2",
    "ssd",
    "unet3d",
    "llama2_70b_lora",
    "gnn",
    "stable_diffusion",
)
# Why the transformer core cannot represent the other benchmarks.
NOT_REPRESENTED = {
    "gnn": "R-GAT is a graph neural network with neighbour sampling: no model for it",
    "stable_diffusion": "Stable Diffusion v2 (U-Net, VAE, text encoder): no zoo model",
}
# Rows whose measured step is set by something outside the GPU work the model describes, with
# the evidence from their result logs (mlcommons/training_results_v4.0).
NOT_REPRESENTED_ROWS = {
    ("Quanta_Cloud_Technology", "D54U-3U", "dlrm_dcnv2"): (
        "the same GPU work runs at different speeds: result_0 trains 0.05 epoch (210M samples) "
        "in 60 s three times, then in 136-139 s from 0.15 epoch on (evaluations 10 s, then 23 "
        "s); result_5 takes 142 s for every 0.05 epoch; the runs' steps spread 38-45 ms (other "
        "DLRM rows: under 2%). Something outside the GPUs sets this step (HugeCTR's README asks "
        "for 13.4 GB/s of storage read bandwidth per 8-GPU node at full speed): not the model's"
    ),
}
REQUIRED = (
    "submitter",
    "system",
    "benchmark",
    "accelerator",
    "n_accelerators",
    "accelerators_per_node",
    "n_nodes",
    "global_batch_size",
    "samples_per_s",
    "iter_s_median",
    "notes",
)
# benchmarks priced outside the transformer core: row -> record (``calibration.mlperf_models``)
GRAPH_BENCHMARKS = {
    "resnet": resnet_record,
    "ssd": ssd_record,
    "unet3d": unet3d_record,
    "dlrm_dcnv2": dlrm_record,
}
# accelerator cell -> {GPUs per node: cluster preset}
ACCELERATORS = {
    "NVIDIA H100-SXM5-80GB": {8: "dgx-h100", 4: "hgx-h100-4gpu"},
    "NVIDIA H100-SXM-80GB": {8: "dgx-h100", 4: "hgx-h100-4gpu"},
    "NVIDIA H100-PCIe-80GB": {8: "pcie-h100", 4: "pcie-h100"},
    "NVIDIA H200-SXM5-141GB": {8: "dgx-h200"},
    # 14 of the 16 L40S of Fujitsu's composable PCIe domain (its 3D U-Net row)
    "NVIDIA L40S": {
        4: "pcie-l40s",
        8: "pcie-l40s-8gpu",
        14: "pcie-l40s-16gpu",
        16: "pcie-l40s-16gpu",
    },
    "NVIDIA A100-SXM4-80GB": {8: "selene-a100-80g"},
}
# benchmarks whose logged ``tracked_stats`` throughput is samples per second per GPU, not for
# the whole system: NVIDIA's SSD (engine.py) logs 289.8 on 8 H100 (eos_ngc24.04_pytorch,
# result_0.txt) while its epoch 1 runs 4,572 steps of 256 images in 504.9 s (2,318 images/s, 8 x
# 290), and 212.1 on 64 H100 (eos_n8) while an epoch takes 86.2 s (13,573 images/s, 64 x 212).
# The CSV's iter_s (global batch / throughput) is n_gpus times one step for these rows.
PER_GPU_THROUGHPUT = frozenset({"ssd"})
# tokens of one BERT phase-2 sample without padding: half of 512 (Krell et al. 2021: padding is
# over 50% of the tokens at length 512)
UNPADDED_SEQ_LEN = 256
# tokens the masked-LM head runs on: BERT masks 15% of the tokens (Devlin et al. 2019; the
# MLPerf reference's create_pretraining_data uses masked_lm_prob 0.15)
MASKED_FRACTION = 0.15
LORA_RANK = 16  # adapter_dim of NeMo's megatron_gpt_peft_tuning_config.yaml
LORA_MAX_TP = 4  # NVIDIA's LoRA configs use tp <= 4 and put the rest in cp
# relative tolerance of iter_s_median against global_batch_size / samples_per_s (the CSV
# derives one from the other and rounds both to 6-7 digits)
ITER_RTOL = 1e-3
_GA_RE = re.compile(r"gradient_accumulation_steps=(\d+)")


class NotRepresented(Exception):
    """A row the model cannot represent; the message says why."""


@dataclasses.dataclass(frozen=True)
class MlperfRow:
    """One system x benchmark row of the MLPerf CSV, checked."""

    where: Source
    submitter: str
    system: str
    benchmark: str
    accelerator: str
    n_gpus: int
    gpus_per_node: int
    global_batch: int
    grad_accumulation: int
    samples_per_s: float
    iter_s: float  # median over runs of one optimizer step
    tp: int | None
    pp: int | None
    cp: int | None
    microbatch: int | None


def _positive_int(table: CsvTable, row: dict, line: int, col: str) -> int | None:
    value = table.number(row, line, col, integer=True)
    if value is not None and value < 1:
        raise ReaderError(table.path, line, f"column '{col}': {value} is not a positive integer")
    return value


def _required(table: CsvTable, row: dict, line: int, col: str, integer: bool):
    value = _positive_int(table, row, line, col) if integer else table.number(row, line, col)
    if value is None:
        raise ReaderError(table.path, line, f"column '{col}' is blank (a number is required)")
    if value <= 0:
        raise ReaderError(table.path, line, f"column '{col}': {value} is not a positive number")
    return value


def _grad_accumulation(table: CsvTable, row: dict, line: int) -> int:
    m = _GA_RE.search(row["notes"])
    if not m or int(m.group(1)) < 1:
        raise ReaderError(
            table.path,
            line,
            f"column 'notes': {row['notes']!r} has no 'gradient_accumulation_steps=N' (N >= 1)",
        )
    return int(m.group(1))


def _check_row(table: CsvTable, line: int, r: MlperfRow, n_nodes: int) -> None:
    """Consistency of one row's numbers (the README's derivations)."""
    if r.n_gpus != n_nodes * r.gpus_per_node:
        raise ReaderError(
            table.path,
            line,
            f"column 'n_accelerators': {r.n_gpus} is not n_nodes * accelerators_per_node "
            f"= {n_nodes} * {r.gpus_per_node}",
        )
    expected = r.global_batch / r.samples_per_s
    if not math.isclose(r.iter_s, expected, rel_tol=ITER_RTOL):
        raise ReaderError(
            table.path,
            line,
            f"column 'iter_s_median': {r.iter_s} is not global_batch_size / samples_per_s "
            f"= {expected:.6g} (within {ITER_RTOL:.0e})",
        )


def _read_row(table: CsvTable, line: int, row: dict) -> MlperfRow:
    if row["benchmark"] not in BENCHMARKS:
        raise ReaderError(
            table.path,
            line,
            f"column 'benchmark': {row['benchmark']!r} is not one of {', '.join(BENCHMARKS)}",
        )
    ints = {c: _required(table, row, line, c, True) for c in REQUIRED[4:8]}
    out = MlperfRow(
        where=Source(table.path, line),
        submitter=row["submitter"],
        system=row["system"],
        benchmark=row["benchmark"],
        accelerator=row["accelerator"],
        n_gpus=ints["n_accelerators"],
        gpus_per_node=ints["accelerators_per_node"],
        global_batch=ints["global_batch_size"],
        grad_accumulation=_grad_accumulation(table, row, line),
        samples_per_s=_required(table, row, line, "samples_per_s", False),
        iter_s=_required(table, row, line, "iter_s_median", False),
        **{c: _positive_int(table, row, line, c) for c in ("tp", "pp", "cp", "microbatch")},
    )
    _check_row(table, line, out, ints["n_nodes"])
    return out


def read_mlperf_csv(path) -> list[MlperfRow]:
    """Every row of an MLPerf results CSV (schema of ``shared/data/README.md`` section 1b).

    Raises:
        ReaderError: a missing column, a cell that is not a valid number, an unknown
            benchmark, numbers that contradict the README's derivations, or notes without
            the gradient accumulation.
    """
    table = CsvTable(path, REQUIRED, "MLPerf results")
    return [_read_row(table, line, row) for line, row in table.rows()]


# --------------------------------------------------------------------------------------------
# Rows as training runs


def cluster_for(row: MlperfRow) -> str:
    """The cluster preset of a row's accelerator and GPUs per node."""
    presets = ACCELERATORS.get(row.accelerator)
    if presets is None:
        raise NotRepresented(f"no cluster preset for accelerator {row.accelerator!r}")
    if row.gpus_per_node not in presets:
        raise NotRepresented(
            f"no cluster preset for {row.gpus_per_node} x {row.accelerator} per node "
            f"(presets for {', '.join(map(str, presets))} per node)"
        )
    return presets[row.gpus_per_node]


def _bert(row: MlperfRow, used: list[str]):
    local = row.global_batch / (row.n_gpus * row.grad_accumulation)
    if local != int(local):
        raise NotRepresented(
            f"global batch {row.global_batch} is not a multiple of {row.n_gpus} GPUs x "
            f"{row.grad_accumulation} accumulation steps"
        )
    used += ["precision=fp16", "dp=n_gpus", "microbatch=global/(n_gpus*accumulation)"]
    used.append("cuda_graphs (no host dispatch per op)")
    used.append(f"seq_len={UNPADDED_SEQ_LEN} (unpadded)")
    used.append(f"head_tokens={MASKED_FRACTION} (masked-LM head on the masked tokens)")
    model = dataclasses.replace(
        config.load_model("bert-large"),
        precision="fp16",
        seq_len=UNPADDED_SEQ_LEN,
        head_tokens=MASKED_FRACTION,
    )
    plan = PlanSpec(
        dp=row.n_gpus,
        microbatch=int(local),
        global_batch=row.global_batch,
        grad_reduce_fp32=False,
        cuda_graphs=True,
    )
    return model, plan, None


def _lora_degrees(row: MlperfRow, used: list[str]) -> tuple[int, int]:
    """(tp, cp) of a Llama-2 70B LoRA row (see the module docstring)."""
    size = row.n_gpus * row.grad_accumulation / row.global_batch
    if size != int(size) or size < 1:
        raise NotRepresented(
            f"n_gpus * accumulation / global batch = {row.n_gpus} * {row.grad_accumulation} / "
            f"{row.global_batch} is not a whole model-parallel size"
        )
    size = int(size)
    if row.tp and row.tp * (row.cp or 1) == size:
        return row.tp, row.cp or 1
    tp = min(size, LORA_MAX_TP)
    if size % tp:
        raise NotRepresented(f"model-parallel size {size} is not a multiple of tp {tp}")
    if row.tp:
        used.append(f"tp={tp},cp={size // tp} (the row's tp={row.tp} cp={row.cp} contradict")
        used[-1] += f" its accumulation, {row.grad_accumulation})"
    else:
        used.append(f"tp={tp},cp={size // tp} (from the accumulation)")
    return tp, size // tp


def _llama_lora(row: MlperfRow, cluster: str, used: list[str]):
    tp, cp = _lora_degrees(row, used)
    used += ["precision=fp8", f"lora_rank={LORA_RANK}", "microbatch=1", "pp=1", "sp"]
    model = dataclasses.replace(config.load_model("llama2-70b-lora"), precision="fp8")
    overlap = not cluster.startswith("pcie-l40s")
    plan = PlanSpec(
        tp=tp,
        cp=cp,
        dp=row.n_gpus // (tp * cp),
        sequence_parallel=tp > 1,
        microbatch=1,
        global_batch=row.global_batch,
        overlap_tp=overlap and tp > 1,
        lora_rank=LORA_RANK,
        lora_modules="attention",
    )
    return model, plan, "megatron-core"


def to_record(row: MlperfRow, row_no: int = 0) -> E2ERecord | GraphRecord | DlrmRecord:
    """The row as a training run on its cluster preset (assumptions in ``defaults``).

    Raises:
        NotRepresented: a benchmark, accelerator or batch layout the model cannot represent,
            or a row of ``NOT_REPRESENTED_ROWS``.
    """
    if row.benchmark in NOT_REPRESENTED:
        raise NotRepresented(NOT_REPRESENTED[row.benchmark])
    if (row.submitter, row.system, row.benchmark) in NOT_REPRESENTED_ROWS:
        raise NotRepresented(NOT_REPRESENTED_ROWS[row.submitter, row.system, row.benchmark])
    cluster_name = cluster_for(row)
    used: list[str] = [f"cluster={cluster_name}"]
    if row.benchmark in PER_GPU_THROUGHPUT:
        row = dataclasses.replace(
            row, samples_per_s=row.samples_per_s * row.n_gpus, iter_s=row.iter_s / row.n_gpus
        )
        used.append("iter_s / n_gpus (the log's throughput is per GPU)")
    if row.benchmark in GRAPH_BENCHMARKS:
        try:
            return GRAPH_BENCHMARKS[row.benchmark](
                row, config.load_cluster(cluster_name), used, row_no
            )
        except ValueError as e:
            raise NotRepresented(str(e)) from None
    if row.benchmark == "bert":
        model, plan, stack = _bert(row, used)
    else:
        model, plan, stack = _llama_lora(row, cluster_name, used)
    cluster = config.load_cluster(cluster_name)
    problems = config.check_plan(model, cluster, plan, n_gpus=row.n_gpus, strict=False)
    if problems:
        raise NotRepresented("; ".join(problems))
    return E2ERecord(
        model,
        plan,
        cluster,
        row.iter_s,
        f"mlperf_v4.0/{row.benchmark}",
        row_no,
        tuple(used),
        row.where,
        stack,
    )


def load(path) -> tuple[list[MlperfRow], Measurements]:
    """The rows of ``path`` and, as ``Measurements``, the runs they represent (``e2e``, in
    row order) and the rows they cannot (``skipped``, with the reason)."""
    rows = read_mlperf_csv(path)
    out = Measurements()
    for i, row in enumerate(rows, start=1):
        try:
            out.e2e.append(to_record(row, i))
        except NotRepresented as e:
            out.skipped.append((row.where, f"{row.benchmark}: {e}"))
    return rows, out


def default_path() -> Path:
    """The shared data file, from this checkout (``../shared/data`` beside the repository)."""
    root = Path(__file__).resolve().parents[1]
    return root.parent / "shared" / "data" / "e2e" / "mlperf_training_v4.0.csv"
