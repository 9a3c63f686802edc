"""Read SimuMax machine descriptions: a node's kernel table and its fitted NCCL parameters.

Two files (``shared/data/README.md`` section 3b), the case of a user who has microbenchmarks
of a new machine and no training run on it:

* the kernel table (``kernels/b200_simumax_kernels.csv``): efficiency against the peak per
  measured operator shape. Rows become records as follows.

  - ``gemm``: a :class:`GemmRecord` of ``time = 2 b m n k / (efficiency * peak)``. The
    forward (``TN``), activation-gradient (``NN``) and weight-gradient (``NT``) GEMMs of a
    linear layer are all kept; SimuMax writes a weight gradient as the transposed product
    (``m`` the layer's output width), so ``m`` and ``n`` of ``NT`` rows are swapped to the
    orientation the model times its weight gradients in (``kernels._gemm_times``: output ``k x
    n`` of the forward GEMM). ``accumulate`` and the output type do not change the FLOPs; the
    model has no term for them, so both variants are kept and the fit averages them.
  - ``attention_fwd`` / ``attention_bwd``: an :class:`AttentionRecord`. SimuMax's FLOP count
    (``simu_tools/efficency_test/test_fa_efficiency.py``) is the full square whether or not the
    kernel is causal: ``2 b s^2 max(heads, kv_heads) (d_qk + d_v)`` forward and 2.5 times that
    backward, so ``time = flops / (efficiency * peak)`` (efficiencies above 1 are causal
    kernels beating the full-square count). The kernels are Transformer Engine's fused causal
    attention (the README); ``qkv_contiguous`` is a memory layout the model has no term for,
    so both layouts are kept.
  - ``memory_default``: a :class:`MemoryRecord` of one GiB moved at ``efficiency`` times the
    row's bandwidth. SimuMax counts that bandwidth in GiB/s (``gbps * 1024**3`` in its
    ``compute_mem_access_time``), so the rate is ``efficiency * bandwidth_GBps * 2^30`` B/s.
  - An optional column ``load`` says how the GEMM and attention rows were timed: ``burst``
    (blank; the kernel's rate on a GPU that has not yet settled under its power limit) or
    ``sustained`` (back to back until the clock settles under the power limit, as
    ``benchmarks/gpu_measure.py`` times them). SimuMax's own tables are read as burst; its
    tool times each GEMM shape as 25 warm-up and 75 timed calls back to back
    (``simu_tools/efficency_test/test_gemm_efficiency.py``), with host-side work between
    groups of shapes, so they sit between the two. A sustained row is compared with the model's
    kernel at a training step's rate (``step_compute``, which otherwise scales only the
    end-to-end runs' kernels), so such a table does not count the clock drop twice.
  - skipped with the reason: ``grouped_gemm`` (the model times MoE expert GEMMs as dense
    GEMMs of the routed tokens; a grouped kernel's efficiency would pull the dense GEMM
    constants), ``*_default`` (SimuMax's fallback factors for shapes not in its table: means
    of the rows above, not measurements), ``memory_ce``, ``memory_ce_fusion`` (cross entropy:
    an efficiency against SimuMax's byte count of the loss, which is not the model's
    ``LOSS_*_BYTES_PER_LOGIT``) and ``memory_permute_*`` (MoE token permutation, a kernel the
    model does not have).

* the collective fit (``collectives/b200_simumax_collective_fit.csv``): parameters, not
  timings. They become :class:`CollectiveRecord` s *derived from the fitted parameters*:
  SimuMax's own formula (``SystemConfig.compute_net_op_time``) evaluated on a grid, every
  octave of message size from 64 KiB to 1 GiB, for groups of 2, 4 and 8 ranks inside the node
  (send/recv: one pair). With ``n`` ranks, ``size`` bytes and the row's ``scale``, ``offset``,
  ``efficiency``, ``link_GBps``, ``latency_us`` and ``fixed_latency_us``::

      time = size * scale * (1 + offset / n) / (efficiency * link_GBps * 2^30)
             + latency_us * scale * (n + offset) + fixed_latency_us        (collectives)
      time = size / (efficiency * link_GBps * 2^30) + latency_us            (p2p)

  with the all-to-all's fixed latency per group size from the row's notes. A row whose fitted
  efficiency is above 1 (``p2p``: 1.45 of the 900 GB/s one-direction link, so SimuMax's size
  counts other bytes than one transfer's) is skipped with the reason: the model's send of
  ``size`` bytes cannot beat the link. The derived records say what they are in their
  ``source_name``; they carry no more information than the parameters, but in the form the fit
  compares the model with (time per size and group), so the cluster's link constants are
  fitted the same way as from nccl-tests tables. ``high_intra_node`` is used;
  ``low_intra_node`` (SimuMax's second intra-node class, the same parameters in this file) and
  ``inter_node`` (not fitted: one node) are skipped with the reason.
"""

from __future__ import annotations

import ast
import dataclasses
import re

from calibration.records import (
    AttentionRecord,
    CollectiveRecord,
    CsvTable,
    GemmRecord,
    Measurements,
    MemoryRecord,
    ReaderError,
    Source,
    dtype_name,
)
from diffcost.gpus import family_peak_flops, gpu_family

