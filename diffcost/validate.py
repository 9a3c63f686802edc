"""Validate predictions against measured runs (CSV in the schema of shared/data/README.md).

Blank cells mean "the source did not say". They are filled with the defaults a practitioner
would assume for that framework (``FRAMEWORK_DEFAULTS`` and ``_fill_defaults``), and every
filled value is reported per row. Rows that still cannot be represented, and rows without a
positive measured time, are listed with the reason, never dropped silently or counted in the
errors.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from diffcost import config as config_mod
from diffcost.arrays import cluster_arrays, model_arrays, plan_arrays, stack
from diffcost.params import Params
from diffcost.simulate import simulate
from diffcost.specs import Attention, ModelSpec, PlanSpec

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


_MCORE = FrameworkDefaults(True, 1, "none", "cudnn", True, True)
FRAMEWORK_DEFAULTS = {
    # Megatron-Core based (NeMo, Megatron-Bridge, Megatron-LM examples): SP on with tp > 1,
    # distributed optimizer, TE's cuDNN fused attention, overlapped grad reduce and TP comm
    # overlap.
    "NeMo": _MCORE,
    "Megatron-Bridge": _MCORE,
    "Megatron-Core": _MCORE,
    # Megatron-DeepSpeed (vTrain): no SP, no distributed optimizer, unfused softmax attention;
    # vTrain's configs say use_gradient_bucket=false (no overlapped gradient reduction), and its
    # simulator all-reduces 2-byte gradients of an fp16 model (src/predictor.py).
    "Megatron-DeepSpeed": FrameworkDefaults(False, 0, "full", "unfused", False, False, False),
    # Megatron-LM v1 trained in fp16 and all-reduced fp16 gradients (fp32 only on request).
    "Megatron-LM v1.0": FrameworkDefaults(False, 0, "none", "unfused", True, False, False),
    # PyTorch FSDP stacks: FlashAttention-2 (llm-foundry's flash-attn, PyTorch SDPA).
    "llm-foundry": FrameworkDefaults(False, 3, "none", "flash", True, False),
    "torchtitan": FrameworkDefaults(False, 3, "none", "flash", True, False),
    "Alpa": FrameworkDefaults(False, 0, "none", "unfused", True, False),
}
GENERIC_DEFAULTS = FrameworkDefaults(False, 0, "none", "flash", True, False)
# Recompute a framework's own configs use for a model family, where that differs from the
# framework's default: NeMo's GPT-3 performance configs (NeMo-Framework-Launcher
# conf/training/gpt3/{5b,20b,175b}_fp8_performance.yaml) checkpoint the attention core
# ("selective"); its Llama and Nemotron configs recompute nothing.
FAMILY_RECOMPUTE = (("NeMo", "gpt3", "selective"),)


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
E2E_FLOAT_COLUMNS = ("measured_iter_s", "measured_tflops_per_gpu", "peer_predicted_iter_s")


@dataclasses.dataclass
class RowResult:
    row: int  # 1-based data row
    source: str
    model: str
    cluster: str
    measured_iter_s: float | None
    predicted_iter_s: float | None = None
    ape_pct: float | None = None
    status: str | None = None
    skipped: str | None = None
    defaults: list[str] = dataclasses.field(default_factory=list)


def _framework_key(framework: str) -> str | None:
    """The first ``FRAMEWORK_DEFAULTS`` key named in a row's framework cell (None: unknown)."""
    return next((key for key in FRAMEWORK_DEFAULTS if key.lower() in framework.lower()), None)


def _int(row, key) -> int | None:
    v = row.get(key, "").strip()
    return int(float(v)) if v else None


class _Skip(Exception):
    pass


