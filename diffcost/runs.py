"""Measured training runs: the end-to-end CSV schema and a row's simulator specs.

The schema is that of ``shared/data/README.md`` section 1. Blank cells mean "the source did not
say"; :func:`row_to_specs` fills them with the defaults a practitioner would assume for that
framework (``FRAMEWORK_DEFAULTS``) and lists every filled value, or raises :class:`RowSkipped`
with the reason when the row cannot be represented. ``diffcost.validate`` predicts such rows;
``calibration.readers`` turns them into fitting records.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
from collections.abc import Iterator

from diffcost import config as config_mod
from diffcost.specs import Attention, ClusterSpec, ModelSpec, PlanSpec, pipeline_places

# Vocabulary of a model family when the source does not give it.  Nemotron-3 and -4 use a
# 256k SentencePiece vocabulary (NeMo's reported TFLOP/s for its Nemotron runs imply it).
VOCAB_DEFAULTS = (
    ("llama3", 128256),
    ("llama-3", 128256),
    ("llama2", 32000),
    ("llama-2", 32000),
    ("nemotron", 256000),
)
GPT2_VOCAB = 50257


@dataclasses.dataclass(frozen=True)
class FrameworkDefaults:
    """What a framework does when a run's description leaves it out."""

    sequence_parallel: bool  # with tp > 1
    zero: int
    recompute: str
    attention: Attention
    overlap_dp: bool
    overlap_tp: bool  # with tp > 1
    grad_reduce_fp32: bool = True  # ZeRO 0-2 gradients in fp32 (else 16-bit)
    # What a run's "selective" recompute is in this stack: (mode, share of the layers)
    selective: tuple[str, float] = ("selective", 1.0)
    # Where its ZeRO-2 gathers the parameters (``PlanSpec.param_gather``)
    param_gather: str = "step"
    # Layers that do not split evenly over the pipeline stages split evenly with the embedding
    # and the loss counted as a layer each (``PlanSpec.split_edges``)
    split_edges: bool = False
    # The host launches one program per step, not every op (``PlanSpec.cuda_graphs``)
    cuda_graphs: bool = False