KERNELS_REQUIRED = ("source", "gpu", "cluster", "op", "efficiency", "peak_tflops")
COLLECTIVE_FIT_REQUIRED = (
    "source",
    "cluster",
    "link",
    "collective",
    "link_GBps",
    "efficiency",
    "latency_us",
    "scale",
    "offset",
)
_GEMM_LAYOUTS = ("TN", "NN", "NT")
_SKIPPED_OPS = {
    "grouped_gemm": "grouped GEMM (MoE experts): the model times expert GEMMs as dense GEMMs",
    "memory_ce": "cross-entropy bandwidth: an efficiency against SimuMax's byte count",
    "memory_ce_fusion": "cross-entropy bandwidth: an efficiency against SimuMax's byte count",
    "memory_permute_fwd": "MoE token permutation: no such kernel in the model",
    "memory_permute_bwd": "MoE token permutation: no such kernel in the model",
}
LOADS = ("burst", "sustained")  # column 'load': how a kernel row was timed
MEMORY_BYTES = float(2**30)  # the transfer a memory row is turned into
GIB = float(2**30)  # SimuMax's GB/s are GiB/s (``gbps * 1024**3``)
DERIVED_SIZES = tuple(float(2**e) for e in range(16, 31))
DERIVED_GROUPS = (2, 4, 8)
# A fitted bus rate above the one-direction link (SimuMax's p2p: 1.45 x 900 GB/s) counts
# bytes differently from the model's send of ``size`` bytes one way over the link; its times
# cannot be compared with the model's.
_OVER_LINK = "a rate above the one-direction link: SimuMax counts other bytes than the model"
_COLLECTIVE_NAMES = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "all2all": "all_to_all",
    "p2p": "send_recv",
}


def _positive(table: CsvTable, row, line, col, integer=False):
    """The cell as a number; a blank or non-positive cell is a ReaderError naming it."""
    value = table.number(row, line, col, integer)
    if value is None or value <= 0:
        shown = row.get(col, "")
        raise ReaderError(
            table.path, line, f"column '{col}': {shown!r} is not a positive number ({row['op']})"
        )
    return value


def _gemm(table, row, line, where, peak) -> GemmRecord:
    dims = [_positive(table, row, line, c, integer=True) for c in ("batch", "m", "n", "k")]
    batch, m, n, k = dims
    layout = row.get("layout", "")
    if layout not in _GEMM_LAYOUTS:
        valid = ", ".join(_GEMM_LAYOUTS)
        raise ReaderError(table.path, line, f"column 'layout': {layout!r} is not one of {valid}")
    if layout == "NT":  # SimuMax writes the weight gradient transposed
        m, n = n, m
    rate = _positive(table, row, line, "efficiency") * peak
    out_dtype = row.get("out_dtype", "") or row.get("dtype", "")
    return GemmRecord(
        gpu=gpu_family(row["gpu"]),
        batch=batch,
        m=m,
        n=n,
        k=k,
        precision=dtype_name(row.get("dtype", "") or "bf16"),
        time_s=2.0 * batch * m * n * k / rate,
        where=where,
        dtype=f"{row.get('dtype', '')}->{out_dtype} {layout}",
        source_name=row["source"],
    )


def _attention(table, row, line, where, peak) -> AttentionRecord:
    cols = ("batch", "seq_len", "heads", "kv_heads", "qk_head_dim", "v_head_dim")
    batch, seq, heads, kv, d_qk, d_v = (_positive(table, row, line, c, True) for c in cols)
    if heads % kv:
        raise ReaderError(
            table.path, line, f"column 'kv_heads': {kv} does not divide heads = {heads}"
        )
    stage = "fwd" if row["op"] == "attention_fwd" else "bwd"
    flops = (2.0 if stage == "fwd" else 5.0) * batch * seq**2 * max(heads, kv) * (d_qk + d_v)
    causal = row.get("causal", "True").strip().lower() not in ("false", "0", "no")
    return AttentionRecord(
        gpu=gpu_family(row["gpu"]),
        stage=stage,
        batch=batch,
        seq_len=seq,
        heads=heads,
        kv_heads=kv,
        head_dim=(d_qk + d_v) / 2.0,
        causal=causal,
        time_s=flops / (_positive(table, row, line, "efficiency") * peak),
        where=where,
        source_name=row["source"],
    )


def _sustained(table, row, line) -> bool:
    """Whether the row was timed under sustained load (column ``load``; blank: burst)."""
    value = (row.get("load") or "burst").strip().lower()
    if value not in LOADS:
        raise ReaderError(
            table.path,
            line,
            f"column 'load': {row.get('load')!r} is not one of {', '.join(LOADS)} (blank: burst)",
        )
    return value == "sustained"


def _memory(table, row, line, where) -> MemoryRecord:
    bandwidth = _positive(table, row, line, "bandwidth_GBps") * GIB
    rate = _positive(table, row, line, "efficiency") * bandwidth
    return MemoryRecord(
        gpu=gpu_family(row["gpu"]),
        cluster=row["cluster"],
        n_bytes=MEMORY_BYTES,
        time_s=MEMORY_BYTES / rate,
        where=where,
        source_name=row["source"],
    )