def _row_to_specs(row: dict, cluster_cache: dict) -> tuple[ModelSpec, PlanSpec, object, list[str]]:
    """(model, plan, cluster, defaults used) for one CSV row, or raise _Skip(reason)."""
    used: list[str] = []
    name = row.get("model", "")
    lname = name.lower().replace(" ", "")
    fw_key = _framework_key(row.get("framework", ""))
    fw = FRAMEWORK_DEFAULTS.get(fw_key, GENERIC_DEFAULTS)
    shape = {k: _int(row, k) for k in ("n_layers", "hidden", "heads", "seq_len")}
    missing = [k for k, v in shape.items() if v is None]
    if missing:
        raise _Skip(f"architecture not given by the source: {', '.join(missing)}")
    cname = row.get("cluster", "").strip()
    if cname not in cluster_cache:
        try:
            cluster_cache[cname] = config_mod.load_cluster(cname)
        except config_mod.ConfigError as e:
            cluster_cache[cname] = e
    cluster = cluster_cache[cname]
    if isinstance(cluster, Exception):
        raise _Skip(f"no cluster preset '{cname}'")

    ffn = _int(row, "ffn_hidden")
    if ffn is None:
        ffn = 4 * shape["hidden"]
        used.append("ffn_hidden=4*hidden")
    kv = _int(row, "kv_heads")
    if kv is None:
        kv = shape["heads"]
        used.append("kv_heads=heads")
    vocab = _int(row, "vocab")
    if vocab is None:
        vocab = next((v for key, v in VOCAB_DEFAULTS if key in lname), GPT2_VOCAB)
        used.append(f"vocab={vocab}")
    precision = row.get("precision", "").strip()
    if not precision:
        precision = "bf16" if "bf16" in cluster.gpu.peak_tflops else "fp16"
        used.append(f"precision={precision}")
    if precision not in cluster.gpu.peak_tflops:
        have = ", ".join(sorted(cluster.gpu.peak_tflops))
        raise _Skip(f"precision {precision} has no peak on {cname} (has: {have})")
    llama = "llama" in lname
    untied = llama or "nemotron" in lname  # Nemotron: separate output matrix, no biases
    model = ModelSpec(
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
    )
    used.append(f"attention={fw.attention}")

    tp, pp, cp, ep = (_int(row, k) or 1 for k in ("tp", "pp", "cp", "ep"))
    n_gpus = _int(row, "n_gpus")
    dp = _int(row, "dp") or (n_gpus // (tp * pp * cp) if n_gpus else None)
    mb, gb = _int(row, "microbatch"), _int(row, "global_batch")
    if dp is None or mb is None or gb is None:
        raise _Skip("data-parallel size, microbatch or global batch not given")
    if n_gpus is not None and dp * tp * pp * cp != n_gpus:
        raise _Skip(f"dp*tp*pp*cp = {dp * tp * pp * cp} differs from n_gpus = {n_gpus}")
    sp_cell = row.get("sp", "").strip()
    if sp_cell:
        sp = sp_cell == "1"
    else:
        sp = fw.sequence_parallel and tp > 1
        used.append(f"sequence_parallel={sp}")
    zero = _int(row, "zero")
    if zero is None:
        zero = fw.zero
        used.append(f"zero={zero}")
    recompute = row.get("recompute", "").strip()
    if not recompute:
        recompute = next(
            (r for key, fam, r in FAMILY_RECOMPUTE if key == fw_key and lname.startswith(fam)),
            fw.recompute,
        )
        used.append(f"recompute={recompute}")
    chunks = _int(row, "interleave_chunks")
    if chunks is None:
        chunks = 1
        used.append("interleave_chunks=1")
    schedule = "interleaved" if chunks > 1 else "1f1b"
    plan = PlanSpec(
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        ep=ep,
        sequence_parallel=sp,
        zero=zero,
        recompute=recompute,
        microbatch=mb,
        global_batch=gb,
        schedule=schedule,
        chunks=chunks,
        overlap_dp=fw.overlap_dp,
        overlap_tp=fw.overlap_tp and tp > 1,
        grad_reduce_fp32=fw.grad_reduce_fp32,
    )
    used.append(f"overlap_dp={fw.overlap_dp}")
    if not fw.grad_reduce_fp32 and zero < 3:
        used.append("grad_reduce_fp32=False")
    if n_micro := gb / (dp * mb):
        if abs(n_micro - round(n_micro)) > 1e-9:
            used.append(f"microbatches={n_micro:.3g} (fractional: global batch not divisible)")
    if model.n_layers % (pp * chunks):
        used.append(f"layers per stage={model.n_layers / (pp * chunks):.3g} (uneven split)")
    problems = config_mod.check_plan(model, cluster, plan, n_gpus=n_gpus, strict=False)
    if problems:
        raise _Skip("; ".join(problems))
    return model, plan, cluster, used


@jax.jit
def _simulate_batch(models, plans, clusters, params):
    return jax.vmap(simulate)(models, plans, clusters, params)


def number_error(text: str, integer: bool) -> str | None:
    """Why a numeric cell is unreadable, or None when it is a finite number (an integer if
    ``integer``). Shared with ``calibration.readers``."""
    try:
        value = float(text)
    except ValueError:
        return f"not a number: {text!r}"
    if not math.isfinite(value):
        return f"not a finite number: {text!r}"
    if integer and value != int(value):
        return f"not an integer: {text!r}"
    return None


class CsvLineError(ValueError):
    """A CSV row that cannot be read: its first ``line`` and why (callers add the file)."""

    def __init__(self, line: int, message: str):
        self.line, self.message = line, message
        super().__init__(f"line {line}: {message}")


def data_rows(reader, n_columns: int) -> Iterator[tuple[int, list[str]]]:
    """(first line, cells) of every row of a ``csv.reader`` past its header that has a
    non-blank cell. Shared with ``calibration.readers``.

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

    Rows whose cells are all blank are left out. Blank cells stay blank (``_row_to_specs``
    fills them); a numeric cell that holds something else is an error.

    Args:
        path: CSV in the schema of ``shared/data/README.md`` section 1.

    Returns:
        One dict per data row, in file order.

    Raises:
        ValueError: naming the file and line: an empty file, missing ``E2E_COLUMNS``, no data
            rows, a row with more or fewer cells than the header, or a cell of
            ``E2E_INT_COLUMNS`` / ``E2E_FLOAT_COLUMNS`` that is not a finite number (integer).
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
                    if row.get(col) and (why := number_error(row[col], col in E2E_INT_COLUMNS)):
                        raise CsvLineError(start, f"column '{col}': {why}")
                rows.append(row)
        except CsvLineError as e:
            raise ValueError(f"{path}: {e}") from None
    if not rows:
        raise ValueError(f"{path}: no data rows (only a header)")
    return rows


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Kendall's tau-b between two sequences (None with fewer than two pairs)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 2:
        return None
    dx = np.sign(x[:, None] - x[None, :])
    dy = np.sign(y[:, None] - y[None, :])
    iu = np.triu_indices(len(x), 1)
    dx, dy = dx[iu], dy[iu]
    concordant = np.sum(dx * dy)
    denom = math.sqrt(np.sum(dx != 0) * np.sum(dy != 0))
    return float(concordant / denom) if denom else None


def _summary(results: list[RowResult]) -> dict:
    done = [r for r in results if r.ape_pct is not None]
    apes = [r.ape_pct for r in done]
    return {
        "rows": len(results),
        "predicted": len(done),
        "skipped": len(results) - len(done),
        "mape_pct": float(np.mean(apes)) if apes else None,
        "max_ape_pct": float(np.max(apes)) if apes else None,
        "kendall_tau": kendall_tau(
            [r.measured_iter_s for r in done], [r.predicted_iter_s for r in done]
        ),
    }


def _cluster_params(cluster, params: Params | None, profile):
    """(cluster arrays, Params, note) for a cluster's rows; (None, None, reason) when the
    profile file given was fitted on another GPU family, whose rows are then skipped."""
    if params is not None:
        return cluster_arrays(cluster), params, "parameters given by the caller"
    from calibration.profile import ProfileMismatch, params_for

    try:
        cparams, note = params_for(cluster, profile)
    except ProfileMismatch as e:
        return None, None, f"not predicted: {e.reason}"
    return cluster_arrays(cluster), cparams, note


def validate(path: str | os.PathLike, params: Params | None = None, profile=None) -> dict:
    """Predict every row of a measurement CSV; per-row and per-source errors.

    Returns:
        ``{"summary": {...}, "by_source": {name: {...}}, "rows": [...]}`` with the keys
        documented in the README (``rows``, ``predicted``, ``skipped``, ``mape_pct``,
        ``max_ape_pct``, ``kendall_tau``), and ``profiles``: cluster -> which calibrated layers
        were used. ``params`` (one set for every row) overrides ``profile``; ``profile`` is None
        for each cluster's default calibrated profile, ``"none"`` for datasheet defaults, or a
        profile file. Rows with a blank or non-positive ``measured_iter_s`` are skipped (their
        ``skipped`` says why) and count in no error figure, and so are rows on a cluster of
        another GPU family than a given profile file's.

    Raises:
        ValueError: the file is not a readable end-to-end CSV (see :func:`read_rows`).
    """
    rows = read_rows(path)
    results: list[RowResult] = []
    batch = []
    cache: dict = {}
    cluster_cache: dict = {}
    for i, row in enumerate(rows, start=1):
        measured = row["measured_iter_s"]
        r = RowResult(
            row=i,
            source=row["source"],
            model=row["model"],
            cluster=row["cluster"],
            measured_iter_s=float(measured) if measured else None,
        )
        results.append(r)
        if r.measured_iter_s is None:
            r.skipped = "measured_iter_s blank"
            continue
        if r.measured_iter_s <= 0:
            r.skipped = f"measured_iter_s {measured} is not a positive time"
            continue
        try:
            model, plan, cluster, used = _row_to_specs(row, cache)
        except _Skip as e:
            r.skipped = str(e)
            continue
        r.defaults = used
        if cluster.name not in cluster_cache:
            cluster_cache[cluster.name] = _cluster_params(cluster, params, profile)
        carr, cparams, note = cluster_cache[cluster.name]
        if carr is None:  # the profile file is another GPU's
            r.skipped = note
            continue
        batch.append((r, model_arrays(model), plan_arrays(plan), carr, cparams))
    if batch:
        models = stack([b[1] for b in batch])
        plans = stack([b[2] for b in batch])
        clusters = stack([b[3] for b in batch])
        row_params = stack([b[4] for b in batch])
        out = jax.tree_util.tree_map(
            np.asarray, _simulate_batch(models, plans, clusters, row_params)
        )
        from diffcost.simulate import STATUS_NAMES

        for j, (r, *_rest) in enumerate(batch):
            pred = float(out.iteration_s[j])
            r.predicted_iter_s = pred
            r.status = STATUS_NAMES[int(out.status[j])]
            r.ape_pct = abs(pred - r.measured_iter_s) / r.measured_iter_s * 100.0
    by_source: dict[str, list[RowResult]] = {}
    for r in results:
        by_source.setdefault(r.source, []).append(r)
    return {
        "summary": _summary(results),
        "by_source": {k: _summary(v) for k, v in by_source.items()},
        "rows": [dataclasses.asdict(r) for r in results],
        "profiles": {name: v[2] for name, v in cluster_cache.items() if v[0] is not None},
    }