# Megatron-Core builds the same number of layers on every virtual stage (it asserts that they
# divide, megatron/core/transformer/transformer_block.py get_num_layers_to_build); a model whose
# layers do not, such as Llama 3.1 405B (126 layers) on 8 x 4 or 16 x 8 virtual stages, runs
# with account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split, as
# Megatron-Bridge's 405B recipe sets them (recipes/llama/llama31_405b.py, llama3.py).
_MCORE = FrameworkDefaults(True, 1, "none", "cudnn", True, True, split_edges=True)
FRAMEWORK_DEFAULTS = {
    # Megatron-Core based (NeMo, Megatron-Bridge, Megatron-LM examples): SP on with tp > 1,
    # distributed optimizer, TE's cuDNN fused attention, overlapped grad reduce and TP comm
    # overlap.
    "NeMo": _MCORE,
    # Megatron-Bridge's performance recipes, which its published runs used, reduce gradients in
    # bf16 (scripts/performance/configs/llama/llama3*_llm_pretrain.py: set_llama3_common_configs
    # and set_llama31_common_configs set ddp.grad_reduce_in_fp32 = False).
    "Megatron-Bridge": dataclasses.replace(_MCORE, grad_reduce_fp32=False),
    "Megatron-Core": _MCORE,
    # Megatron-DeepSpeed (vTrain): no SP, no distributed optimizer, unfused softmax attention;
    # vTrain's configs say use_gradient_bucket=false (no overlapped gradient reduction), and its
    # simulator all-reduces 2-byte gradients of an fp16 model (src/predictor.py).
    "Megatron-DeepSpeed": FrameworkDefaults(False, 0, "full", "unfused", False, False, False),
    # Megatron-LM v1 trained in fp16 and all-reduced fp16 gradients (fp32 only on request).
    "Megatron-LM v1.0": FrameworkDefaults(False, 0, "none", "unfused", True, False, False),
    # PyTorch FSDP stacks. llm-foundry's MPT configs (scripts/train/yamls/pretrain/mpt-*.yaml,
    # which its benchmark tables ran) set ``attn_impl: triton``: FlashAttention in Triton, the
    # kernel that carried MPT's ALiBi bias. torchtitan: FlashAttention-2 through PyTorch SDPA.
    # torchtitan's selective activation checkpointing (torchtitan/parallelisms/
    # parallelize_llama.py) either checkpoints every second transformer block whole (by layer,
    # ``selective_ac_option: 2``) or, by op, keeps the matmul and attention outputs except every
    # second matmul and recomputes the rest; both replay about half of a block's forward, so it
    # is full recompute on half the layers, not Megatron's attention-core recompute.
    # Their ZeRO-2 is FSDP's SHARD_GRAD_OP (FSDP2: no resharding after the forward): each
    # unit's parameters are gathered before its forward and kept for its backward.
    "llm-foundry": FrameworkDefaults(False, 3, "none", "triton", True, False, param_gather="layer"),
    "torchtitan": FrameworkDefaults(
        False, 3, "none", "flash", True, False, True, ("full", 0.5), param_gather="layer"
    ),
    "Alpa": FrameworkDefaults(False, 0, "none", "unfused", True, False),
    # JAX (after "Alpa", whose cells also say JAX): cuDNN's fused attention, which
    # ``jax.nn.dot_product_attention(implementation="cudnn")`` runs on NVIDIA GPUs, as
    # ``benchmarks/gpu_measure.py``'s training steps do; a jitted step is one compiled XLA
    # program, whose kernels XLA's runtime launches with no Python dispatch per op.
    "JAX": FrameworkDefaults(False, 0, "none", "cudnn", True, False, cuda_graphs=True),
}
GENERIC_DEFAULTS = FrameworkDefaults(False, 0, "none", "flash", True, False)
# Recompute a framework's own configs use for a model family, where that differs from the
# framework's default: NeMo's GPT-3 performance configs (NeMo-Framework-Launcher
# conf/training/gpt3/{5b,20b,175b}_fp8_performance.yaml) checkpoint the attention core
# ("selective"); its Llama and Nemotron configs recompute nothing.
FAMILY_RECOMPUTE = (("NeMo", "gpt3", "selective"),)
# Layers whose activations a framework's own recipe offloads to host memory (Megatron-Core
# ``cpu_offloading``), keyed by (framework, model, cluster preset, precision, tp, microbatch)
# of its Megatron-FSDP (ZeRO-3) configuration. Megatron-Bridge's performance presets pair
# ``use_megatron_fsdp=True`` with ``cpu_offloading_num_layers`` on GB200 and GB300, which its
# helpers turn into cpu_offloading=True, cpu_offloading_weights=False (activations only):
# scripts/performance/configs/llama3/workload_base_configs.py, later
# configs/llama/llama3_workload_base_configs.py and the flat perf recipes (70B: GB200 FP8-CS
# 40 layers at microbatch 2, BF16 20; GB300 FP8-CS 20, BF16 30), and
# configs/llama31/workload_base_configs.py (405B at tp 2: GB200 FP8-CS 95 of 126 layers,
# 92 in later recipes; GB300 FP8-CS 10, BF16 40). Their H100 and B200 FSDP runs offload nothing.
RECIPE_OFFLOAD = {
    ("Megatron-Bridge", "llama3_70b", "dgx-gb200-nvl72", "fp8", 1, 2): 40,
    ("Megatron-Bridge", "llama3_70b", "dgx-gb200-nvl72", "bf16", 1, 1): 20,
    ("Megatron-Bridge", "llama3_70b", "dgx-gb300-nvl72", "fp8", 1, 2): 20,
    ("Megatron-Bridge", "llama3_70b", "dgx-gb300-nvl72", "bf16", 1, 2): 30,
    ("Megatron-Bridge", "llama3.1_405b", "dgx-gb200-nvl72", "fp8", 2, 1): 95,
    ("Megatron-Bridge", "llama3.1_405b", "dgx-gb300-nvl72", "fp8", 2, 1): 10,
    ("Megatron-Bridge", "llama3.1_405b", "dgx-gb300-nvl72", "bf16", 2, 1): 40,
}