def read_simumax_kernels(path) -> Measurements:
    """Records of a SimuMax kernel table (module docstring: what each op becomes); skipped
    rows are listed with their reason.

    Raises:
        ReaderError: a missing column, or a row whose shape, efficiency or peak is blank,
            not a number or not positive (``file:line: column 'x': ...``).
    """
    table = CsvTable(path, KERNELS_REQUIRED, "SimuMax kernel table")
    out = Measurements()
    for line, row in table.rows():
        where, op = Source(table.path, line), row["op"]
        if op in _SKIPPED_OPS:
            out.skipped.append((where, _SKIPPED_OPS[op]))
        elif op.endswith("_default") and op != "memory_default":
            out.skipped.append((where, f"{op}: SimuMax's fallback factor, not a measurement"))
        elif op == "memory_default":
            out.memory.append(_memory(table, row, line, where))
        elif op in ("gemm", "attention_fwd", "attention_bwd"):
            peak = _positive(table, row, line, "peak_tflops") * 1e12
            read = _gemm if op == "gemm" else _attention
            record = read(table, row, line, where, peak)
            record = dataclasses.replace(record, sustained=_sustained(table, row, line))
            family_peak = family_peak_flops(record.gpu, "bf16")
            if family_peak is not None and abs(peak / family_peak - 1.0) > 1e-6:
                raise ReaderError(
                    table.path,
                    line,
                    f"column 'peak_tflops': {peak / 1e12:g} differs from the "
                    f"{record.gpu} dense bf16 peak of the presets ({family_peak / 1e12:g})",
                )
            (out.gemms if op == "gemm" else out.attention).append(record)
        else:
            known = "gemm, attention_fwd, attention_bwd, memory_default, " + ", ".join(_SKIPPED_OPS)
            raise ReaderError(table.path, line, f"column 'op': unknown op {op!r} (known: {known})")
    return out


def _fixed_by_group(notes: str) -> dict:
    match = re.search(r"fixed_latency_us_by_comm_num (\{[^}]*\})", notes)
    return {int(k): float(v) for k, v in ast.literal_eval(match.group(1)).items()} if match else {}


def simumax_collective_s(collective, size, n, params) -> float:
    """SimuMax's time of ``collective`` (its name) on ``size`` bytes over ``n`` ranks in one
    node, seconds, from the fitted ``params`` (module docstring)."""
    scale, offset, eff, link_Bps, lat, fixed = params
    if collective == "p2p":
        return size / (eff * link_Bps) + lat * 1e-6
    volume = size * scale * (1.0 + offset / n)
    return volume / (eff * link_Bps) + (lat * scale * (n + offset) + fixed.get(n, 0.0)) * 1e-6


def read_simumax_collective_fit(path) -> Measurements:
    """Collective records derived from a SimuMax collective fit (module docstring).

    Raises:
        ReaderError: a missing column, an unknown collective, a blank or non-numeric parameter.
    """
    table = CsvTable(path, COLLECTIVE_FIT_REQUIRED, "SimuMax collective fit")
    out = Measurements()
    for line, row in table.rows():
        where = Source(table.path, line)
        name = row["collective"]
        if name not in _COLLECTIVE_NAMES:
            known = ", ".join(_COLLECTIVE_NAMES)
            raise ReaderError(table.path, line, f"column 'collective': {name!r} (known: {known})")
        if row["link"] != "high_intra_node":
            why = "not fitted: one node" if row["link"] == "inter_node" else "high_intra_node used"
            out.skipped.append((where, f"SimuMax link class {row['link']}: {why}"))
            continue
        efficiency = _positive(table, row, line, "efficiency")
        if efficiency > 1.0:
            out.skipped.append((where, f"{name} efficiency {efficiency:g} > 1: {_OVER_LINK}"))
            continue
        scale = table.number(row, line, "scale")
        offset = table.number(row, line, "offset")
        if scale is None or offset is None:
            raise ReaderError(table.path, line, "columns 'scale' and 'offset' must be numbers")
        fixed = table.number(row, line, "fixed_latency_us") or 0.0
        by_group = _fixed_by_group(row.get("notes", ""))
        params = (
            scale,
            offset,
            efficiency,
            _positive(table, row, line, "link_GBps") * GIB,
            table.number(row, line, "latency_us") or 0.0,
            {n: by_group.get(n, fixed) for n in DERIVED_GROUPS},
        )
        groups = (2,) if name == "p2p" else DERIVED_GROUPS
        for n in groups:
            for size in DERIVED_SIZES:
                out.collectives.append(
                    CollectiveRecord(
                        collective=_COLLECTIVE_NAMES[name],
                        size_bytes=size,
                        group_size=n,
                        per_node=n,
                        n_nodes=1,
                        n_groups=1,
                        cluster=row["cluster"] or None,
                        dtype="bf16",
                        time_s=simumax_collective_s(name, size, n, params),
                        source_name=f"{row['source']} (derived from fitted NCCL parameters)",
                        where=where,
                    )
                )
    return out