# Columns an end-to-end CSV must have (their cells may be blank: "the source did not say");
# the calibration reader (calibration.readers.read_e2e_csv) requires the same ones. Other
# columns of the schema (ffn_hidden, kv_heads, vocab, dp, cp, ep, sp, zero, ...) may be absent.
E2E_COLUMNS = (
    "source",
    "model",
    "cluster",
    "measured_iter_s",
    "n_layers",
    "hidden",
    "heads",
    "seq_len",
    "n_gpus",
    "tp",
    "pp",
    "microbatch",
    "global_batch",
)
# Numeric columns: a non-blank cell must be a finite number, in E2E_INT_COLUMNS an integer.
E2E_INT_COLUMNS = (
    "n_layers",
    "hidden",
    "ffn_hidden",
    "heads",
    "kv_heads",
    "seq_len",
    "vocab",
    "n_gpus",
    "gpus_per_node",
    "tp",
    "pp",
    "dp",
    "cp",
    "ep",
    "sp",
    "zero",
    "microbatch",
    "global_batch",
    "interleave_chunks",
)
E2E_FLOAT_COLUMNS = (
    "measured_iter_s",
    "measured_tflops_per_gpu",
    "peer_predicted_iter_s",
    "measured_peak_mem_gib",
)
# Optional columns whose non-blank cells must be positive (a memory peak of 0 is no measurement).
E2E_POSITIVE_COLUMNS = ("measured_peak_mem_gib",)


def _framework_key(framework: str) -> str | None:
    """The first ``FRAMEWORK_DEFAULTS`` key named in a row's framework cell (None: unknown)."""
    return next((key for key in FRAMEWORK_DEFAULTS if key.lower() in framework.lower()), None)


def _int(row, key) -> int | None:
    v = row.get(key, "").strip()
    return int(float(v)) if v else None


class RowSkipped(Exception):
    """A row the simulator cannot represent; the message says why."""


def _cell_or(row: dict, key: str, default, note: str, used: list[str]):
    """The integer in ``row[key]``, or ``default`` (noting ``note`` in ``used``) when blank."""
    value = _int(row, key)
    if value is None:
        used.append(note)
        return default
    return value


def _cluster(row: dict, cluster_cache: dict) -> ClusterSpec:
    name = row.get("cluster", "").strip()
    if name not in cluster_cache:
        try:
            cluster_cache[name] = config_mod.load_cluster(name)
        except config_mod.ConfigError as e:
            cluster_cache[name] = e
    cluster = cluster_cache[name]
    if isinstance(cluster, Exception):
        raise RowSkipped(f"no cluster preset '{name}'")
    return cluster


def _shape(row: dict) -> dict[str, int]:
    shape = {k: _int(row, k) for k in ("n_layers", "hidden", "heads", "seq_len")}
    missing = [k for k, v in shape.items() if v is None]
    if missing:
        raise RowSkipped(f"architecture not given by the source: {', '.join(missing)}")
    return shape


def _model_spec(row: dict, shape: dict, cluster: ClusterSpec, fw: FrameworkDefaults, used):
    name = row.get("model", "")
    lname = name.lower().replace(" ", "")
    ffn = _cell_or(row, "ffn_hidden", 4 * shape["hidden"], "ffn_hidden=4*hidden", used)
    kv = _cell_or(row, "kv_heads", shape["heads"], "kv_heads=heads", used)
    vocab = next((v for key, v in VOCAB_DEFAULTS if key in lname), GPT2_VOCAB)
    vocab = _cell_or(row, "vocab", vocab, f"vocab={vocab}", used)
    precision = row.get("precision", "").strip()
    if not precision:
        precision = "bf16" if "bf16" in cluster.gpu.peak_tflops else "fp16"
        used.append(f"precision={precision}")
    if precision not in cluster.gpu.peak_tflops:
        have = ", ".join(sorted(cluster.gpu.peak_tflops))
        raise RowSkipped(f"precision {precision} has no peak on {cluster.name} (has: {have})")
    llama = "llama" in lname
    untied = llama or "nemotron" in lname  # Nemotron: separate output matrix, no biases
    # Llama and Nemotron recipes train without dropout, and so do MPT's (llm-foundry's config
    # defaults: resid, attention and embedding dropout 0)
    dropout = not (untied or "mpt" in lname)
    used.append(f"attention={fw.attention}")
    return ModelSpec(
        name=name,
        n_layers=shape["n_layers"],
        hidden=shape["hidden"],
        ffn_hidden=ffn,
        heads=shape["heads"],
        kv_heads=kv,
        seq_len=shape["seq_len"],
        vocab=vocab,
        mlp="swiglu" if llama else "gelu",
        norm="rmsnorm" if llama else "layernorm",
        tied_embeddings=not untied,
        bias=not (untied or "mpt" in lname),
        precision=precision,
        attention=fw.attention,
        dropout=dropout,
    )


def _recompute(row: dict, model: ModelSpec, fw_key: str | None, used: list[str]) -> str:
    recompute = row.get("recompute", "").strip()
    if recompute:
        return recompute
    lname = model.name.lower().replace(" ", "")
    recompute = next(
        (r for key, fam, r in FAMILY_RECOMPUTE if key == fw_key and lname.startswith(fam)),
        FRAMEWORK_DEFAULTS.get(fw_key, GENERIC_DEFAULTS).recompute,
    )
    used.append(f"recompute={recompute}")
    return recompute


def _offload(row: dict, model: ModelSpec, fw_key: str | None, zero: int, used) -> float:
    """Share of the layers the framework's recipe offloads (``RECIPE_OFFLOAD``; FSDP only)."""
    key = (fw_key, model.name.lower(), row.get("cluster", "").strip(), model.precision)
    layers = RECIPE_OFFLOAD.get((*key, _int(row, "tp") or 1, _int(row, "microbatch")))
    if zero != 3 or not layers:
        return 0.0
    used.append(f"activations of {layers} of {model.n_layers} layers offloaded to host memory")
    return layers / model.n_layers


def _plan_spec(row: dict, model: ModelSpec, fw_key: str | None, used: list[str]) -> PlanSpec:
    fw = FRAMEWORK_DEFAULTS.get(fw_key, GENERIC_DEFAULTS)
    degrees = {k: _int(row, k) or 1 for k in ("tp", "pp", "cp", "ep")}
    tp, pp, cp = degrees["tp"], degrees["pp"], degrees["cp"]
    n_gpus = _int(row, "n_gpus")
    dp = _int(row, "dp") or (n_gpus // (tp * pp * cp) if n_gpus else None)
    mb, gb = _int(row, "microbatch"), _int(row, "global_batch")
    if dp is None or mb is None or gb is None:
        raise RowSkipped("data-parallel size, microbatch or global batch not given")
    if n_gpus is not None and dp * tp * pp * cp != n_gpus:
        raise RowSkipped(f"dp*tp*pp*cp = {dp * tp * pp * cp} differs from n_gpus = {n_gpus}")
    sp_cell = row.get("sp", "").strip()
    if sp_cell:
        sp = sp_cell == "1"
    else:
        sp = fw.sequence_parallel and tp > 1
        used.append(f"sequence_parallel={sp}")
    zero = _cell_or(row, "zero", fw.zero, f"zero={fw.zero}", used)
    recompute, recompute_fraction = _recompute(row, model, fw_key, used), 1.0
    if recompute == "selective" and fw.selective != ("selective", 1.0):
        recompute, recompute_fraction = fw.selective
        used.append(f"selective recompute as {recompute} on {recompute_fraction:g} of the layers")
    chunks = _cell_or(row, "interleave_chunks", 1, "interleave_chunks=1", used)
    used.append(f"overlap_dp={fw.overlap_dp}")
    param_gather = fw.param_gather if zero == 2 else "step"
    if param_gather != "step":
        used.append(f"param_gather={param_gather} (ZeRO-2 as FSDP SHARD_GRAD_OP)")
    if not fw.grad_reduce_fp32 and zero < 3:
        used.append("grad_reduce_fp32=False")
    if fw.cuda_graphs:
        used.append("cuda_graphs (one program per step: no host dispatch per op)")
    if n_micro := gb / (dp * mb):
        if abs(n_micro - round(n_micro)) > 1e-9:
            used.append(f"microbatches={n_micro:.3g} (fractional: global batch not divisible)")
    stages, uneven = pp * chunks, model.n_layers % (pp * chunks) != 0
    split_edges = (
        uneven and fw.split_edges and pp > 1 and pipeline_places(model.n_layers) % stages == 0
    )
    if split_edges:
        used.append(f"split_edges ({model.n_layers} layers + embedding + loss on {stages} stages)")
    elif uneven:
        used.append(f"layers per stage={model.n_layers / stages:.3g} (uneven split)")
    return PlanSpec(
        **degrees,
        dp=dp,
        sequence_parallel=sp,
        zero=zero,
        param_gather=param_gather,
        recompute=recompute,
        recompute_fraction=recompute_fraction,
        offload_fraction=_offload(row, model, fw_key, zero, used),
        microbatch=mb,
        global_batch=gb,
        schedule="interleaved" if chunks > 1 else "1f1b",
        chunks=chunks,
        split_edges=split_edges,
        overlap_dp=fw.overlap_dp,
        overlap_tp=fw.overlap_tp and tp > 1,
        grad_reduce_fp32=fw.grad_reduce_fp32,
        cuda_graphs=fw.cuda_graphs,
    )


def row_to_specs(
    row: dict, cluster_cache: dict
) -> tuple[ModelSpec, PlanSpec, ClusterSpec, list[str]]:
    """The simulator's specs of one end-to-end CSV row.

    Args:
        row: ``{column: stripped cell}`` as :func:`read_rows` returns it.
        cluster_cache: preset name -> loaded ``ClusterSpec`` (or the error loading it), shared
            between the rows of one file.

    Returns:
        (model, plan, cluster, the defaults filled in for blank cells, in column order).

    Raises:
        RowSkipped: the row cannot be represented (missing shape, unknown cluster, invalid
            plan, ...); the message says why.
    """
    used: list[str] = []
    fw_key = _framework_key(row.get("framework", ""))
    fw = FRAMEWORK_DEFAULTS.get(fw_key, GENERIC_DEFAULTS)
    shape = _shape(row)
    cluster = _cluster(row, cluster_cache)
    model = _model_spec(row, shape, cluster, fw, used)
    plan = _plan_spec(row, model, fw_key, used)
    problems = config_mod.check_plan(model, cluster, plan, n_gpus=_int(row, "n_gpus"), strict=False)
    if problems:
        raise RowSkipped("; ".join(problems))
    return model, plan, cluster, used


def number_error(text: str, integer: bool, positive: bool = False) -> str | None:
    """Why a numeric cell is unreadable, or None when it is a finite number (an integer if
    ``integer``, above 0 if ``positive``)."""
    try:
        value = float(text)
    except ValueError:
        return f"not a number: {text!r}"
    if not math.isfinite(value):
        return f"not a finite number: {text!r}"
    if integer and value != int(value):
        return f"not an integer: {text!r}"
    if positive and value <= 0:
        return f"not a positive number: {text!r}"
    return None


class CsvLineError(ValueError):
    """A CSV row that cannot be read: its first ``line`` and why (callers add the file)."""

    def __init__(self, line: int, message: str):
        self.line, self.message = line, message
        super().__init__(f"line {line}: {message}")


def data_rows(reader, n_columns: int) -> Iterator[tuple[int, list[str]]]:
    """(first line, cells) of every row of a ``csv.reader`` past its header that has a
    non-blank cell.

    Raises:
        CsvLineError: a row with another number of cells than ``n_columns``, or bad CSV.
    """
    line = reader.line_num + 1
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise CsvLineError(line, f"bad CSV: {e}") from None
        start, line = line, reader.line_num + 1
        if not any(c.strip() for c in cells):
            continue
        if len(cells) != n_columns:
            raise CsvLineError(start, f"{len(cells)} cells, the header has {n_columns}")
        yield start, cells


def read_rows(path: str | os.PathLike) -> list[dict]:
    """Data rows of an end-to-end measurement CSV, as ``{column: stripped cell}``.

    Rows whose cells are all blank are left out. Blank cells stay blank (``row_to_specs``
    fills them); a numeric cell that holds something else is an error.

    Args:
        path: CSV in the schema of ``shared/data/README.md`` section 1.

    Returns:
        One dict per data row, in file order.

    Raises:
        ValueError: naming the file and line: an empty file, missing ``E2E_COLUMNS``, no data
            rows, a row with more or fewer cells than the header, or a cell of
            ``E2E_INT_COLUMNS`` / ``E2E_FLOAT_COLUMNS`` that is not a finite number (integer;
            positive in ``E2E_POSITIVE_COLUMNS``).
    """
    with open(path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.reader(fh)
        header = next(reader, [])
        blank = not any(h.strip() for h in header)
        if blank and not any(any(c.strip() for c in cells) for cells in reader):
            raise ValueError(f"{path}: the file is empty (expected a CSV header)")
        header = [h.strip() for h in header]
        missing = [c for c in E2E_COLUMNS if c not in header]
        if missing:
            raise ValueError(f"{path}: line 1: missing columns {missing}")
        rows = []
        try:
            for start, cells in data_rows(reader, len(header)):
                row = {k: v.strip() for k, v in zip(header, cells)}
                for col in (*E2E_INT_COLUMNS, *E2E_FLOAT_COLUMNS):
                    kind = (col in E2E_INT_COLUMNS, col in E2E_POSITIVE_COLUMNS)
                    if row.get(col) and (why := number_error(row[col], *kind)):
                        raise CsvLineError(start, f"column '{col}': {why}")
                rows.append(row)
        except CsvLineError as e:
            raise ValueError(f"{path}: {e}") from None
    if not rows:
        raise ValueError(f"{path}: no data rows (only a header)")
    return rows
